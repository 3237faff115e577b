"""The flame graph exports on a ledger driven by synthetic events: exact folded lines and byte sums,
frees, entries without a stack, hostile frame names, and a speedscope file checked against
speedscope's own schema (the npm package's file-format-schema.json, which `make test` installs into
.tools; skipped with the reason without it)."""
import json
from pathlib import Path

import pytest

from kvtrace.model.events import Api, Event, Kind, Layer, Memory, ObjectKind
from kvtrace.model.ledger import Ledger
from kvtrace.model.stacks import Frame, Stack, StackTable
from kvtrace.reports.flamegraph import folded_stacks, speedscope_document

REPO = Path(__file__).resolve().parents[2]
SPEEDSCOPE_VERSION = "1.25.0"  # = the Makefile's SPEEDSCOPE_VERSION
SPEEDSCOPE_SCHEMA = REPO / ".tools/node_modules/speedscope/dist/release/file-format-schema.json"

MiB = 1 << 20
T0 = 1_700_000_000_000_000_000
PID, OTHER_PID = 4242, 5151
TITLES = {PID: "python serve.py --model llama", OTHER_PID: "python bench.py"}

# Innermost first, as the model keeps frames.
LOAD = Stack((Frame("load_weights", "/srv/model.py", 71), Frame("Model.__init__", "/srv/model.py", 12),
              Frame("<module>", "serve.py", 3)))
# A hostile qualified name: a semicolon would start a new frame, a newline a new line.
CACHE = Stack((Frame("alloc;cache\nblocks", "/srv/kv.py", 9), Frame("<module>", "serve.py", 5)))
LOAD_PATH = "<module> (serve.py:3);Model.__init__ (/srv/model.py:12);load_weights (/srv/model.py:71)"
CACHE_PATH = "<module> (serve.py:5);alloc:cache blocks (/srv/kv.py:9)"
ROOT = "pid 4242 python serve.py --model llama;GPU 0"


def event(kind=Kind.ALLOC, api=Api.cuMemAlloc_v2, address=0, size=MiB, pid=PID, device=0, stack_id=0,
          layer=Layer.DRIVER, obj=ObjectKind.ALLOCATION, memory=Memory.DEVICE, ts=T0):
    return Event(kind=kind, api=api, pid=pid, tid=pid, timestamp_ns=ts, layer=layer, object=obj, memory=memory,
                 size_bytes=size, address=address, device=device, stack_id=stack_id)


def malloc(address, size, stack_id, pid=PID, device=0):
    """cudaMalloc as the probes see it: the runtime call and the driver allocation inside it (which
    holds the bytes; the runtime entry must not count them twice)."""
    return [event(address=address, size=size, pid=pid, device=device, stack_id=stack_id),
            event(api=Api.cudaMalloc, layer=Layer.RUNTIME, address=address, size=size, pid=pid, device=device,
                  stack_id=stack_id)]


def free(address, pid=PID):
    return [event(Kind.FREE, Api.cuMemFree_v2, address=address, size=0, pid=pid),
            event(Kind.FREE, Api.cudaFree, layer=Layer.RUNTIME, address=address, size=0, pid=pid)]


def ledger_of(events):
    ledger = Ledger()
    for item in events:
        ledger.apply(item)
    return ledger


def parse(line):
    """A folded line as flamegraph.pl reads it: the count after the last space, frames split at `;`."""
    path, count = line.rsplit(" ", 1)
    return path.split(";"), int(count)


@pytest.fixture
def stacks():
    table = StackTable()
    assert (table.intern(LOAD), table.intern(CACHE)) == (1, 2)
    return table


def twenty_three_allocations():
    """GIVEN 23 cudaMalloc calls in one process on GPU 0: 13 from load_weights (1..13 MiB) and 10 from
    the cache allocator (2 MiB each)."""
    events = []
    for k in range(13):
        events += malloc(0x7F00_0000_0000 + k * 0x1000_0000, (k + 1) * MiB, stack_id=1)
    for k in range(10):
        events += malloc(0x7E00_0000_0000 + k * 0x1000_0000, 2 * MiB, stack_id=2)
    return events


def test_23_allocations_from_2_stacks_fold_into_2_lines_with_exact_bytes(stacks):
    ledger = ledger_of(twenty_three_allocations())
    # WHEN folded
    lines = folded_stacks(ledger.entries(), stacks.get, TITLES)
    # THEN one line per stack, outermost frame first, the driver call as the leaf, bytes summed
    assert lines == [
        f"{ROOT};{LOAD_PATH};[cuMemAlloc_v2] {sum(range(1, 14)) * MiB}",
        f"{ROOT};{CACHE_PATH};[cuMemAlloc_v2] {10 * 2 * MiB}",
    ]
    # AND the lines add up to what the ledger says the process holds
    assert sum(parse(line)[1] for line in lines) == ledger.physical_device_bytes(PID) == 111 * MiB


def test_a_free_takes_its_bytes_off_and_the_last_free_removes_the_line(stacks):
    events = twenty_three_allocations()
    # WHEN the 13 MiB block of load_weights and all 10 cache blocks are freed
    events += free(0x7F00_0000_0000 + 12 * 0x1000_0000)
    for k in range(10):
        events += free(0x7E00_0000_0000 + k * 0x1000_0000)
    lines = folded_stacks(ledger_of(events).entries(), stacks.get, TITLES)
    # THEN only load_weights is left, 13 MiB less
    assert lines == [f"{ROOT};{LOAD_PATH};[cuMemAlloc_v2] {sum(range(1, 13)) * MiB}"]


def test_no_stack_unknown_stack_and_unknown_device_fold_to_their_own_frames(stacks):
    events = [*malloc(0x1000, 3 * MiB, stack_id=0),  # no stack walked
              *malloc(0x2000, 5 * MiB, stack_id=99),  # an id the table never gave out
              *malloc(0x3000, 7 * MiB, stack_id=1, device=-1),  # the thread's device is not known
              *malloc(0x4000, 11 * MiB, stack_id=1, pid=OTHER_PID, device=1)]
    lines = folded_stacks(ledger_of(events).entries(), lambda stack_id: stacks.get(stack_id) if stack_id <= 2 else None,
                          {PID: TITLES[PID]})
    assert lines == [
        f"{ROOT};[no Python stack];[cuMemAlloc_v2] {8 * MiB}",
        f"pid 4242 python serve.py --model llama;GPU ?;{LOAD_PATH};[cuMemAlloc_v2] {7 * MiB}",
        f"pid 5151;GPU 1;{LOAD_PATH};[cuMemAlloc_v2] {11 * MiB}",  # no title known: the pid alone
    ]


def test_hostile_names_and_titles_cannot_break_the_format(stacks):
    title = "python evil;title\r\nGPU 7;x 999"
    hostile = Stack((Frame("f\x00;\x1b[31m", "/tmp/a;b\nc.py", 1),))
    table = StackTable()
    table.intern(hostile)
    lines = folded_stacks(ledger_of(malloc(0x1000, 3 * MiB, stack_id=1)).entries(), table.get, {PID: title})
    # THEN one line, still parsed as 4 frames (process, GPU, the frame, the API) and the right count
    assert len(lines) == 1 and "\n" not in lines[0] and "\r" not in lines[0]
    frames, count = parse(lines[0])
    assert count == 3 * MiB
    assert frames == ["pid 4242 python evil:title  GPU 7:x 999", "GPU 0", "f : [31m (/tmp/a:b c.py:1)",
                      "[cuMemAlloc_v2]"]


def test_bidi_controls_in_a_title_or_frame_come_out_as_spaces():
    # GIVEN a title whose right-to-left override would show "gpj.exe" as "exe.jpg", and a frame with
    # an isolate, a line separator and a C1 next-line
    title = "python \u202egpj.exe"
    table = StackTable()
    table.intern(Stack((Frame("f\u2066x\u2028y\x85z", "/tmp/a.py", 1),)))
    # WHEN folded
    lines = folded_stacks(ledger_of(malloc(0x1000, 3 * MiB, stack_id=1)).entries(), table.get, {PID: title})
    # THEN none of them is left, and the line still parses as 4 frames
    assert len(lines) == 1 and len(lines[0].splitlines()) == 1
    assert not any(character in lines[0] for character in "\u202e\u2066\u2028\x85")
    assert parse(lines[0]) == (["pid 4242 python  gpj.exe", "GPU 0", "f x y z (/tmp/a.py:1)", "[cuMemAlloc_v2]"],
                               3 * MiB)


def test_only_device_memory_at_the_chosen_layers_counts(stacks):
    vmm_handle = event(api=Api.cuMemCreate, layer=Layer.VMM, obj=ObjectKind.VMM_HANDLE, address=0x99,
                       size=4 * MiB, stack_id=2)
    events = [
        *malloc(0x1000, 3 * MiB, stack_id=1),
        vmm_handle,  # physical memory, the VMM way
        event(api=Api.cuMemAddressReserve, layer=Layer.VMM, obj=ObjectKind.VMM_RESERVE, memory=Memory.NONE,
              address=0x7000_0000, size=64 * MiB, stack_id=2),  # address space only
        event(api=Api.cuMemAllocHost_v2, memory=Memory.HOST, address=0x5000, size=9 * MiB, stack_id=1),  # pinned host
        event(api=Api.pytorch_malloc, layer=Layer.TORCH, obj=ObjectKind.BLOCK, address=0x1000, size=MiB, stack_id=2),
    ]
    entries = ledger_of(events).entries()
    assert folded_stacks(entries, stacks.get, TITLES) == [
        f"{ROOT};{LOAD_PATH};[cuMemAlloc_v2] {3 * MiB}",
        f"{ROOT};{CACHE_PATH};[cuMemCreate] {4 * MiB}",
    ]
    # The runtime layer shows the cudaMalloc side; PyTorch's layer its blocks.
    assert folded_stacks(entries, stacks.get, TITLES, layers={Layer.RUNTIME}) == [
        f"{ROOT};{LOAD_PATH};[cudaMalloc] {3 * MiB}"]
    assert folded_stacks(entries, stacks.get, TITLES, layers={Layer.TORCH}) == [
        f"{ROOT};{CACHE_PATH};[pytorch_malloc] {MiB}"]


def test_a_truncated_stack_says_its_outer_frames_are_missing():
    table = StackTable()
    table.intern(Stack(LOAD.frames[:2], truncated=True))
    lines = folded_stacks(ledger_of(malloc(0x1000, MiB, stack_id=1)).entries(), table.get, TITLES)
    assert lines == [f"{ROOT};[truncated];Model.__init__ (/srv/model.py:12);load_weights (/srv/model.py:71);"
                     f"[cuMemAlloc_v2] {MiB}"]


def speedscope_validator():
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra: pip install -e '.[test]'")
    if not SPEEDSCOPE_SCHEMA.is_file():
        pytest.skip(f"speedscope's schema is not at {SPEEDSCOPE_SCHEMA}: `make test` installs the speedscope "
                    f"npm package {SPEEDSCOPE_VERSION} into .tools")
    schema = json.loads(SPEEDSCOPE_SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def test_speedscope_document_is_valid_and_adds_up(stacks):
    validator = speedscope_validator()
    events = [*twenty_three_allocations(), *malloc(0x1000, 5 * MiB, stack_id=0, device=1),
              *malloc(0x2000, 7 * MiB, stack_id=1, pid=OTHER_PID)]
    ledger = ledger_of(events)
    # WHEN exported and written as JSON
    document = json.loads(json.dumps(speedscope_document(ledger.entries(), stacks.get, TITLES, name="test")))
    # THEN speedscope's own schema accepts it
    errors = sorted(validator.iter_errors(document), key=lambda error: list(error.path))
    assert [f"{list(error.path)}: {error.message}" for error in errors] == []
    # AND it holds one bytes profile per (pid, GPU), in order, its weights the ledger's bytes
    frames = document["shared"]["frames"]
    profiles = document["profiles"]
    assert document["$schema"] == "https://www.speedscope.app/file-format-schema.json"
    assert [profile["name"] for profile in profiles] == [
        "pid 4242 python serve.py --model llama, GPU 0", "pid 4242 python serve.py --model llama, GPU 1",
        "pid 5151 python bench.py, GPU 0"]
    assert {profile["unit"] for profile in profiles} == {"bytes"}
    assert [profile["endValue"] for profile in profiles] == [
        ledger.physical_device_bytes(PID, 0), ledger.physical_device_bytes(PID, 1),
        ledger.physical_device_bytes(OTHER_PID, 0)] == [111 * MiB, 5 * MiB, 7 * MiB]

    def names(sample):
        return [frames[index]["name"] for index in sample]

    first = profiles[0]
    assert [(names(sample), weight) for sample, weight in zip(first["samples"], first["weights"], strict=True)] \
        == [(["<module>", "Model.__init__", "load_weights", "[cuMemAlloc_v2]"], 91 * MiB),
            (["<module>", "alloc;cache\nblocks", "[cuMemAlloc_v2]"], 20 * MiB)]
    assert [(names(sample), weight) for sample, weight in zip(profiles[1]["samples"], profiles[1]["weights"],
                                                              strict=True)] \
        == [(["[no Python stack]", "[cuMemAlloc_v2]"], 5 * MiB)]
    # AND frames are shared: each distinct frame once, with its file and line
    assert len(frames) == len({json.dumps(frame, sort_keys=True) for frame in frames}) == 7
    assert {"name": "load_weights", "file": "/srv/model.py", "line": 71} in frames


def test_speedscope_document_of_nothing_is_valid():
    validator = speedscope_validator()
    document = speedscope_document([], lambda stack_id: None, {})
    assert list(validator.iter_errors(document)) == []
    assert document["profiles"] == [] and document["shared"] == {"frames": []}
