"""Symbolized stacks: Python frames (function, file, line), the native caller, and interning.

An allocation event carries a stack id rather than its frames: the same few call sites allocate
over and over, so a stream sends each distinct stack once and refers to it by id afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

UNKNOWN_FUNCTION = "<unknown>"


@dataclass(frozen=True, slots=True)
class Frame:
    """One Python frame. `function` is the qualified name (co_qualname on 3.11+, co_name on 3.10,
    which has no qualname); `line` is 0 when the line table has no line for the instruction."""

    function: str
    file: str
    line: int


# A frame whose code object could not be read: shown as unknown rather than guessed.
UNKNOWN_FRAME = Frame(UNKNOWN_FUNCTION, "", 0)


@dataclass(frozen=True, slots=True)
class Stack:
    """Python frames, innermost first. `truncated`: the walk stopped at its frame limit, so the
    outermost frames are missing."""

    frames: tuple[Frame, ...]
    truncated: bool = False


class NativeFrame(NamedTuple):
    """A native code address as (module path, symbol, offset). With a symbol, `offset` is from the
    symbol's start; without one (`symbol == ""`), it is the address in the module's own ELF
    address space (the run-time address less the load bias), which is what addr2line takes."""

    module: str
    symbol: str
    offset: int


class StackTable:
    """Interns stacks: equal stacks get the same id, ids start at 1 and never change or get reused
    (0 is left free to mean "no stack" in events)."""

    def __init__(self) -> None:
        self._ids: dict[Stack, int] = {}
        self._stacks: dict[int, Stack] = {}
        self._next_id = 1

    def intern(self, stack: Stack) -> int:
        stack_id = self._ids.get(stack)
        if stack_id is None:
            stack_id = self._next_id
            self.define(stack_id, stack)
        return stack_id

    def define(self, stack_id: int, stack: Stack) -> None:
        """Gives `stack` the id another table gave it (a replayed recording keeps the agent's ids)."""
        if stack_id < 1:
            raise ValueError(f"stack ids start at 1, not {stack_id}")
        self._stacks[stack_id] = stack
        self._ids.setdefault(stack, stack_id)
        self._next_id = max(self._next_id, stack_id + 1)

    def get(self, stack_id: int) -> Stack:
        """The stack with this id; KeyError for an id this table never gave out."""
        return self._stacks[stack_id]

    def __len__(self) -> int:
        return len(self._stacks)

    def __contains__(self, stack: object) -> bool:
        return stack in self._ids
