"""Outstanding device memory by Python stack, as flame graphs.

Two formats, both made from the ledger's outstanding entries:

- `folded_stacks`: Brendan Gregg's folded format, one line per distinct path with its bytes,
  ``pid 1234 <title>;GPU 0;<module> (serve.py:1);...;load (model.py:7);[cuMemAlloc_v2] 2147483648``.
  flamegraph.pl, inferno-flamegraph and speedscope draw it (``flamegraph.pl --countname bytes``).
- `speedscope_document`: speedscope's JSON file format, one "sampled" profile per process and GPU
  whose sample weights are bytes; open it on speedscope.app or with the `speedscope` command.

There is no SVG writer here: no maintained Python library renders one from folded stacks (the ones
on PyPI wrap flamegraph.pl, or are unmaintained bindings to inferno), and kvtrace does not draw its
own. Feed the folded lines to flamegraph.pl or inferno-flamegraph for an SVG.

Only memory held on the device counts (by default the driver and VMM layers, where the physical
bytes are; the runtime layer is the same bytes seen from cudaMalloc's side). The bytes are
outstanding, not leaked: they are what each stack holds now.

PyTorch blocks under stack sampling (only some blocks' stacks walked) weigh their estimated bytes
(model/blocks.py estimated_bytes), rounded: a chosen block stands for those passed over, which add
nothing of their own (no "[no Python stack]" path for them). `estimated` says whether a graph of
those entries holds such estimates; the speedscope document says so in its name.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from kvtrace import __version__
from kvtrace.human import device_label
from kvtrace.model.blocks import estimated_bytes, is_estimated
from kvtrace.model.events import MEMORY_OBJECTS, PHYSICAL_LAYERS, Layer, Memory
from kvtrace.model.ledger import Outstanding
from kvtrace.model.processes import CONTROL_CHARACTERS
from kvtrace.model.stacks import Stack

SPEEDSCOPE_SCHEMA_URL = "https://www.speedscope.app/file-format-schema.json"
# Added to a speedscope document's name when some of its bytes are estimates from sampled stacks.
ESTIMATED_NOTE = " (bytes estimated from sampled block stacks)"
NO_STACK_FRAME = "[no Python stack]"
# The walk stopped at its frame limit: the outermost frames are missing above this one.
TRUNCATED_FRAME = "[truncated]"
# Frame text and titles come from the traced process: capped so that one hostile name cannot make
# every line of the file huge.
MAX_FRAME_CHARS = 512
MAX_TITLE_CHARS = 200


class _Frame(NamedTuple):
    """One frame of a path: a Python frame (with file and line) or a label of ours (without)."""

    name: str
    file: str = ""
    line: int = 0


_Path = tuple[_Frame, ...]  # outermost first, ending with the allocating API


def folded_stacks(entries: Iterable[Outstanding], stack_of: Callable[[int], Stack | None],
                  titles: dict[int, str], layers: Iterable[Layer] = PHYSICAL_LAYERS) -> list[str]:
    """One ``root;...;leaf <bytes>`` line per distinct path, sorted.

    A path is ``pid <pid> <title>``, ``GPU <ordinal>`` (``GPU ?`` when the device is unknown), the
    Python frames outermost first as ``function (file:line)`` (``[no Python stack]`` for an entry
    without one), then the API that allocated, e.g. ``[cuMemAlloc_v2]``. Semicolons in names
    become colons and control and bidi characters spaces, so every line parses as the format says.
    """
    lines = []
    for (pid, device), paths in _bytes_by_path(entries, stack_of, layers)[0].items():
        root = f"{_folded_text(_process_name(pid, titles))};{_gpu_name(device)}"
        for path, size_bytes in paths.items():
            lines.append(";".join([root, *(_folded_text(_label(frame)) for frame in path)]) + f" {size_bytes}")
    return sorted(lines)


def speedscope_document(entries: Iterable[Outstanding], stack_of: Callable[[int], Stack | None],
                        titles: dict[int, str], layers: Iterable[Layer] = PHYSICAL_LAYERS,
                        name: str = "kvtrace: outstanding device memory") -> dict[str, Any]:
    """A speedscope file (https://www.speedscope.app/file-format-schema.json) as a JSON-ready dict.

    One "sampled" profile per (pid, GPU), ordered by pid then GPU, unit "bytes"; each distinct path
    is one sample (frame indices into the shared frame list, outermost first, ending with the
    allocating API) weighted by the bytes it holds. The process and GPU name the profile rather
    than being frames of it.
    """
    frames: list[dict[str, Any]] = []
    frame_index: dict[_Frame, int] = {}
    profiles = []
    by_path, estimates = _bytes_by_path(entries, stack_of, layers)
    for (pid, device), paths in sorted(by_path.items()):
        samples, weights = [], []
        for path, size_bytes in sorted(paths.items()):
            sample = []
            for frame in path:
                index = frame_index.get(frame)
                if index is None:
                    index = frame_index[frame] = len(frames)
                    frames.append(_speedscope_frame(frame))
                sample.append(index)
            samples.append(sample)
            weights.append(size_bytes)
        profiles.append({
            "type": "sampled",
            "name": f"{_process_name(pid, titles)}, {_gpu_name(device)}",
            "unit": "bytes",
            "startValue": 0,
            "endValue": sum(weights),
            "samples": samples,
            "weights": weights,
        })
    document: dict[str, Any] = {
        "$schema": SPEEDSCOPE_SCHEMA_URL,
        "name": name + ESTIMATED_NOTE if estimates else name,
        "exporter": f"kvtrace {__version__}",
        "shared": {"frames": frames},
        "profiles": profiles,
    }
    if profiles:
        document["activeProfileIndex"] = 0
    return document


def estimated(entries: Iterable[Outstanding], layers: Iterable[Layer] = PHYSICAL_LAYERS) -> bool:
    """Whether a flame graph of these entries (in `layers`) weighs some bytes by estimates from sampled
    block stacks, not exactly."""
    wanted = frozenset(layers)
    return any(entry.sample_bytes and entry.key.layer in wanted and is_estimated(entry) for entry in entries)


def _bytes_by_path(entries: Iterable[Outstanding], stack_of: Callable[[int], Stack | None],
                   layers: Iterable[Layer]) -> tuple[dict[tuple[int, int], dict[_Path, int]], bool]:
    """Bytes per (pid, device) and path, summed over the entries that hold device memory (blocks under
    stack sampling: estimated, rounded per path), and whether any are estimates."""
    wanted = frozenset(layers)
    totals: dict[tuple[int, int], dict[_Path, float]] = {}
    stacks: dict[int, tuple[_Frame, ...]] = {}  # many entries share a stack: convert each once
    estimates = False
    for entry in entries:
        # holds_device_memory (model/ledger.py), with the layers the caller chose.
        key = entry.key
        if key.layer not in wanted or key.object not in MEMORY_OBJECTS or entry.memory is not Memory.DEVICE:
            continue
        size_bytes: float = entry.size_bytes
        if entry.sample_bytes:
            estimates = estimates or is_estimated(entry)
            if not entry.sampled:
                continue  # no stack of its own: the chosen blocks' estimates stand for it
            size_bytes = estimated_bytes(entry)
        python_frames = stacks.get(entry.stack_id)
        if python_frames is None:
            python_frames = stacks[entry.stack_id] = _python_frames(entry.stack_id, stack_of)
        path = (*python_frames, _Frame(f"[{entry.api.name}]"))
        by_path = totals.setdefault((key.pid, entry.device), {})
        by_path[path] = by_path.get(path, 0) + size_bytes
    rounded = {place: {path: round(size_bytes) for path, size_bytes in paths.items()}
               for place, paths in totals.items()}
    return rounded, estimates


def _python_frames(stack_id: int, stack_of: Callable[[int], Stack | None]) -> tuple[_Frame, ...]:
    stack = stack_of(stack_id) if stack_id else None
    if stack is None or not stack.frames:
        return (_Frame(NO_STACK_FRAME),)
    frames = tuple(_Frame(_capped(frame.function, MAX_FRAME_CHARS), _capped(frame.file, MAX_FRAME_CHARS), frame.line)
                   for frame in reversed(stack.frames))  # the model's frames are innermost first
    return (_Frame(TRUNCATED_FRAME), *frames) if stack.truncated else frames


def _label(frame: _Frame) -> str:
    return f"{frame.name} ({frame.file}:{frame.line})" if frame.file else frame.name


def _speedscope_frame(frame: _Frame) -> dict[str, Any]:
    if not frame.file:
        return {"name": frame.name}
    return {"name": frame.name, "file": frame.file, "line": frame.line}


def _process_name(pid: int, titles: dict[int, str]) -> str:
    title = titles.get(pid, "")
    return f"pid {pid} {_capped(title, MAX_TITLE_CHARS)}" if title else f"pid {pid}"


def _gpu_name(device: int) -> str:
    return f"GPU {device_label(device)}"


def _capped(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _folded_text(text: str) -> str:
    """`;` separates frames and a newline ends the line: neither may appear inside a frame. Control
    characters (line breaks among them) become spaces, and so do the bidi controls that would make
    a terminal or a viewer show the frame's text other than as it is."""
    return CONTROL_CHARACTERS.sub(" ", text.replace(";", ":"))
