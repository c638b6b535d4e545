"""Going on after a rank dies or hangs: ``lab.Training(..., auto_resume=True)``.

Without it a failure in ``step(n)`` ends in an error. The pool has already put a warmed spare
engine in place of a lost rank and rebuilt the world (``lab.pool.cluster_world``, ``lab.pool.standby``),
but the training held on the ranks went with the old world, and the user reloads the last
checkpoint by hand (``lab.Training.load``). With ``auto_resume=True``, ``step(n)`` does it itself:

1. the call fails with ``lab.DeadRankError`` (an engine died) or ``lab.RankTimeoutError`` /
   ``lab.HangError`` (a rank hung: ``hang_after=`` or ``step(timeout=)`` noticed it, and recovery
   interrupted it, or killed and replaced it); ``on_event`` hears "death" or "hang" (``lab.run.events``);
2. the training is built again on the ranks, under the same layout, from its last complete
   checkpoint (``kernels.checkpoint.files``: a save the failure cut short is a ``.partial`` directory
   nothing loads); ``on_event`` hears "resume";
3. it trains on to the step ``step(n)`` was asked to reach.

Batches are a pure function of (seed, step), and a checkpoint holds the model, the optimizer
state and each rank's RNG state (``kernels.train.run_checkpoints``), so every step after the resume
point is the uninterrupted run's, bit for bit under the same layout. ``step(n)`` returns the
RunResult of the steps trained after the last resume (``first_step`` says where they began);
``Training.losses`` has every step's loss.

So that there is always a state to go back to, ``step()`` first saves where the training
stands unless a checkpoint is known to hold that state (the last call's last save, or the
checkpoint the training was loaded from) or it is a new training at step 0, which is built
again from its seed. Only the checkpoints this training wrote are candidates: a
``checkpoint_dir`` that also holds an older run's saves is safe.

A fault injected on purpose (``faults=[lab.Kill(1, at_step=3)]``) strikes once: the fault that
caused the failure is spent, so the resumed run does not meet it again.

What it does not resume from:

- a rank that raised (any other ``lab.RankError``, ``lab.Crash`` among them): the same step would
  raise again, so the error is raised as without ``auto_resume``;
- a call that fails again after ``MAX_TRIES`` resumes from the same checkpoint: ``AutoResumeError``;
- a lost rank the pool cannot replace. A pool the lab started always can (a ready spare in
  about a second; without one, the resume waits for a fresh engine, 3-4 s). A pool attached
  with ``lab.connect`` cannot: the lab never kills or replaces engines it did not start. Then
  ``AutoResumeError`` says there is no spare, and nothing is lost: the checkpoints stay, the
  error names the last complete one, and the Training keeps its losses and ``steps_done`` of its
  last completed call.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernels.checkpoint.files import complete_checkpoints, is_complete, read_meta, step_dir
from kernels.contract.config_rules import Problem
from lab.errors import DeadRankError, LabError, RankTimeoutError
from lab.run.events import blamed_rank
from lab.run.faults import Hang, Kill, fault_problems

if TYPE_CHECKING:
    from lab.run.run_result import RunResult
    from lab.run.training import Training

MAX_TRIES = 3  # resumes from one checkpoint in one step() call before a failure there is taken as not passing
OPTIONS = ("auto_resume", "faults")  # a Training's own options, beside those its Experiment checks


class AutoResumeError(LabError):
    """``auto_resume`` could not go on; the message says why and where the training can be loaded from."""


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the options an Experiment takes, the Training's own: ``auto_resume`` and ``faults``)."""
    own = {k: options[k] for k in OPTIONS if k in options}
    return {k: v for k, v in options.items() if k not in own}, own


def resume_problems(own: dict[str, Any], options: dict[str, Any], world_size: int | None) -> list[Problem]:
    """[auto-resume]: a bool, and True needs checkpoints to go back to; [faults] at any global step of the training.

    ``own`` and ``options`` are ``split_options``'s; ``world_size`` is the layout's (None: not a lab.Parallel,
    which the Experiment's own checks refuse).
    """
    auto_resume, faults = own.get("auto_resume", False), own.get("faults", ())
    out = fault_problems(faults, world_size, None) if world_size is not None else []
    if not isinstance(auto_resume, bool):
        out.append(("auto-resume", f"auto_resume must be True or False, got {auto_resume!r}"))
    elif auto_resume and (options.get("checkpoint_dir") is None or options.get("checkpoint_every") is None):
        out.append(("auto-resume", "auto_resume=True goes back to the last complete checkpoint: it needs "
                    "checkpoint_dir and checkpoint_every"))
    return out


class AutoResume:
    """One Training's recovery: whether it resumes, its faults not yet spent, the checkpoint known to hold its state."""

    def __init__(self, auto_resume: bool = False, faults: Sequence[Any] = ()) -> None:
        self.enabled, self.faults = auto_resume, list(faults)
        # (step, the complete checkpoint holding the training's state at that step; None: a fresh build at step 0)
        self.point: tuple[int, Path | None] | None = None

    def step(self, training: "Training", n: int, **call: Any) -> "RunResult":
        """Train ``n`` steps, resuming from the last complete checkpoint after each death or hang (module doc)."""
        first, began = training.steps_done, time.time()
        target, root = first + n, Path(training.experiment.checkpoint_dir)
        self._start_point(training, root)
        tries: dict[Path | None, int] = {}
        while True:
            try:
                result = training._advance(target - training.steps_done, **call)
                break
            except (DeadRankError, RankTimeoutError) as error:
                path = self._resume_point(training, error, root, began, target)
                tries[path] = tries.get(path, 0) + 1
                if tries[path] > MAX_TRIES:
                    raise AutoResumeError(f"auto_resume gave up after {MAX_TRIES} resumes from {_named(path)}: "
                                          f"the call failed again: {_first_line(error)}") from error
                self._spend_fault(error, training.steps_done, target)
                self._reload(training, path, error, target)
        self.point = (training.steps_done, step_dir(root, training.steps_done))  # the call's last save
        return result

    def _start_point(self, training: "Training", root: Path) -> None:
        """Make sure the state the call starts from can be had again: known, saved now, or (at step 0) built afresh.

        A new training at step 0 is not saved: its seed builds the same state again, with no write.
        """
        first = training.steps_done
        if self.point is not None and self.point[0] == first and (self.point[1] is None or is_complete(self.point[1])):
            return
        self.point = (first, None if first == 0 and self.point is None else training.save(root))

    def _resume_point(self, training: "Training", error: DeadRankError | RankTimeoutError, root: Path,
                      began: float, target: int) -> Path | None:
        """The latest complete checkpoint this training wrote (since ``began``, or its start point); refuses a
        pool that cannot replace the lost ranks."""
        assert self.point is not None  # step() made one before training
        saved = [p for p in complete_checkpoints(root)
                 if self.point[0] < _step(p) <= target and read_meta(p).get("saved_at", 0.0) >= began]
        path = saved[-1] if saved else self.point[1]
        recovery = error.recovery
        if not recovery.rebuilt and not recovery.waiting_for_engines:
            raise AutoResumeError(
                f"auto_resume cannot go on: {_first_line(error)}. There is no spare engine to put in place of rank "
                f"{blamed_rank(error)}: {recovery.why_not}\nNothing is lost: the last complete checkpoint is "
                f"{_named(path)}, and this Training still stands at step {training.steps_done} with its losses. Once "
                f"the pool has its ranks again, go on with lab.Training.load(cluster, {str(root)!r}).") from error
        return path

    def _spend_fault(self, error: DeadRankError | RankTimeoutError, low: int, high: int) -> None:
        """Drop the injected fault that caused ``error``: the earliest of its kind on the blamed rank in the call."""
        kind, rank = Kill if isinstance(error, DeadRankError) else Hang, blamed_rank(error)
        due = [f for f in self.faults if type(f) is kind and f.rank == rank and low <= f.at_step < high]
        if due:
            self.faults.remove(min(due, key=lambda f: f.at_step))

    def _reload(self, training: "Training", path: Path | None, error: DeadRankError | RankTimeoutError,
                target: int) -> None:
        try:
            training._reload(path)
        except LabError as failed:  # e.g. no engine came up for the lost rank within the pool's timeout
            raise AutoResumeError(f"auto_resume could not go back to {_named(path)} after {_first_line(error)}: "
                                  f"{_first_line(failed)}. Nothing is lost: the checkpoints stay where they "
                                  "are, for lab.Training.load.") from failed
        self.point = (training.steps_done, path)
        recovery, ranks = error.recovery, training.cluster.rank_map.ranks
        lost = {*recovery.replaced, *recovery.waiting_for_engines, *recovery.killed}  # engines replaced, by now
        moves = "; ".join(f"rank {r} now runs in pid {ranks[r].pid}" for r in sorted(lost))
        training.experiment.events.emit(
            "resume", f"went back to {_named(path)} under the same layout after "
            f"{'the death' if isinstance(error, DeadRankError) else 'a hang'} of rank {blamed_rank(error)}"
            f"{'; ' + moves if moves else ''}; training on to step {target}", step=training.steps_done)


def _named(path: Path | None) -> str:
    return "the start (step 0, built afresh from the seed)" if path is None else f"{path} (step {_step(path)})"


def _step(path: Path) -> int:
    return int(path.name.split("_")[1])


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__
