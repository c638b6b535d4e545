"""What lives as long as the engine, out of the collector's view: ``freeze_long_lived()``, before each build.

A run ends with a full collection, to free its model's and optimizer's reference cycles
(module hooks, autograd graphs) on a warm pool. Over an engine's few hundred thousand
long-lived objects (torch's modules, the imported kernels) one collection took 0.12 s alone
and ~0.4 s with four ranks on two cores: time every run and relayout paid before it could
return. ``gc.freeze`` moves those objects to the permanent generation (Python's own means
for long-running servers), so a collection scans only what was made after.

Whoever drops something that was alive at the freeze and may sit in reference cycles
(an evicted warm mesh, a world being left) calls ``thaw()`` before its collection.
"""
from __future__ import annotations

import gc


_frozen = False


def freeze_long_lived() -> None:
    """Collect, then freeze what survived, unless frozen since the last ``thaw`` (every build calls it first)."""
    global _frozen
    if not _frozen:
        gc.collect()
        gc.freeze()
        _frozen = True


def thaw() -> None:
    """Give the frozen objects back to the collector (who drops long-lived cycles calls it before collecting)."""
    global _frozen
    gc.unfreeze()
    _frozen = False
