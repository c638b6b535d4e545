"""An experiment: one model, one parallel layout, real training on the pool's ranks.

``Experiment(cluster, model, parallel, ...)`` checks every argument before anything
runs: each field's type and range (``kernels.contract.config_rules``, through the ``RunConfig``
it builds) and the layout against the model and the world (``Parallel.problems``),
raising one ``ParallelConfigError`` that names every broken rule. Then ``run()`` sends one
``kernels.contract.run_config.RunConfig`` (as a plain dict) to ``kernels.train.entry.train_rank`` on
every rank and gathers plain records. The same config trains in one process with
``reference()``, which is the ground truth.

``start()`` trains without blocking and returns a ``lab.run.run_handle.RunHandle``; ``run()``
blocks with a progress bar. Both have the ranks send one record per step
(``kernels.watch.progress``) unless ``run(progress=False)``; ``log_to`` writes them to
TensorBoard or W&B (``lab.run.run_logs``).

Options (all off by default; then the ranks install nothing and the run
costs what it did):

- ``trace=True`` (pipeline layouts, pp > 1): the last step is traced on clocks
  aligned to rank 0 (``kernels.measure.trace``): F/B/I/W per stage, p2p waits, the dp gradient
  all-reduce and the optimizer step. The driver computes the bubble
  (``lab.measure.timeline.bubble_from_records``) and the planned order to overlay. Use
  ``steps >= 2``: the first step also pays first calls (and, for a model whose stage shapes the lab does
  not know, ``kernels.parallel.stage_shapes``, torch's inference of them).
- ``synthetic_forward_s=t`` (pipelines: needs trace): every action is padded to a fixed cost (F = t,
  B = 2t per rank share, ``kernels.measure.synthetic``), so the bubble can be compared with
  theory. With real compute and more ranks than cores, the run's warnings say so.
  Without a pipeline every step's forward is padded to t and its backward to 2t
  (``kernels.watch.faults``), so a ``lab.Slow`` straggler has a known cost.
- ``compile=True``: every block runs through ``torch.compile`` on the ranks
  (``kernels.parallel.compile_blocks``); the first step pays the compilation.
- ``measure=True``: the last step is probed (``kernels.train.measured_run``): memory per category
  at rest and, without pp, between forward and backward; collectives per type. The
  driver sets each value beside its prediction (``lab.measure.memory_and_comm``).
- ``checkpoint_dir=PATH, checkpoint_every=K`` (``checkpoint_async=True`` in the background):
  save after every K steps and after the last; ``resume_from=`` a checkpoint (or a
  safetensors file) goes on from its step under this layout (``lab.run.checkpointing``).
- ``faults=[lab.Slow(2, 2.0), lab.Hang(1, at_step=2), ...]`` (``lab.run.faults``): faults on
  purpose, checked before launch and listed in ``RunResult.faults``.
- ``data=``: what to train on (``lab.run.data_sources``): the synthetic chain (None), text files
  (``lab.Text`` or paths), token ids (``lab.Tokens``) or a task with answers (``lab.ModularAddition``).
- ``hang_after=s``: once no rank makes progress for s seconds, ``run()`` raises
  ``lab.HangError`` with a ``HangReport`` (``lab.pool.hang_report``). Every run publishes
  each rank's collectives (``kernels.watch.rank_watch``), so a timeout or an interrupt carries
  the same report; ``RunResult.step_waits`` has each rank's wait and compute per step.
- ``watch=False``: the ranks publish nothing of their collectives, for the step a plain torchrun
  script takes (the watch costs a few microseconds per collective, ~3 ms a step for PP2×DP2 on
  4 CPU ranks: ``benchmarks/vs_torchrun.py``); a hang is then reported without the ranks'
  collectives, ``step_waits`` stays empty, and ``hang_after`` and ``faults`` are refused.
- ``grad_clip=``, ``lr_schedule=``, ``shuffle=``, ``spike_guard=`` (``lab.run.training_hygiene``): clipping by the
  global norm, a learning-rate schedule, the data's order epoch by epoch, and skipping a bad batch's update
  (``RunResult.spikes``; ``lab.PoisonBatch`` in ``faults`` makes one), all applied alike in ``reference()``.
- ``on_event=``: a callable or an http(s) webhook URL that hears of a hang, a death, a rank's error,
  each loss spike and the finish, with the rank and the step (``lab.run.events``).
"""
from __future__ import annotations

import os
import time
import warnings
from collections.abc import Sequence
from typing import Any

from kernels.contract.config_rules import ConfigError, Problem, optimizer_problems
from kernels.model.family import ModelConfig, OwnConfig, model_fields
from kernels.model.gpt import GPTConfig
from kernels.model.llama import LlamaConfig
from kernels.train.reference import train_reference
from kernels.contract.run_config import RunConfig
from kernels.contract.data_spec import DataSpec
from kernels.train.entry import train_rank
from lab.errors import RankError
from lab.run.checkpointing import check_resume, directory_problems, resume_path
from lab.run import run_logs, run_views
from lab.pool.cluster import Cluster
from lab.run.data_sources import data_problems, data_spec
from lab.run.own_models import own_config
from lab.run.events import EventSink, on_event_problems
from lab.run.faults import fault_problems, fault_records, hang_after_problems, poison_records, unwatched_problems
from lab.run.training_hygiene import schedule_record
from lab.pool.hang_report import HangWatch
from lab.run.parallel import Parallel, ParallelConfigError
from lab.run.run_handle import RunHandle
from lab.run.run_result import RunResult


class LayoutWarning(UserWarning):
    """The layout runs, but is known to be wasteful."""


class Experiment:
    """Train ``model`` under ``parallel`` on ``cluster``; see ``run()`` and ``reference()``.

    ``trace``, ``synthetic_forward_s`` and ``measure`` record what the run did (module docstring).
    """

    def __init__(self, cluster: Cluster, model: ModelConfig, parallel: Parallel, *, global_batch: int = 8,
                 steps: int = 3, lr: float = 1e-2, optimizer: str = "adamw", seed: int = 0, trace: bool = False,
                 synthetic_forward_s: float | None = None, measure: bool = False, compile: bool = False,
                 checkpoint_dir: str | None = None, checkpoint_every: int | None = None, resume_from: Any = None,
                 checkpoint_async: bool = False, faults: Sequence[Any] = (), hang_after: float | None = None,
                 data: Any = None, on_event: Any = None, grad_clip: float | None = None, lr_schedule: Any = None,
                 shuffle: bool | None = None, spike_guard: Any = None, watch: bool = True) -> None:
        self.cluster, self.parallel = cluster, parallel
        self.model, model_problems = run_model(model)
        problems = list(model_problems)
        self.global_batch, self.steps, self.lr, self.seed = global_batch, steps, lr, seed
        self.trace, self.synthetic_forward_s, self.measure = trace, synthetic_forward_s, measure
        self.compile, self.optimizer = compile, optimizer
        # checkpoints (lab.run.checkpointing): paths made absolute, as the ranks' working directory may differ
        self.checkpoint_dir = os.path.abspath(checkpoint_dir) if isinstance(checkpoint_dir, str) else checkpoint_dir
        self.checkpoint_every, self.resume_from, self.checkpoint_async = checkpoint_every, resume_from, checkpoint_async
        self.faults, self.hang_after, self.on_event, self.watch = faults, hang_after, on_event, watch
        problems += unwatched_problems(watch, hang_after, faults)
        try:  # what data= names, as the ranks will receive it (lab.run.data_sources)
            self.data_spec = data_spec(data)
        except ConfigError as error:
            self.data_spec, problems = DataSpec(), problems + error.problems
        # training hygiene (lab.run.training_hygiene): the rules of RunConfig check them
        self.grad_clip, self.shuffle, self.spike_guard = grad_clip, shuffle, spike_guard
        try:
            self.lr_schedule = schedule_record(lr_schedule, steps)
        except ConfigError as error:
            self.lr_schedule, problems = None, problems + error.problems
        problems += [] if model_problems else self._problems(optimizer)
        if problems:  # raised here, before anything reaches the ranks
            raise ParallelConfigError(problems)
        self.events = EventSink(on_event, parallel.describe().split(" (")[0])  # lab.run.events, e.g. "DP4, ZeRO-0"
        self.warnings = parallel.layout_warnings()
        for message in self.warnings:
            warnings.warn(message, LayoutWarning, stacklevel=2)

    def _problems(self, optimizer: Any) -> list[Problem]:
        """Every rule the experiment breaks: its arguments, the rank config they make, the layout against the model."""
        out = optimizer_problems(optimizer)
        if not (isinstance(self.model, (GPTConfig, LlamaConfig, OwnConfig)) and isinstance(self.parallel, Parallel)):
            return out + [("argument-types", f"model must be a lab.GPT, a lab.Llama, a Hugging Face config or a "
                           f"lab.Model, and parallel a lab.Parallel, got {type(self.model).__name__} and "
                           f"{type(self.parallel).__name__}")]
        if self.model.seed not in (0, self.seed):  # the model's seed would be silently replaced
            out.append(("model-seed", f"the model's seed={self.model.seed} is not used: the Experiment's seed="
                        f"{self.seed!r} fixes the weights and the data; pass seed={self.model.seed} to the Experiment"))
        out += _llama_problems(self.model)
        try:  # the rank config's own rules (kernels.contract.config_rules), exactly as the ranks would apply them
            self.run_config()
        except ConfigError as error:
            out += error.problems
        out += directory_problems(self.checkpoint_dir) if self.checkpoint_dir is not None else []
        out += fault_problems(self.faults, self.cluster.world_size, self.steps)
        out += hang_after_problems(self.hang_after)
        out += on_event_problems(self.on_event)
        out += data_problems(self.data_spec, self.model, steps=self.steps, global_batch=self.global_batch) \
            if not out else []  # its checks build the run config
        return out + self.parallel.problems(self.model, self.cluster.world_size, self.global_batch)

    def run_config(self, *, return_params: bool = False) -> RunConfig:
        """The one typed config every rank (and the reference) trains under."""
        model = model_fields(self.model)
        ranks_per_host = _ranks_per_host(self.cluster) if self.trace else None  # ranks cannot see their host
        return RunConfig(
            model=model, seed=self.seed, global_batch=self.global_batch, steps=self.steps, lr=self.lr,
            optimizer=self.optimizer, strategy=self.parallel.strategy(compile=self.compile), data=self.data_spec,
            return_params=return_params, trace=self.trace,
            synthetic_forward_s=self.synthetic_forward_s, ranks_per_host=ranks_per_host, measure=self.measure,
            checkpoint_dir=self.checkpoint_dir, checkpoint_every=self.checkpoint_every,
            checkpoint_async=self.checkpoint_async,
            resume_from=None if self.resume_from is None else os.fspath(self.resume_from),
            watch_collectives=self.watch, faults=fault_records(self.faults), poison=poison_records(self.faults),
            grad_clip=self.grad_clip, lr_schedule=self.lr_schedule, shuffle=self.shuffle, spike_guard=self.spike_guard)

    def config(self, *, return_params: bool = False) -> dict[str, Any]:
        """The plain config dict every rank receives: ``run_config().to_dict()``."""
        return self.run_config(return_params=return_params).to_dict()

    def run(self, *, timeout: float | None = None, return_params: bool = False, progress: bool = True,
            log_to: str | None = None, wait: bool = True) -> RunResult:
        """Train on every rank; raises ``lab.RankError`` (with the rank's traceback) on failure.

        Blocks until the end with a progress bar (tqdm) unless ``progress=False``, which also sends
        no per-step records. ``log_to`` ("tensorboard:DIR" or "wandb") logs every step (``lab.run.run_logs``).
        With ``resume_from``, the checkpoint is checked here (complete, the model's shapes,
        steps left to run) and training goes on from its step up to ``steps`` in total.
        While a run started with ``start()`` trains, this waits for it, saying so; with
        ``wait=False`` it raises ``lab.PoolBusyError`` instead (``lab.pool.busy``).
        """
        if not progress and log_to is None:
            cfg = self._resumed(self.config(return_params=return_params))
            try:
                per_rank = self.cluster.run(train_rank, cfg, timeout=timeout, wait=wait,
                                            hang_watch=HangWatch(self.cluster, self.hang_after))
            except RankError as error:
                self.events.failure(error)
                raise
            result = self.result_from_ranks(per_rank, cfg, return_params)
            self.events.finished(result)
            return result
        handle = self._handle(timeout, return_params, log_to)
        self._claim(handle, wait)
        with run_views.progress_bar(handle, show=progress):
            handle._begin(background=False)  # the call runs here, so an interrupt reaches the pool as always
        return handle.wait()

    def start(self, *, timeout: float | None = None, return_params: bool = False,
              log_to: str | None = None, wait: bool = True) -> RunHandle:
        """Start training and return at once: a ``RunHandle`` with ``wait()``, ``done``, ``stop()`` and ``progress``.

        Until it ends, the pool is busy: other calls wait for it (``cluster.busy`` says what runs). A run
        started while another trains waits for that one first, or with ``wait=False`` raises ``lab.PoolBusyError``.
        """
        handle = self._handle(timeout, return_params, log_to)  # a bad log_to is refused here, before any wait
        self._claim(handle, wait)
        return handle._begin(background=True)

    def _claim(self, handle: RunHandle, wait: bool) -> None:
        """Wait until no started run holds the pool (``lab.pool.busy``); a refused or interrupted wait closes ``handle``."""
        try:
            self.cluster.wait_until_free(wait)
        except BaseException:
            handle._abandon()
            raise

    def _handle(self, timeout: float | None, return_params: bool, log_to: str | None) -> RunHandle:
        loggers = run_logs.open_loggers(log_to, self.config(), self.cluster.world_size)  # bad log_to: before launch
        cfg = self._resumed({**self.config(return_params=return_params), "progress": True})
        handle = RunHandle(self, cfg, timeout=timeout, return_params=return_params)
        handle.on_finish(lambda: self._tell_outcome(handle))
        for logger in loggers:
            handle.follow(logger.write)
            handle.on_finish(logger.close)
        return handle

    def _tell_outcome(self, handle: RunHandle) -> None:
        """``on_event`` hears how a run through a handle ended (it never raises: ``lab.run.events``)."""
        if handle._error is not None:
            self.events.failure(handle._error)
        elif handle._result is not None:
            self.events.finished(handle._result)

    def result_from_ranks(self, per_rank: list[dict[str, Any]], cfg: dict[str, Any],
                          return_params: bool = False) -> RunResult:
        """The RunResult of this experiment's ranks' records: its warnings first, the pool's hosts named."""
        return RunResult.from_ranks(per_rank, cfg, hosts=[r.host for r in self.cluster.rank_map.ranks],
                                    warnings=self.warnings, return_params=return_params)

    def reference(self, *, return_params: bool = False) -> RunResult:
        """The same training in this process: same init, same global batch per step, same AdamW."""
        cfg = self._resumed(self.config(return_params=return_params))
        began = time.perf_counter()
        out = train_reference(RunConfig.from_dict(cfg))
        per_step = (time.perf_counter() - began) / max(1, len(out["losses"]))
        params = {0: {k: v.tolist() for k, v in out["params"].items()}} if return_params else {}
        return RunResult(config=cfg, losses=list(out["losses"]), grad_norms=list(out["grad_norms"]),
                         step_times=[[per_step] * len(out["losses"])], layout=[{"rank": 0, "strategy": "reference"}],
                         params=params, first_step=out["first_step"], routing_records=out["routing"],
                         lrs=out["lrs"], spikes=out["spikes"])

    def _resumed(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """``cfg`` with ``resume_from`` resolved to the path the ranks load, checked before anything launches."""
        if self.resume_from is None:
            return cfg
        path = resume_path(self.resume_from)
        check_resume(path, self.model, self.steps, self.optimizer)
        return {**cfg, "resume_from": path}


def run_model(model: Any) -> tuple[Any, list[Problem]]:
    """The model as a run names it: a lab.GPT or lab.Llama as given, a Hugging Face config or a
    ``lab.Model`` read once on the meta device (``lab.run.own_models``), with what stops that."""
    if isinstance(model, (GPTConfig, LlamaConfig, OwnConfig)):  # OwnConfig: read already (lab.Training reloading)
        return model, []
    try:
        return own_config(model), []
    except ConfigError as error:
        return model, error.problems


def _llama_problems(model: Any) -> list[Problem]:
    """A lab.Llama trains as Llama 3 (SwiGLU, untied head, RoPE, no biases): the GPT-style switches of
    ``kernels.model.llama.LlamaConfig`` size the planner's presets only."""
    if not isinstance(model, LlamaConfig):
        return []
    if (model.gated_mlp, model.tied_embeddings, model.learned_pos, model.bias) != (True, False, False, False):
        return [("model-keys", "lab.Llama trains as Llama 3: gated_mlp=True, tied_embeddings=False, "
                 "learned_pos=False, bias=False (the other switches size the planner's GPT-style presets)")]
    return []


def _ranks_per_host(cluster: Any) -> list[int] | None:
    """For each rank, how many ranks share its host (None when the pool has no rank map)."""
    rank_map = getattr(cluster, "rank_map", None)
    if rank_map is None:
        return None
    hosts = rank_map.hosts()
    return [len(hosts[r.host]) for r in rank_map.ranks]
