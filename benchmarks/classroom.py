"""A class on one server: N students, each in their own kernel with their own 4-rank pool, run notebook 02.

Each student is a separate process driving a fresh Jupyter kernel through nbclient, as JupyterHub would
give each student a kernel; the pools start without spare engines (``CLUSTER_LAB_SPARE_ENGINES=0``), as
docs/teaching.md recommends for a shared server. Everyone presses "run" at once, cell by cell, which is
the worst case for a class following the teacher. Printed per N:

- memory: the peak of the summed PSS (proportional set size: a page shared by k processes counts 1/k in
  each, so the sum is the memory really used) over every process the students started, and per student;
- time per cell: the median and the slowest student, and the slowdown against N = 1;
- CPU: CPU-seconds one student's process tree used for the whole notebook;
- failures: students whose notebook raised (a cell past the timeout counts).

Then the extrapolation to a bigger server: memory scales with students (PSS per student × S), and when
all S students run the same cell at once on C cores, a cell needs about max(t₁, S · cpu₁ / C), with t₁ and
cpu₁ the N = 1 wall time and CPU-seconds (the CPU work does not shrink by sharing; only waiting grows).

Run: ``python benchmarks/classroom.py [--students 1 4 8] [--server-cores 32 --server-students 30]``
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from nbclient import NotebookClient

from lab.course.exercises import solved

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "02_data_parallel.ipynb"


def run_student(notebook: Path, out: Path, cell_timeout: int) -> None:
    """One student: the solved notebook, cell by cell, in a fresh kernel; times and any failure to ``out``."""
    nb = solved(notebook)
    client = NotebookClient(nb, timeout=cell_timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(notebook.parent)}})
    times: list[float] = []
    error = None
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            start = time.perf_counter()
            try:
                client.execute_cell(cell, i)
            except Exception as failed:  # recorded, not raised: the parent counts failures
                error = f"cell {i}: {type(failed).__name__}: {str(failed)[-300:]}"
                break
            finally:
                times.append(time.perf_counter() - start)
    out.write_text(json.dumps({"times": times, "error": error}))


def _tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _pss_and_cpu(proc: psutil.Process) -> tuple[int, float]:
    try:
        cpu = proc.cpu_times()
        return proc.memory_full_info().pss, cpu.user + cpu.system
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0, 0.0


def run_class(students: int, notebook: Path, cell_timeout: int) -> dict:
    """Start ``students`` at once; sample memory and CPU of their process trees until all have finished."""
    env = {**os.environ, "CLUSTER_LAB_SPARE_ENGINES": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"student{i}.json" for i in range(students)]
        procs = [subprocess.Popen([sys.executable, __file__, "--student", str(out), "--notebook", str(notebook),
                                   "--cell-timeout", str(cell_timeout)], env=env, cwd=ROOT) for out in outs]
        roots = [psutil.Process(p.pid) for p in procs]
        peak, cpu_seen = 0, [dict() for _ in procs]  # per student: pid -> last CPU-seconds seen
        start = time.perf_counter()
        while any(p.poll() is None for p in procs):
            total = 0
            for i, root in enumerate(roots):
                for proc in _tree(root):
                    pss, cpu = _pss_and_cpu(proc)
                    total += pss
                    cpu_seen[i][proc.pid] = max(cpu, cpu_seen[i].get(proc.pid, 0.0))
            peak = max(peak, total)
            time.sleep(0.5)
        wall = time.perf_counter() - start
        results = [json.loads(out.read_text()) if out.exists() else {"times": [], "error": "no result"} for out in outs]
    return {"students": students, "peak_pss": peak, "wall_s": wall, "results": results,
            "cpu_s": [sum(seen.values()) for seen in cpu_seen]}


def _report(run: dict, base: dict | None) -> None:
    n, results = run["students"], run["results"]
    failures = [r["error"] for r in results if r["error"]]
    print(f"\nN = {n}: peak PSS {run['peak_pss'] / 2**30:.2f} GiB in all, {run['peak_pss'] / n / 2**30:.2f} GiB per student; "
          f"wall {run['wall_s']:.0f} s; CPU per student {statistics.median(run['cpu_s']):.0f} s; "
          f"failures {len(failures)}/{n}")
    for error in failures:
        print(f"  failed: {error}")
    cells = max(len(r["times"]) for r in results)
    for c in range(cells):
        col = [r["times"][c] for r in results if len(r["times"]) > c]
        slower = ""
        if base and len(base["results"][0]["times"]) > c:
            slower = f"  ×{statistics.median(col) / base['results'][0]['times'][c]:.1f} vs N=1"
        print(f"  code cell {c:2d}: median {statistics.median(col):6.1f} s, slowest {max(col):6.1f} s{slower}")


def _extrapolate(base: dict, cores: int, students: int) -> None:
    t1 = sum(base["results"][0]["times"])
    cpu1 = statistics.median(base["cpu_s"])
    pss1 = base["peak_pss"]
    print(f"\nExtrapolated to {students} students on a {cores}-core server (from N = 1 here: notebook {t1:.0f} s wall, "
          f"{cpu1:.0f} CPU-s, {pss1 / 2**30:.2f} GiB PSS):")
    print(f"  memory: {students * pss1 / 2**30:.1f} GiB for the pools and kernels (plus the hub and the OS)")
    print(f"  whole notebook, everyone at once: about {max(t1, students * cpu1 / cores):.0f} s "
          f"(alone: {t1:.0f} s); cores for no slowdown: {students * cpu1 / t1:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--students", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--notebook", type=Path, default=NOTEBOOK)
    parser.add_argument("--cell-timeout", type=int, default=900)
    parser.add_argument("--server-cores", type=int, default=32)
    parser.add_argument("--server-students", type=int, default=30)
    parser.add_argument("--student", type=Path, help=argparse.SUPPRESS)  # a child: one student's run
    args = parser.parse_args()
    if args.student:
        run_student(args.notebook, args.student, args.cell_timeout)
        return
    print(f"{args.notebook.name}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB; "
          "4 ranks per student, no spare engines")
    base = None
    for n in args.students:
        run = run_class(n, args.notebook, args.cell_timeout)
        _report(run, base)
        base = base or (run if n == 1 else None)
    if base:
        _extrapolate(base, args.server_cores, args.server_students)


if __name__ == "__main__":
    main()
