"""DTensor's output shapes worked out on meta tensors: a new mesh's first step, sooner.

The first time DTensor meets an op signature (the op, its input specs, on one mesh) it
propagates the sharding, and with it the output's global shape, stride and dtype. torch
derives those by running the op on fake tensors (``ShardingPropagator.
_propagate_tensor_meta_non_cached``, private) under a FakeTensorMode it builds for each
call. On this machine that is 1-3 ms a signature, and a TP step meets 60 of them under a
mesh it never ran: most of what a new layout's first step pays beyond a warm one
(``kernels.parallel.warm_meshes`` keeps the answers for meshes run before).

Meta tensors answer the same question from the same meta kernels without FakeTensor's
Python dispatch. ``install()`` puts a propagator in front of torch's that runs the op on
meta tensors shaped as the input specs say, and hands torch's own anything meta does not
answer alike or at all:

- while tracing (torch.compile, symbolic shapes), where torch uses the tracer's fake mode;
- ops given a device, or given no tensor input (a factory op would allocate for real);
- ops that raise on meta (data-dependent ones, kernels without a meta version);
- any output that is not a meta tensor.

``tests/test_meta_shape_propagation.py`` checks it against torch's on every signature a TP,
SP, loss-parallel and FSDP-over-TP step of the lab's GPT meets.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

_METHOD = "_propagate_tensor_meta_non_cached"
try:  # private modules: a torch that moved them keeps its own way, and install() leaves it alone
    from torch.distributed._functional_collectives import _are_we_tracing
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    _torch_propagate: Callable[[Any, Any], Any] | None = getattr(ShardingPropagator, _METHOD, None)
except ImportError:
    _torch_propagate = None


class NoMetaAnswer(Exception):
    """Meta tensors do not answer this op as torch's fake tensors would: torch's own method answers it."""


def install() -> None:
    """Propagate DTensor's output shapes on meta tensors in this process, torch's way where meta can't (idempotent;
    nothing where this torch has no such method)."""
    if _torch_propagate is not None:
        setattr(ShardingPropagator, _METHOD, _propagate_on_meta)


def uninstall() -> None:
    """Give the propagation back to torch alone."""
    if _torch_propagate is not None:
        setattr(ShardingPropagator, _METHOD, _torch_propagate)


def installed() -> bool:
    """Whether this process propagates on meta tensors."""
    return _torch_propagate is not None and getattr(ShardingPropagator, _METHOD) is _propagate_on_meta


def torch_tensor_meta(propagator: Any, op_schema: Any) -> Any:
    """torch's own answer (fake tensors), whatever is installed."""
    return _torch_propagate(propagator, op_schema)


def meta_tensor_meta(op_schema: Any) -> Any:
    """The op's output TensorMeta (or a tuple/list of them, None for non-tensors) from meta tensors, given
    DTensor's ``OpSchema``; raises ``NoMetaAnswer`` where meta does not answer as torch's fake tensors would."""
    leaves = tree_flatten((op_schema.args_schema, op_schema.kwargs_schema))[0]
    if "device" in op_schema.kwargs_schema or any(isinstance(leaf, torch.device) for leaf in leaves):
        raise NoMetaAnswer("an op given a device would allocate on it")
    specs = [leaf for leaf in leaves if isinstance(leaf, DTensorSpec)]
    if not specs or any(spec.tensor_meta is None for spec in specs):
        raise NoMetaAnswer("no input shapes to start from")
    if any(not isinstance(size, int) for spec in specs for size in (*spec.tensor_meta.shape, *spec.tensor_meta.stride)):
        raise NoMetaAnswer("symbolic shapes")
    args = tree_map_only(DTensorSpec, _empty_meta, op_schema.args_schema, is_leaf=_is_spec)
    kwargs = tree_map_only(DTensorSpec, _empty_meta, op_schema.kwargs_schema, is_leaf=_is_spec)
    try:
        out = op_schema.op(*args, **kwargs)
    except Exception as error:  # data-dependent ops and kernels with no meta version
        raise NoMetaAnswer(f"meta raised {type(error).__name__}") from error
    if isinstance(out, torch.Tensor):
        return _tensor_meta(out)
    if isinstance(out, (tuple, list)):
        metas = [_tensor_meta(item) if isinstance(item, torch.Tensor) else None for item in out]
        return tuple(metas) if isinstance(out, tuple) else metas
    return None


def _propagate_on_meta(self: Any, op_schema: Any) -> Any:
    if _are_we_tracing():
        return _torch_propagate(self, op_schema)
    try:
        return meta_tensor_meta(op_schema)
    except NoMetaAnswer:
        return _torch_propagate(self, op_schema)


def _is_spec(x: object) -> bool:
    return isinstance(x, DTensorSpec)


def _empty_meta(spec: DTensorSpec) -> torch.Tensor:
    meta = spec.tensor_meta
    return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")


def _tensor_meta(tensor: torch.Tensor) -> TensorMeta:
    if tensor.device.type != "meta":
        raise NoMetaAnswer("the op answered off the meta device")
    return TensorMeta(shape=tensor.shape, stride=tensor.stride(), dtype=tensor.dtype)
