"""``Record``: what every plain record that crosses the lines between ranks, driver and views is.

Every record is a frozen dataclass of JSON-able fields with ``to_dict``/``from_dict``, so a
saved run can be replayed by the views without any rank or any torch import. The ranks
write them (as dicts), the driver passes them on, and the widgets read them through
``from_dict``: a key the record does not know, or a required key that is missing, raises
``RecordShapeError`` naming the record and the key, so a change of shape on the ranks
fails loudly instead of drawing nothing. Standard library only: the widgets import this.

Each record is defined once, in ``kernels.contract``, beside the others its writer makes:
``pool_records`` (engines, ranks, status, failures, cell output), ``measure_records``
(traces, bubble, memory, communication, layouts), ``watch_records`` (what a training rank
publishes), ``ps_records`` (the parameter server's spans); the run's own config is
``run_config.RunConfig``, its layout ``strategy.Strategy``.
"""
from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

T = TypeVar("T", bound="Record")
# Exactly these types come back from JSON as they went in (an enum or a numpy float does not: it takes the round trip).
_JSON_SCALARS = frozenset({int, float, str, bool, type(None)})


class RecordShapeError(ValueError):
    """A dict does not have the shape of the record it should be (unknown or missing keys)."""


class Record:
    """Mixin: conversion to and from plain dicts (tuples become lists in JSON)."""

    _nested: ClassVar[dict[str, type["Record"]]] = {}  # field -> record type of its items (tuple or dict of them)

    def to_dict(self) -> dict[str, Any]:
        """Return the record as a JSON-able dict, equal to itself after a JSON round trip (lists, not tuples)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        if all(type(value) in _JSON_SCALARS for value in values.values()):
            return values  # what the round trip gives back anyway, without its cost (a rank sends one a step)
        return json.loads(json.dumps(dataclasses.asdict(self)))  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[T], data: Mapping[str, Any]) -> T:
        """Build the record from a dict made by ``to_dict`` (or read back from JSON); strict about its keys."""
        if not isinstance(data, Mapping):
            raise RecordShapeError(f"{cls.__name__}: expected a dict, got {type(data).__name__} {data!r:.80}")
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        for key in data:
            if key not in fields:
                raise RecordShapeError(f"{cls.__name__}: unknown key {key!r}; its keys are {list(fields)}")
        for name, f in fields.items():
            if name not in data and f.default is f.default_factory is dataclasses.MISSING:
                raise RecordShapeError(f"{cls.__name__}: missing key {name!r}")
        return cls(**{k: cls._field_value(k, v) for k, v in data.items()})

    @classmethod
    def _field_value(cls, name: str, value: Any) -> Any:
        """JSON lists back to tuples; nested record dicts back to records."""
        inner = cls._nested.get(name)
        if inner is not None and isinstance(value, Mapping):
            return {k: inner.coerce(v) for k, v in value.items()}
        if isinstance(value, list):
            return tuple(inner.coerce(v) for v in value) if inner is not None else tuple(value)
        return value

    def _enum_field(self, name: str, kind: type[enum.StrEnum]) -> None:
        """Set field ``name`` to its member of ``kind`` (JSON and people give the value); a value that is none
        of them raises ``RecordShapeError`` naming the record, the field and the choices."""
        value = getattr(self, name)
        try:
            object.__setattr__(self, name, kind(value))
        except ValueError:
            raise RecordShapeError(f"{type(self).__name__}: {name} {value!r} is not one of {', '.join(kind)}") from None

    @classmethod
    def coerce(cls: type[T], item: Any) -> T:
        """``item`` if it is already this record, else ``from_dict(item)`` (records or their dicts both work)."""
        return item if isinstance(item, cls) else cls.from_dict(item)
