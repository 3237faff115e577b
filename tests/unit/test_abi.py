"""probes/kvtrace.h and its Python mirrors must agree: constants, sizes, field offsets."""
import ctypes
import re

import pytest

from kvtrace.model.events import Api, Kind, Layer, Memory, ObjectKind
from kvtrace.sources.bpf import abi
from kvtrace.sources.bpf.symbols import ALL_SYMBOLS

HEADER = (abi.probes_dir() / "kvtrace.h").read_text()
SOURCE = abi.program_text()


def defines(prefix: str) -> dict[str, int]:
    return {name: int(value) for name, value in
            re.findall(rf"#define {prefix}(\w+)\s+\(?(-?\d+)\)?", HEADER)}


@pytest.mark.parametrize("prefix,enum_type", [
    ("KVT_LAYER_", Layer), ("KVT_OBJECT_", ObjectKind), ("KVT_MEMORY_", Memory), ("KVT_KIND_", Kind),
])
def test_enum_values_match_header(prefix, enum_type):
    header = defines(prefix)
    assert header == {member.name: member.value for member in enum_type}


def test_api_ids_match_header():
    header = defines("KVT_API_")
    header["process_exit"] = header.pop("PROCESS_EXIT")
    assert header == {member.name: member.value for member in Api}


def test_counter_indexes_match_header():
    header = defines("KVT_COUNTER_")
    assert header.pop("COUNT") == len(abi.COUNTERS)
    assert {name.lower(): index for name, index in header.items()} == \
        {name: index for index, name in enumerate(abi.COUNTERS)}


def _struct_fields(name: str) -> list[tuple[str, str]]:
    body = re.search(rf"struct {name} \{{(.*?)\}};", HEADER, re.S).group(1)
    fields = []
    for line in body.splitlines():
        line = re.sub(r"/\*.*?\*/", "", line).strip()
        match = re.match(r"(u64|s64|u32|s32|u16|s16|u8|s8|char) (\w+)(\[\w+\])?;", line)
        if match:
            fields.append((match.group(2), match.group(1)))
    return fields


_SIZES = {"u64": 8, "s64": 8, "u32": 4, "s32": 4, "u16": 2, "s16": 2, "u8": 1, "s8": 1}


@pytest.mark.parametrize("c_name,py_type", [
    ("kvt_event", abi.RawEvent), ("kvt_ledger_key", abi.RawLedgerKey),
    ("kvt_ledger_value", abi.RawLedgerValue), ("kvt_notify", abi.RawNotify),
    ("kvt_totals_key", abi.RawTotalsKey), ("kvt_totals_value", abi.RawTotalsValue),
    ("kvt_py_target", abi.RawPyTarget), ("kvt_frame", abi.RawFrame), ("kvt_usdt_arg", abi.RawUsdtArg),
])
def test_struct_layout_matches_header(c_name, py_type):
    fields = _struct_fields(c_name)
    assert [name for name, _ in fields] == [name for name, _ in py_type._fields_]
    offset = 0
    for name, c_type in fields:
        assert getattr(py_type, name).offset == offset, name
        offset += _SIZES.get(c_type, abi.COMM_LEN)
    assert ctypes.sizeof(py_type) == offset


def test_usdt_site_matches_header():
    assert [name for name, _ in _struct_fields("kvt_usdt_site")] == ["api", "batch", "arg_count"]
    assert abi.RawUsdtSite.args.offset == 8 and abi.USDT_MAX_ARGS == defines("KVT_USDT_")["MAX_ARGS"]
    assert ctypes.sizeof(abi.RawUsdtSite) == 8 + abi.USDT_MAX_ARGS * ctypes.sizeof(abi.RawUsdtArg)
    kinds = defines("KVT_USDT_ARG_")
    assert (kinds["NONE"], kinds["CONSTANT"], kinds["REGISTER"], kinds["MEMORY"]) == \
        (abi.USDT_ARG_NONE, abi.USDT_ARG_CONSTANT, abi.USDT_ARG_REGISTER, abi.USDT_ARG_MEMORY)


def test_config_indexes_match_header():
    config = defines("KVT_CONFIG_")
    assert config.pop("COUNT") == 5
    assert config == {"FILTER_ENABLED": abi.CONFIG_FILTER_ENABLED,
                      "BLOCK_EVENTS_PER_SECOND": abi.CONFIG_BLOCK_EVENTS_PER_SECOND,
                      "PROCESS_GENERATION": abi.CONFIG_PROCESS_GENERATION,
                      "BLOCK_SAMPLE_BYTES": abi.CONFIG_BLOCK_SAMPLE_BYTES,
                      "QUIET_BLOCKS": abi.CONFIG_QUIET_BLOCKS}


def test_block_sample_draws_match_probes():
    usdt = (abi.probes_dir() / "usdt.h").read_text()
    draws = int(re.search(r"#define KVT_BLOCK_SAMPLE_DRAWS (\d+)", usdt).group(1))
    assert draws == abi.BLOCK_SAMPLE_DRAWS and draws & (draws - 1) == 0  # the probe masks a random number


def test_python_frame_constants_match_probes():
    """What the probe skips and masks in a frame is what sources/python/offsets.py says (and the tests' own
    walk of the frames in tests/unit/test_symbolize.py does)."""
    from kvtrace.sources.python.offsets import FRAME_OWNED_BY_SHIM_FROM, STACK_REF_TAG_BITS

    pystack = (abi.probes_dir() / "pystack.h").read_text()
    assert int(re.search(r"#define KVT_PY_OWNER_SHIM_FROM (\d+)", pystack).group(1)) == FRAME_OWNED_BY_SHIM_FROM
    assert int(re.search(r"#define KVT_PY_REF_TAG_BITS (\d+)", pystack).group(1)) == STACK_REF_TAG_BITS


def test_every_attached_symbol_has_entry_and_return_probe():
    generated = set(re.findall(r"KVT_(?:ALLOC|FREE|PITCH)_API\((\w+),", SOURCE))
    written = set(re.findall(r"int entry_(\w+)\(struct pt_regs", SOURCE)) & \
        set(re.findall(r"int return_(\w+)\(struct pt_regs", SOURCE))
    assert set(ALL_SYMBOLS) <= generated | written


def test_stack_status_names_match_header():
    from kvtrace.model.events import StackStatus

    header = defines("KVT_STACK_")
    # UNRESOLVED is user space's own verdict: walked, but its frames were gone before they were read
    assert header == {status.name: status.value for status in StackStatus if status is not StackStatus.UNRESOLVED}


def test_stack_struct_matches_header():
    assert ctypes.sizeof(abi.RawStack) == 8 + 16 * defines("KVT_")["MAX_FRAMES"]
    assert abi.MAX_FRAMES == defines("KVT_")["MAX_FRAMES"]


def test_event_struct_decodes_the_ctypes_record():
    from kvtrace.model.events import Api, Kind, Layer, Memory, ObjectKind, StackStatus
    from kvtrace.sources.bpf.decode import Clock, decode_event

    assert abi.EVENT_STRUCT.size == ctypes.sizeof(abi.RawEvent)
    raw = abi.RawEvent(timestamp_ns=5, address=0x7F00, size_bytes=1 << 20, caller_address=0x401000,
                       aux=9, stack_id=77, pid=42, tid=43, device=-1, error_code=2, api=1, kind=3,
                       layer=1, object=1, memory=1, stack_status=1, comm=b"VLLM::Worker_TP")
    clock = Clock()
    event, stack_id = decode_event(bytes(raw), clock)
    assert stack_id == 77
    assert (event.kind, event.api, event.layer, event.object, event.memory) == \
        (Kind.ALLOC_FAILED, Api.cudaMalloc, Layer.RUNTIME, ObjectKind.ALLOCATION, Memory.DEVICE)
    assert (event.pid, event.tid, event.address, event.size_bytes, event.device, event.error_code,
            event.caller_address, event.handle, event.freed_bytes) == (42, 43, 0x7F00, 1 << 20, -1, 2, 0x401000, 0, 0)
    assert event.timestamp_ns == 5 + clock.offset_ns
    assert event.comm == "VLLM::Worker_TP" and event.stack_status is StackStatus.OK
    raw.api, raw.kind = 42, 6  # cuMemMap: aux is the handle mapped
    assert decode_event(bytes(raw), clock)[0].handle == 9
