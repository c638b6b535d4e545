"""The named rules a config's own fields must meet: real types, sane ranges, and what the data needs.

Algorithm: none; these are the checks that run before any rank does. Each returns
``(rule name, message)`` pairs, empty when the fields are valid, and the rule names are
the keys of ``lab.run.parallel.RULES`` (which documents them beside the layout rules of
``kernels.contract.layout_rules``). ``lab.Parallel``, ``lab.Experiment``, ``RunConfig`` and
``GPTConfig`` all call these same functions, so a rule lives in one place.

Types are taken strictly: a count is a Python ``int`` (not ``True``, not ``2.0``, not
``"2"``), a switch is ``True`` or ``False`` (not ``1`` or ``"yes"``). Nothing is coerced,
because a coercion on the driver would be one more place where the ranks could disagree
with what the user wrote. Standard library only: the driver, the ranks and the views may
import it.

Try it alone (prints the problems of a few odd values)::

    python -m kernels.contract.config_rules
"""
from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from typing import Any

from kernels.contract.layout_rules import FSDP_STRATEGIES

Problem = tuple[str, str]  # (rule name, message in words)

MIXED_PRECISION = (None, "bf16")
# activation_checkpointing: off, every block recomputed (True), or only what is cheap to recompute ("selective":
# kernels.parallel.activation_checkpoint keeps the matmul outputs).
CHECKPOINTING = (False, True, "selective")
MODEL_SIZES = ("layers", "d_model", "heads", "vocab", "seq_len", "d_ff")
# A routed mixture of experts in place of each block's MLP (kernels.model.moe), in both models; experts=0 is
# the dense MLP, and a dense model's dict leaves these out (kernels.model.family.model_fields).
MOE_KEYS = ("experts", "top_k", "capacity_factor", "aux_loss_coef")
MODEL_KEYS = (*MODEL_SIZES, "bias", *MOE_KEYS)
# A Llama 3 (kernels.model.llama) names its family; kv_heads may be None (= heads).
LLAMA_SIZES = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len")
LLAMA_KEYS = ("family", *LLAMA_SIZES, "rope_theta", "norm_eps", *MOE_KEYS)
# kernels.train.data's Markov chain gives every token 4 distinct successors (its _BRANCH_WEIGHTS),
# drawn from the vocabulary, so a smaller vocabulary cannot hold the chain.
DATA_MIN_VOCAB = 4
SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes seeds below 2**64 (it wraps negatives round; we refuse them)


class ConfigError(ValueError):
    """A config breaks one or more named rules; ``rules`` names them, ``problems`` pairs them with messages.

    IPython and Jupyter show it as its message alone (``_render_traceback_``): the frames
    inside the code that found the problem add nothing to the rules it names.
    """

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = [(str(rule), str(message)) for rule, message in problems]
        self.rules = tuple(rule for rule, _ in self.problems)
        super().__init__("invalid config:\n  " + "\n  ".join(f"[{r}] {m}" for r, m in self.problems))

    def __reduce__(self) -> tuple[type, tuple[list[Problem]]]:
        return type(self), (self.problems,)  # pickles by its problems, not by the joined message

    def _render_traceback_(self) -> list[str]:
        """The lines IPython shows instead of a traceback: the class name, then one line per rule."""
        return f"{type(self).__name__}: {self}".splitlines()


def is_int(value: Any) -> bool:
    """A Python int that is not a bool (``True`` is an int to Python, never a size to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def size_problems(sizes: Mapping[str, Any], optional: Mapping[str, Any] | None = None) -> list[Problem]:
    """[positive-sizes]: every count is an int >= 1; ``optional`` ones may also be None."""
    given = {**sizes, **{k: v for k, v in (optional or {}).items() if v is not None}}
    bad = [f"{name}={value!r}" for name, value in given.items() if not (is_int(value) and value >= 1)]
    return [("positive-sizes", f"sizes must be positive ints: {', '.join(bad)}")] if bad else []


def flag_problems(flags: Mapping[str, Any]) -> list[Problem]:
    """[bool-flags]: every switch is True or False; 1, "yes" or None are refused, not read as truthy."""
    bad = [f"{name}={value!r}" for name, value in flags.items() if not isinstance(value, bool)]
    return [("bool-flags", f"switches must be True or False: {', '.join(bad)}")] if bad else []


def checkpointing_problems(value: Any) -> list[Problem]:
    """[activation-checkpointing]: False, True (full) or "selective"; 1, "full" or None are refused, not guessed."""
    if isinstance(value, bool) or (isinstance(value, str) and value in CHECKPOINTING):
        return []
    return [("activation-checkpointing", "activation_checkpointing must be False, True (recompute each block) or "
             f"'selective' (recompute all but the matmuls), got {value!r}")]


def sharding_problems(zero: Any, fsdp_strategy: Any, mixed_precision: Any) -> list[Problem]:
    """[zero-stage], [fsdp-strategy], [mixed-precision]: each field alone is one of its allowed values."""
    out = []
    if not (is_int(zero) and zero in (0, 1, 2, 3)):
        out.append(("zero-stage", f"zero must be 0, 1, 2 or 3 (an int), got {zero!r}"))
    if fsdp_strategy is not None and not (isinstance(fsdp_strategy, str) and fsdp_strategy in FSDP_STRATEGIES):
        out.append(("fsdp-strategy", f"unknown fsdp_strategy {fsdp_strategy!r}; "
                    f"allowed: None, {', '.join(FSDP_STRATEGIES)}"))
    if not (mixed_precision is None or (isinstance(mixed_precision, str) and mixed_precision in MIXED_PRECISION)):
        out.append(("mixed-precision", f"mixed_precision must be None or 'bf16', got {mixed_precision!r}"))
    return out


def model_problems(model: Any) -> list[Problem]:
    """The model's fields, those present (d_ff may be None): known keys, positive sizes, heads dividing
    d_model, bias a bool, the experts' fields (``moe_problems``); a Llama's (``"family": "llama"``) by
    ``llama_problems``."""
    if not isinstance(model, Mapping):
        return [("model-keys", f"the model must be a dict of {list(MODEL_KEYS)}, got {model!r:.80}")]
    if model.get("family") == "llama":
        return llama_problems(model)
    bad = sorted(set(model) - set(MODEL_KEYS), key=str)
    if bad:
        return [("model-keys", f"unknown model keys {bad}; known: {list(MODEL_KEYS)}")]
    out = size_problems({k: model[k] for k in MODEL_SIZES if k in model and k != "d_ff"},
                        {"d_ff": model.get("d_ff")})
    out += flag_problems({"bias": model["bias"]} if "bias" in model else {})
    d_model, heads = model.get("d_model"), model.get("heads")
    if not out and is_int(d_model) and is_int(heads) and d_model % heads:
        out.append(("heads-d-model", f"d_model={d_model} must be divisible by heads={heads}"))
    return out + moe_problems(model)


def llama_problems(model: Mapping[str, Any]) -> list[Problem]:
    """A Llama's fields: known keys, positive sizes, hidden divided by heads and heads by kv_heads, a
    finite RoPE base and norm epsilon > 0, and the experts' fields (``moe_problems``)."""
    bad = sorted(set(model) - set(LLAMA_KEYS), key=str)
    if bad:
        return [("model-keys", f"unknown Llama keys {bad}; known: {list(LLAMA_KEYS)}")]
    out = size_problems({k: model[k] for k in LLAMA_SIZES if k in model and k != "kv_heads"},
                        {"kv_heads": model.get("kv_heads")})
    reals = {k: model[k] for k in ("rope_theta", "norm_eps") if k in model}
    out += [("model-keys", f"{k}={v!r} must be a finite number > 0") for k, v in reals.items()
            if not (is_real(v) and v > 0)]
    hidden, heads, kv = model.get("hidden"), model.get("heads"), model.get("kv_heads")
    if not out and is_int(hidden) and is_int(heads) and (hidden % heads or (is_int(kv) and heads % kv)):
        out.append(("heads-d-model", f"hidden={hidden} must be divisible by heads={heads}, and heads by "
                    f"kv_heads={kv}"))
    return out + moe_problems(model)


def moe_problems(model: Mapping[str, Any]) -> list[Problem]:
    """[moe-experts], [moe-top-k], [moe-capacity], [moe-aux-loss]: the mixture-of-experts fields, those present.

    experts is an int >= 0 (0: the dense MLP); top_k an int >= 1, at most experts when there are experts;
    capacity_factor None (dropless) or a finite number > 0; aux_loss_coef a finite number >= 0.
    """
    out = []
    experts, top_k = model.get("experts", 0), model.get("top_k", 1)
    if not (is_int(experts) and experts >= 0):
        out.append(("moe-experts", f"experts must be an int >= 0 (0: the dense MLP), got {experts!r}"))
    if not (is_int(top_k) and top_k >= 1):
        out.append(("moe-top-k", f"top_k must be an int >= 1, got {top_k!r}"))
    elif is_int(experts) and experts > 0 and top_k > experts:
        out.append(("moe-top-k", f"top_k={top_k} must be at most experts={experts}: each token picks top_k "
                    "different experts"))
    capacity = model.get("capacity_factor")
    if capacity is not None and not (is_real(capacity) and capacity > 0):
        out.append(("moe-capacity", f"capacity_factor must be None (dropless) or a finite number > 0, "
                    f"got {capacity!r}"))
    coef = model.get("aux_loss_coef", 0.0)
    if not (is_real(coef) and coef >= 0):
        out.append(("moe-aux-loss", f"aux_loss_coef must be a finite number >= 0, got {coef!r}"))
    return out


def moe_layout_problems(experts: Any, sequence_parallel: Any) -> list[Problem]:
    """[moe-sp]: sequence parallel with experts is not built (the MoE would need its input gathered over
    the sequence and its output scattered back, as the attention has; tp alone leaves it replicated)."""
    if sequence_parallel is True and is_int(experts) and experts > 0:
        return [("moe-sp", f"sequence_parallel with experts={experts} is not built: the mixture of experts would "
                 "need its input gathered over the sequence and its output scattered back; use "
                 "sequence_parallel=False (tp then splits the attention and keeps the experts whole on each rank)")]
    return []


def data_problems(vocab: Any) -> list[Problem]:
    """[data-vocab]: the synthetic data's chain fits in the vocabulary."""
    if is_int(vocab) and vocab < DATA_MIN_VOCAB:
        return [("data-vocab", f"vocab={vocab} is too small for the synthetic data: every token has "
                 f"{DATA_MIN_VOCAB} distinct successors, so vocab must be at least {DATA_MIN_VOCAB}")]
    return []


def seed_problems(seeds: Mapping[str, Any], optional: Mapping[str, Any] | None = None) -> list[Problem]:
    """[seed]: every seed is an int in [0, 2**64); ``optional`` ones may also be None."""
    given = {**seeds, **{k: v for k, v in (optional or {}).items() if v is not None}}
    bad = [f"{name}={value!r}" for name, value in given.items() if not (is_int(value) and 0 <= value < SEED_LIMIT)]
    return [("seed", f"seeds must be ints in [0, 2**64): {', '.join(bad)}")] if bad else []


def adamw_problems(lr: Any, betas: Any = (0.9, 0.95), eps: Any = 1e-8, weight_decay: Any = 0.0) -> list[Problem]:
    """[adamw]: lr and eps finite and > 0, weight_decay finite and >= 0, betas two numbers in [0, 1)."""
    bad = [f"{name}={value!r}" for name, value in (("lr", lr), ("eps", eps)) if not (is_real(value) and value > 0)]
    if not (is_real(weight_decay) and weight_decay >= 0):
        bad.append(f"weight_decay={weight_decay!r}")
    pair = isinstance(betas, (tuple, list)) and len(betas) == 2
    if not (pair and all(is_real(b) and 0 <= b < 1 for b in betas)):
        bad.append(f"betas={betas!r}")
    return [("adamw", f"AdamW got {', '.join(bad)}; it needs a finite lr > 0, eps > 0, weight_decay >= 0 "
             "and betas two numbers in [0, 1)")] if bad else []


class Optimizer(enum.StrEnum):
    """The optimizers a run trains with (``kernels.train.optimizer`` maps each to torch's class)."""

    ADAMW = "adamw"  # torch.optim.AdamW with the lab's settings
    SGD = "sgd"  # plain SGD at the same lr


OPTIMIZERS = tuple(Optimizer)


def optimizer_problems(optimizer: Any) -> list[Problem]:
    """[optimizer]: one of OPTIMIZERS."""
    if isinstance(optimizer, str) and optimizer in OPTIMIZERS:
        return []
    return [("optimizer", f"optimizer {optimizer!r} is not supported; choose one of {', '.join(OPTIMIZERS)}")]


def measuring_problems(pp: Any, trace: Any, synthetic_forward_s: Any) -> list[Problem]:
    """[trace-pipeline], [synthetic-cost]: a probe that would record nothing is refused."""
    out = []
    if trace is True and is_int(pp) and pp < 2:
        out.append(("trace-pipeline", "trace=True times pipeline actions: it needs a pipeline layout (pp > 1)"))
    if synthetic_forward_s is not None:
        if not (is_real(synthetic_forward_s) and synthetic_forward_s > 0):
            out.append(("synthetic-cost", f"synthetic_forward_s must be a finite number of seconds > 0, "
                        f"got {synthetic_forward_s!r}"))
        elif trace is not True and not (is_int(pp) and pp < 2):  # without pp, kernels.watch.faults paces every step
            out.append(("synthetic-cost", "synthetic_forward_s pads traced pipeline actions: pass trace=True too"))
    return out


def checkpoint_problems(checkpoint_dir: Any, every: Any, resume_from: Any, checkpoint_async: Any) -> list[Problem]:
    """[checkpoint]: paths are non-empty strings; checkpoint_every is a positive int, and it and async need a directory."""
    out = [("checkpoint", f"{name} must be None or a non-empty path string, got {value!r}")
           for name, value in (("checkpoint_dir", checkpoint_dir), ("resume_from", resume_from))
           if value is not None and not (isinstance(value, str) and value)]
    if every is not None and not (is_int(every) and every >= 1):
        out.append(("checkpoint", f"checkpoint_every must be None or an int >= 1, got {every!r}"))
    for name, value in (("checkpoint_every", every), ("checkpoint_async", checkpoint_async)):
        if value not in (None, False) and checkpoint_dir is None:
            out.append(("checkpoint", f"{name}={value!r} needs checkpoint_dir: the directory to save into"))
    return out


if __name__ == "__main__":
    for problems in (size_problems({"dp": 2.0, "tp": True, "pp": None}), flag_problems({"sequence_parallel": "yes"}),
                     adamw_problems(float("nan")), seed_problems({"seed": 1.5}), data_problems(2)):
        print(problems)
