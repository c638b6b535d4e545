"""A training held on the ranks between calls: the model, its optimizer and the data position stay alive.

``kernels.train.entry.train_rank`` builds a layout, trains and frees everything in one call.
Here the same build (``kernels.train.run_build.RankBuild``: the mesh, the parallelized model or
pipeline stages, the optimizer, the step function) is kept in a per-rank registry under
a key the driver chose, so a later call continues where the last one stopped:

- ``open_training(key, cfg)`` builds the layout ``cfg`` (a ``RunConfig`` dict) names;
- ``advance(key, steps)`` runs ``kernels.train.train_loop.train_loop`` over the next ``steps``
  global batches (batch ``s`` of the data stream is step ``s`` of the run, whoever trains
  it), so two calls of 3 steps are the same computation as one run of 6; with the run's
  ``checkpoint_dir`` it saves as ``train_rank`` does (``kernels.checkpoint.save_load``);
- ``close_training(key)`` destroys the mesh's groups and frees the objects.

A held training lives inside one world: every mesh sub-group it holds belongs to the
process group of the world it was built in. So ``kernels.engine.runtime.leave_world`` (a
failure, a world rebuild, a pool stop) closes every held training first; a later
``advance`` on its key then says the training is gone instead of using dead groups.

Run alone (4 ranks: 2 + 2 steps equal 4 steps of ``train_rank``)::

    torchrun --nproc-per-node 4 -m kernels.train.live_training
"""
from __future__ import annotations

import contextlib
import gc
from typing import Any

import torch.distributed as dist

from kernels.engine import runtime
from kernels.checkpoint.save_load import load_checkpoint, save_checkpoint
from kernels.checkpoint.files import read_meta
from kernels.parallel.mesh import dp_group
from kernels.train.run_build import RankBuild
from kernels.train.run_checkpoints import RunCheckpoints, checkpoint_meta, settle_ddp_buckets
from kernels.contract.run_config import RunConfig
from kernels.contract.strategy import resolve_strategy
from kernels.train.step_hooks import StepHooks
from kernels.train.train_loop import train_loop


class TrainingGoneError(RuntimeError):
    """The key names no training on this rank (never opened, closed, or closed with the world it lived in)."""


class LiveTraining:
    """One rank's part of a held training: its ``RankBuild`` (model, optimizer, step), the next step and the losses."""

    def __init__(self, run: RunConfig) -> None:
        self.run = run
        self.build = RankBuild(run)  # collective over every rank of the world
        self.next_step, self.losses = 0, []
        self.idle = self.build.idle  # beyond the layout's world size: holds nothing
        # The ranks of the layout, for checkpoints (None: the whole world). Collective: every rank creates it.
        size = self.build.dims.world_size
        self.group = dist.new_group(list(range(size))) if size < dist.get_world_size() else None
        # The saves advance() makes, as a one-call run makes them (with checkpoint_async, its saver's group is collective).
        self.checkpoints = RunCheckpoints(run, self.build.params_module, self.build.optimizer, self.build.strategy,
                                          ranks=list(range(size)), group=self.group)
        # The spike guard, clipping and lr schedule, held between calls (kernels.train.update_rules).
        self.update = None if self.idle else self.build.update_rules(self.checkpoints.before_update)

    def advance(self, steps: int, *, return_params: bool = False) -> dict[str, Any]:
        """Train the next ``steps`` steps; returns ``train_rank``'s records for them, plus ``first_step``.

        With the run's ``checkpoint_dir``, a checkpoint is saved after every global step that is
        a multiple of ``checkpoint_every`` and after the last step (``step_NNNNNN`` under it).
        Measuring acts on the last step, as in an Experiment's run. Watched as ``train_rank`` watches
        (``kernels.watch.rank_watch``), with steps counted from the start of training: a fault at step s
        strikes in the call that trains global step s.
        """
        first, build = self.next_step, self.build
        if self.idle:  # keeps count, so that it stands at the right step if a later layout gives it a part
            self.next_step += steps
            return {"losses": [], "grad_norms": [], "step_times": [], "params": {}, "first_step": first,
                    "layout": {"rank": dist.get_rank(), "strategy": "idle"}}
        probe, tracer = build.probes()
        self.checkpoints.segment(first, first + steps, self.losses)
        self.update.seek(first, self.losses)  # a new layout or a load: the schedule and the guard's window follow
        batches, watch = build.batches(first, steps), build.watch()
        with watch.patched() if watch is not None else contextlib.nullcontext():
            if watch is not None:  # as train_rank watches: collectives published, faults struck at global steps
                build.attach(watch)
                batches = watch.batches(batches, first)
            losses, times, norms = train_loop(build.step_fn, build.optimizer, batches,
                                              dp=build.dims.data, dp_group=dp_group(build.mesh),
                                              hooks=StepHooks(steps, probe, tracer),
                                              record_grad_norm=self.run.record_grad_norm,
                                              on_step=build.after_step(first, self.checkpoints.after_step),
                                              update=self.update)
            waits = [w.to_dict() for w in watch.finish()] if watch is not None else []
        self.next_step += steps
        self.losses += losses
        self.checkpoints.wait()  # the call returns once its checkpoints are complete, as a one-call run
        out = {"losses": losses, "grad_norms": norms, "step_times": times, "first_step": first, "waits": waits,
               **build.records(return_params), **build.routing_records(), **self.update.take()}
        if probe is not None:
            out["measure"] = build.measure_record(out["layout"], probe, losses[-1])
        if tracer is not None:
            out["trace"] = build.trace_record(tracer)
        return out

    def save(self, path: str, meta: dict[str, Any], *, passage: bool = False) -> None:
        """Write the model and optimizer to the step directory ``path`` (``kernels.checkpoint.save_load``; ``passage``:
        a relayout's), where the run stands."""
        if not self.idle:
            where = checkpoint_meta(self.run, self.build.strategy, self.next_step, self.build.dims.world_size,
                                    self.losses[-1] if self.losses else None, self.losses)
            save_checkpoint(path, self.build.params_module, self.build.optimizer, {**meta, **where},
                            process_group=self.group, passage=passage)

    def load(self, path: str, *, optimizer_settings: bool = True) -> dict[str, Any]:
        """Read the model and optimizer from ``path`` into this layout, and stand where it was saved; returns its meta."""
        if self.idle:
            meta = read_meta(path)
            self.next_step, self.losses = int(meta["step"]), list(meta.get("losses", []))
            return meta
        build = self.build
        meta = load_checkpoint(path, build.params_module, build.optimizer, process_group=self.group,
                               optimizer_settings=optimizer_settings)
        self.next_step, self.losses = int(meta["step"]), list(meta.get("losses", []))
        settle_ddp_buckets(build.step_fn, build.batches(self.next_step, 1), build.optimizer)  # DDP's rebuilt buckets, as if never stopped
        build.routing.discard()  # that forward trained no step
        return meta

    def close(self) -> None:
        """Destroy this training's groups and drop its objects (their reference cycles collected)."""
        self.checkpoints.close()  # its last save finished (and named) while the groups still exist
        self.build.close()
        if self.group is not None:
            dist.destroy_process_group(self.group)
        del self.build, self.group, self.checkpoints, self.update
        gc.collect()


_held: dict[str, LiveTraining] = {}


def open_training(key: str, cfg: dict[str, Any], *, next_step: int = 0, losses: list[float] | None = None) -> int:
    """Build the layout ``cfg`` names and hold it under ``key`` (closing any training held there); returns the rank.

    ``next_step`` and ``losses`` say where the run stands (a training rebuilt under a new layout goes on from there).
    """
    close_training(key)
    live = LiveTraining(RunConfig.from_options(cfg))
    live.next_step, live.losses = next_step, list(losses or [])
    _held[key] = live
    return dist.get_rank()


def held(key: str) -> LiveTraining:
    """The training held under ``key``; ``TrainingGoneError`` when there is none."""
    live = _held.get(key)
    if live is None:
        raise TrainingGoneError(f"no training is held under {key!r} on this rank: it was closed, or the world "
                                "it lived in was rebuilt (after a failure or a restart)")
    return live


def advance(key: str, steps: int, *, return_params: bool = False) -> dict[str, Any]:
    """Train the held training ``steps`` more steps; returns their records (``LiveTraining.advance``)."""
    return held(key).advance(steps, return_params=return_params)


def save_training(key: str, path: str, meta: dict[str, Any] | None = None) -> int:
    """Save the training held under ``key`` to the step directory ``path``; returns the step saved."""
    live = held(key)
    live.save(path, meta or {})
    return live.next_step


def load_training(key: str, cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Build the layout ``cfg`` names under ``key`` and load the checkpoint ``path`` into it; returns its meta."""
    open_training(key, cfg)
    return held(key).load(path)


def relayout_training(key: str, cfg: dict[str, Any], through: str) -> int:
    """Move the training held under ``key`` to the layout ``cfg`` names, weights and optimizer state included.

    The old layout writes its state to the step directory ``through`` with DCP (a passage:
    safetensors shards, ``save_checkpoint(passage=True)``), the new one is built and reads it
    back, each rank its own pieces (DCP plans the reads from the saved shards' offsets, so
    any layout or world size of the same model can load them).
    The old layout's groups are destroyed before the new mesh is made. Returns the step.
    """
    live = held(key)
    live.save(through, {}, passage=True)  # no optimizer settings: the same run config makes the new optimizer's
    step, losses = live.next_step, live.losses
    open_training(key, cfg, next_step=step, losses=losses)
    held(key).load(through, optimizer_settings=False)  # the same run config made both optimizers
    return step


def close_training(key: str) -> bool:
    """Close the training held under ``key``; True if there was one."""
    live = _held.pop(key, None)
    if live is None:
        return False
    live.close()
    return True


def close_all() -> int:
    """Close every held training (the world they live in is about to go); returns how many."""
    keys = list(_held)
    for key in keys:
        close_training(key)
    return len(keys)


def held_keys() -> list[str]:
    """The keys of the trainings this rank holds."""
    return sorted(_held)


runtime.on_leave_world(close_all)


def _main() -> None:
    from kernels.train.entry import train_rank
    dist.init_process_group("gloo")
    try:
        cfg = RunConfig(model={"layers": 2}, strategy=resolve_strategy(dp=2, tp=2), steps=4,
                        return_params=False).to_dict()
        open_training("demo", cfg)
        held_losses = advance("demo", 2)["losses"] + advance("demo", 2)["losses"]
        close_training("demo")
        whole = train_rank(cfg)["losses"]
        if dist.get_rank() == 0:
            print("2 + 2 held steps:", held_losses)
            print("4 steps at once: ", whole, "(equal)" if held_losses == whole else "(DIFFERENT)")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _main()
