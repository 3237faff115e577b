"""`kvtrace snapshot --json` writes each line directly (wire/json.py outstanding_json_line): the same text as
json.dumps of the row's dict, for every kind of object, every enum value (unknown ones too) and any string."""
import json

from hypothesis import example, given
from hypothesis import strategies as st

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace.model.events import ObjectKind
from kvtrace.wire import outstanding_json_line, outstanding_to_json_dict

U32, U64, I32 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1), st.integers(-(2**31), 2**31 - 1)
TEXT = st.text(max_size=40)  # any code point: quotes, backslashes, controls, non-ASCII, surrogates left out
ENUM = st.integers(0, 12)  # the known values, 0 (unspecified: null) and a few no enum has


@given(st.builds(
    service_pb2.OutstandingAllocation, pid=U32, tid=U32, comm=TEXT, title=TEXT, container=TEXT, layer=ENUM,
    object=st.sampled_from([int(kind) for kind in ObjectKind] + [0, 11]), memory=ENUM, api=ENUM, api_name=TEXT,
    size_bytes=U64, address=U64, device=I32, timestamp_ns=U64, caller_address=U64, stack_id=U64,
    mapped_count=U32, released=st.booleans(), handle=U64, stream=U64, sample_bytes=st.integers(0, 2**40),
    sampled=st.booleans()))
@example(service_pb2.OutstandingAllocation(title='vllm "serve" \\ é\x01', object=int(ObjectKind.BLOCK), size_bytes=4096,
                                           sample_bytes=512 << 10, sampled=True))
def test_a_line_is_the_dicts_json(entry):
    line = outstanding_json_line(entry)
    assert line == json.dumps(outstanding_to_json_dict(entry), separators=(",", ":"))
    assert json.loads(line) == outstanding_to_json_dict(entry)
