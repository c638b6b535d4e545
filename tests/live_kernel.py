"""A real IPython kernel driven through jupyter_client, as JupyterLab drives one, running this checkout's code."""
from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

WORKTREE = str(Path(__file__).resolve().parents[1])


def kernel_env() -> dict[str, str]:
    """This process's environment with this checkout first on PYTHONPATH (engines inherit it)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [WORKTREE, os.environ.get("PYTHONPATH")]))}


class Kernel:
    """A real IPython kernel driven through jupyter_client, as JupyterLab drives one."""

    def __init__(self) -> None:
        from jupyter_client import KernelManager

        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel(env=kernel_env(), cwd=WORKTREE)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)

    @property
    def pid(self) -> int:
        return self.manager.provisioner.process.pid

    def run(self, code: str, timeout: float = 300) -> str:
        """Execute ``code``; returns its stdout, fails the test with the kernel's error."""
        out: list[str] = []
        reply = self.client.execute_interactive(textwrap.dedent(code), timeout=timeout, output_hook=lambda msg: (
            out.append(msg["content"].get("text", "")) if msg["msg_type"] == "stream" else None))
        if reply["content"]["status"] != "ok":
            pytest.fail(f"the kernel raised: {reply['content'].get('ename')}: {reply['content'].get('evalue')}\n"
                        + "".join(out))
        return "".join(out)

    def messages_of(self, code: str, timeout: float = 300) -> list[dict]:
        """Execute ``code``; every iopub message (comm updates from other threads too) until it ends, in order."""
        msg_id = self.client.execute(textwrap.dedent(code))
        seen: list[dict] = []
        deadline = time.monotonic() + timeout
        while True:
            msg = self.client.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
            seen.append(msg)
            mine = msg["parent_header"].get("msg_id") == msg_id
            if mine and msg["msg_type"] == "error":
                pytest.fail(f"the kernel raised: {msg['content']['ename']}: {msg['content']['evalue']}")
            if mine and msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return seen

    def close(self) -> None:
        self.client.stop_channels()
        if self.manager.is_alive():
            self.manager.shutdown_kernel(now=True)
