"""Nothing the lab starts outlives its driver: a killed or stopped kernel or script leaves no process behind.

The kernel tests drive a real IPython kernel through ``jupyter_client``, as JupyterLab does; the script tests run a
real Python script that starts a pool. Each counts the lab's processes by what they are: every descendant of the
driver seen while it ran, and every process whose command names the driver's PID to ``kernels.engine.driver_watch`` (the
command of everything the lab starts), so a spare started a moment before the death is counted too.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from kernels.engine import driver_watch
from tests.launcher_checks import needs_mpi
from tests.live_kernel import WORKTREE, Kernel, kernel_env

POOL = "lab.start(n=4, backend='gloo', activate=False, spare_engines=1, timeout=120)"


def lab_processes(driver: int, seen: set[int]) -> list[psutil.Process]:
    """The lab's processes of ``driver`` still running (zombies are dead: they only wait to be reaped)."""
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        if proc.pid in seen or ("kernels.engine.driver_watch" in cmd and str(driver) in cmd):
            found[proc.pid] = proc
    alive = []
    for proc in found.values():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    return alive


def wait_for_none(driver: int, seen: set[int], within_s: float) -> float:
    """Seconds until no lab process of ``driver`` is left; fails (and kills the leftovers) after ``within_s``."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        if not lab_processes(driver, seen):
            return time.monotonic() - start
        time.sleep(0.25)
    left = lab_processes(driver, seen)
    for proc in left:  # this test started them: do not leave them to the next test
        proc.kill()
    pytest.fail(f"{len(left)} lab processes still alive {within_s} s after the driver ended: "
                f"{[(p.pid, ' '.join(p.cmdline()[-3:])) for p in left]}")


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` now."""
    return {p.pid for p in psutil.Process(pid).children(recursive=True)}


# ---------------------------------------------------------------------- the watch itself
def test_a_watched_process_and_its_forks_end_when_the_driver_is_gone():
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    # The watched program forks a child (as the controller forks its schedulers), then both sleep.
    program = "import os, time\npid = os.fork()\nif pid:\n    print(pid, flush=True)\ntime.sleep(600)\n"
    started = psutil.Process(driver.pid).create_time()
    folder = _target_dir(program)
    env = {**kernel_env(), "PYTHONPATH": os.pathsep.join([folder, kernel_env()["PYTHONPATH"]])}
    watched = subprocess.Popen([sys.executable, "-m", "kernels.engine.driver_watch", str(driver.pid), repr(started),
                                "runpy_target"], env=env, stdout=subprocess.PIPE, cwd=WORKTREE)
    forked = int(watched.stdout.readline())
    try:
        time.sleep(2 * driver_watch.CHECK_S)
        assert watched.poll() is None and psutil.pid_exists(forked)  # alive while the driver is
        driver.kill()
        driver.wait()
        assert watched.wait(timeout=10) == 0
        deadline = time.monotonic() + 10
        while psutil.pid_exists(forked) and psutil.Process(forked).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the forked child outlived the driver"
            time.sleep(0.1)
    finally:
        for proc in (driver, watched):
            proc.kill()
        if psutil.pid_exists(forked):
            os.kill(forked, signal.SIGKILL)


def _target_dir(program: str) -> str:
    """A folder holding ``runpy_target.py`` (the watched program); kept for the session, it is a few bytes."""
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"cluster-lab-watch-{os.getpid()}"
    folder.mkdir(exist_ok=True)
    (folder / "runpy_target.py").write_text(program)
    return str(folder)


def test_a_reused_pid_is_not_the_driver():
    me = psutil.Process()
    assert driver_watch.driver_alive(me.pid, me.create_time())
    assert not driver_watch.driver_alive(me.pid, me.create_time() - 3600)  # same PID, another process's start


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["sigterm", "sighup"])
def test_a_terminating_signal_stops_every_pool_then_ends_the_process_as_before(sig):
    script = textwrap.dedent(f"""
        import os, signal, sys
        from lab.pool import lifetime

        class Pool:
            def __init__(self, name):
                self.name = name
            def stop(self):
                print("stopped", self.name, flush=True)

        pools = [Pool("a"), Pool("b")]
        for pool in pools:
            lifetime.stop_on_termination(pool)
        os.kill(os.getpid(), {int(sig)})
        print("still running", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], env=kernel_env(), cwd=WORKTREE, capture_output=True,
                          text=True, timeout=60)
    assert sorted(done.stdout.split("\n")[:2]) == ["stopped a", "stopped b"]
    assert "still running" not in done.stdout and done.returncode == -sig  # ended by the signal, as by default


def test_a_handler_installed_before_the_lab_still_runs_after_the_pools_stop():
    script = textwrap.dedent("""
        import os, signal
        from lab.pool import lifetime

        class Pool:
            def stop(self):
                print("stopped", flush=True)

        signal.signal(signal.SIGTERM, lambda *_: print("previous handler", flush=True))
        pool = Pool()
        lifetime.stop_on_termination(pool)
        os.kill(os.getpid(), signal.SIGTERM)
        print("went on", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], env=kernel_env(), cwd=WORKTREE, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.split() == ["stopped", "previous", "handler", "went", "on"] and done.returncode == 0


# ---------------------------------------------------------------------- scripts
def _script_driver(tmp_path: Path, after_start: str = "", pool: str = POOL) -> tuple[subprocess.Popen, set[int]]:
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(f"""
        import time, warnings
        import lab
        warnings.simplefilter("ignore")
        pool = {pool}
        {after_start}
        print("READY", flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], env=kernel_env(), cwd=WORKTREE, stdout=subprocess.PIPE)
    line = proc.stdout.readline().decode()
    if "READY" not in line:
        proc.kill()
        pytest.fail(f"the script's pool did not start: {line!r}")
    time.sleep(1)  # the spare's nanny starts a moment after the spare registers
    return proc, descendants(proc.pid)


@pytest.mark.slow  # starts a 4-rank pool in a script
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_script_driver_ended_by_a_signal_leaves_no_process(tmp_path, sig):
    proc, seen = _script_driver(tmp_path)
    assert len(seen) >= 10  # controller and its schedulers, 4 ranks and a spare, their nannies
    proc.send_signal(sig)
    proc.wait(timeout=30)
    took = wait_for_none(proc.pid, seen, within_s=15)
    print(f"{sig.name}: no lab process left {took:.1f} s after the script ended")


@pytest.mark.slow  # starts an MPI pool in a script
def test_an_mpi_pool_ends_with_its_killed_script_driver(tmp_path):
    needs_mpi()
    proc, seen = _script_driver(tmp_path, pool="lab.start(n=2, launcher='mpi', backend='gloo', activate=False, "
                                              "spare_engines=0, timeout=120)")
    names = {psutil.Process(p).name() for p in seen if psutil.pid_exists(p)}
    assert "mpiexec" in names, names  # the engines run under one mpiexec, not as the driver's children
    proc.kill()
    proc.wait(timeout=30)
    took = wait_for_none(proc.pid, seen, within_s=15)
    print(f"MPI pool: no lab process left {took:.1f} s after the script was killed")


@pytest.mark.slow  # starts ipcluster engines and a script that attaches to them
def test_engines_attached_with_connect_survive_their_drivers_death(tmp_path):
    from tests.ipcluster_server import CLUSTER_ID, ipcluster

    with ipcluster(tmp_path, "local", 2) as profile_dir:
        script = tmp_path / "attach.py"
        script.write_text(textwrap.dedent(f"""
            import time, warnings
            import lab
            warnings.simplefilter("ignore")
            while True:
                try:
                    pool = lab.connect(profile_dir={profile_dir!r}, cluster_id={CLUSTER_ID!r}, n=2,
                                       backend="gloo", activate=False)
                    break
                except (FileNotFoundError, OSError):  # ipcluster has not written its cluster file yet
                    time.sleep(0.5)
            print("READY", *[r.pid for r in pool.rank_map.ranks], flush=True)
            time.sleep(600)
        """))
        proc = subprocess.Popen([sys.executable, str(script)], env=kernel_env(), cwd=WORKTREE, stdout=subprocess.PIPE)
        try:
            words = proc.stdout.readline().decode().split()
            assert words[:1] == ["READY"], words
            engine_pids = [int(w) for w in words[1:]]
        finally:
            proc.kill()
            proc.wait(timeout=30)
        time.sleep(2 * driver_watch.CHECK_S + 3)  # longer than a watched process needs to notice and end
        assert all(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in engine_pids)


# ---------------------------------------------------------------------- kernels
@pytest.fixture
def kernel():
    k = Kernel()
    try:
        k.run(f"""
            import warnings
            import lab
            warnings.simplefilter("ignore")
            pool = {POOL}
            import time
            deadline = time.monotonic() + 120
            while pool.spares() < 1 and time.monotonic() < deadline:  # the spare registers and warms after start
                time.sleep(0.2)
        """)
        yield k
    finally:
        k.close()


@pytest.mark.slow  # a kernel with a 4-rank pool
def test_a_killed_kernel_leaves_no_process_of_its_pool_and_spare(kernel):
    assert kernel.run("print(pool.spares())").strip() == "1"
    driver, seen = kernel.pid, descendants(kernel.pid)
    kernel.manager.shutdown_kernel(now=True)  # SIGKILL: what a crashed or out-of-memory kernel amounts to
    took = wait_for_none(driver, seen, within_s=15)
    print(f"kernel SIGKILL: no lab process left after {took:.1f} s")


@pytest.mark.slow  # a kernel with a 4-rank pool
def test_shutting_down_a_kernel_after_a_spare_replaced_a_rank_leaves_nothing(kernel):
    out = kernel.run("""
        import os
        def die_on_rank_1():
            if rank == 1:
                os._exit(3)
            return rank
        try:
            pool.run(die_on_rank_1)
        except lab.DeadRankError as error:
            print("replaced" if error.recovery.replaced else "not replaced")
    """)
    assert "replaced" in out and "not" not in out
    driver, seen = kernel.pid, descendants(kernel.pid)
    kernel.manager.shutdown_kernel()  # graceful, as JupyterLab's "shut down kernel"
    took = wait_for_none(driver, seen, within_s=10)
    print(f"graceful kernel shutdown: no lab process left after {took:.1f} s")


@pytest.mark.slow  # a kernel with a 4-rank pool
def test_restarting_a_kernel_during_a_started_run_leaves_nothing(kernel):
    kernel.run("""
        import time
        exp = lab.Experiment(pool, lab.GPT(layers=2, d_model=32, heads=4, vocab=64, seq_len=16),
                             lab.Parallel(dp=4), steps=100000)
        h = exp.start()
        while not h.history:
            time.sleep(0.1)
    """)
    driver, seen = kernel.pid, descendants(kernel.pid)
    kernel.manager.restart_kernel()  # graceful shutdown, then a fresh kernel
    took = wait_for_none(driver, seen, within_s=10)
    print(f"graceful kernel shutdown: no lab process left after {took:.1f} s")
