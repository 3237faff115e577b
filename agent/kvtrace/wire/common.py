"""What every family of conversions needs: model enums as wire numbers and back, an optional field's
presence, the stack statuses' names.

The wire enums carry the model enums' numbers (a unit test keeps them equal), so converting is a
number copy; a value a newer agent added is either None (enum_member) or a fallback (known_member).
Kept apart so that events, columns, agent, vLLM and JSON conversions share one rule instead of
importing each other for it.
"""
from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, TypeVar

from kvtrace.model.events import StackStatus

STACK_STATUS_NAMES = {status: status.name.lower() for status in StackStatus}


def wire_number(value: enum.IntEnum | None) -> Any:
    """A model enum as the wire's: the numbers are the same by design (tests check each enum), so
    the conversion is a number copy; None is the wire's UNSPECIFIED (0)."""
    return int(value) if value is not None else 0


def wire_numbers(values: Iterable[enum.IntEnum]) -> list[Any]:
    return [int(value) for value in values]


_E = TypeVar("_E", bound=enum.IntEnum)


def enum_member(enum_type: type[_E], value: int) -> _E | None:
    """The model enum member for a wire value; None for UNSPECIFIED (0)."""
    return enum_type(value) if value else None


def known_member(enum_type: type[_E], value: int, fallback: _E) -> _E:
    """The model member for a wire value; `fallback` for a value a newer agent added."""
    try:
        return enum_type(value)
    except ValueError:
        return fallback


def optional_field(message, name: str):
    """An optional (has-presence) field's value, None when unset."""
    return getattr(message, name) if message.HasField(name) else None


U64_MAX = 2**64 - 1
S64_MIN, S64_MAX = -(2**63), 2**63 - 1


def saturated_u64(value: int) -> int:
    """A sum for a uint64 field, held at the field's bounds: a figure one process chose (a made-up size) never
    fails a whole response for everybody (protobuf refuses a value out of range). The probes bound what enters
    (sources/bpf/shares.py); this is the last line, for sums of many and for recordings."""
    return U64_MAX if value > U64_MAX else max(0, value)


def saturated_s64(value: int) -> int:
    """saturated_u64 for a sint64/int64 field."""
    return S64_MAX if value > S64_MAX else S64_MIN if value < S64_MIN else value
