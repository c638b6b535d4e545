"""A real-browser harness: JupyterLab on loopback, driven by Playwright in Debian's Chromium.

Never downloads a browser: it uses ``/usr/bin/chromium`` (``apt-get install chromium``).
"""
from __future__ import annotations

import contextlib
import json
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest

from lab.course.exercises import solved

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


def write_code_notebook(path: Path, sources: list[str]) -> Path:
    """A notebook at ``path`` (its folder made) with one unrun code cell per source; returns ``path``."""
    cells = [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": src}
             for src in sources]
    notebook = {"cells": cells, "nbformat": 4, "nbformat_minor": 5,
                "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                             "language_info": {"name": "python"}}}
    path.parent.mkdir()
    path.write_text(json.dumps(notebook))
    return path


def require_browser() -> None:
    """Skip, saying what to install, when Chromium or Playwright is missing."""
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian chromium is not installed (apt-get install chromium); .ci/run installs it")
    pytest.importorskip("playwright", reason="pip install playwright (no browser download is needed)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def jupyter_lab(root: Path) -> Iterator[str]:
    """Serve ``root`` with JupyterLab on loopback; yield the base URL with its token."""
    port, token = _free_port(), secrets.token_hex(16)
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.open_browser=False",
         "--allow-root"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("JupyterLab did not come up within 60 s")
                time.sleep(0.5)
        yield f"{base}|{token}"
    finally:
        with contextlib.suppress(OSError):  # a clean shutdown also stops the kernels and their engines
            urllib.request.urlopen(urllib.request.Request(f"{base}/api/shutdown?token={token}", method="POST"), timeout=5)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _accept_kernel_dialog(page) -> None:
    # JupyterLab may still ask which kernel to start, even for a notebook whose metadata names one.
    select = page.locator(".jp-Dialog").get_by_role("button", name="Select", exact=True)
    try:
        select.wait_for(timeout=10_000)
    except Exception:  # no dialog: the kernel started on its own
        return
    select.click()


@contextlib.contextmanager
def notebook_running(notebook: Path, tmp_path: Path) -> Iterator[object]:
    """Open a copy of ``notebook`` in JupyterLab in a real browser, press Run All, and yield the page at once.

    The cells are still running: wait for each output with :func:`wait_for_output`, which also
    tells how long each step took.
    """
    from playwright.sync_api import sync_playwright

    nbformat.write(solved(notebook), tmp_path / notebook.name)  # exercises solved, as tests/notebook_runs.py runs them
    with jupyter_lab(tmp_path) as handle, sync_playwright() as pw:
        base, token = handle.split("|")
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{base}/lab/tree/{notebook.name}?token={token}")
            page.wait_for_selector(".jp-Notebook", timeout=60_000)
            _accept_kernel_dialog(page)
            # The kernel must be idle before anything runs, or the first cells are dropped.
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
            yield page
        finally:
            browser.close()


def wait_for_output(page, text: str, timeout_s: float, *, name: str = "notebook"):
    """The first cell output holding ``text`` (never a cell's source), once it shows; on a timeout,
    a full-page screenshot is left in test-artifacts/failed-<name>.png."""
    output = page.locator(".jp-OutputArea-output", has_text=text).first
    try:
        output.wait_for(timeout=timeout_s * 1000)
    except Exception:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"failed-{name}.png"), full_page=True)
        raise
    return output


@contextlib.contextmanager
def browser_session(notebook: Path, tmp_path: Path, done_text: str, timeout_s: float = 180):
    """Run every cell of a copy of ``notebook`` in a real browser and yield the page once
    ``done_text`` shows up in an output."""
    with notebook_running(notebook, tmp_path) as page:
        wait_for_output(page, done_text, timeout_s, name=notebook.stem)
        yield page
