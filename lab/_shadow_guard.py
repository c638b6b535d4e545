"""Check that ``kernels`` and ``widgets`` are this project's packages, not others of the same name.

Both names are common; an unrelated installed package called ``kernels`` would make
engines run the wrong code with confusing errors, so ``import lab`` stops early.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

_OWN_ROOT = Path(__file__).resolve().parent.parent
_MARKERS = {"kernels": "engine/runtime.py", "widgets": "__init__.py"}


class ShadowedPackageError(ImportError):
    """A package named like one of ours resolves to somewhere else."""


def check_own_packages(root: Path = _OWN_ROOT) -> None:
    """Raise ShadowedPackageError unless ``kernels`` and ``widgets`` resolve inside ``root``."""
    for name, marker in _MARKERS.items():
        spec = importlib.util.find_spec(name)
        origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
        if origin is None or origin.parent.parent != root.resolve() or not (origin.parent / marker).exists():
            where = origin.parent if origin is not None else "nowhere"
            raise ShadowedPackageError(
                f"'import {name}' resolves to {where}, not to Cluster Lab's package in {root}: another "
                f"installed package named '{name}' shadows it. Uninstall it or reinstall cluster-lab "
                f"(pip install -e .) so that Cluster Lab's '{name}' comes first on sys.path.")
