"""What a client may ask: requests checked and turned into the model's filters before any work.

Every field of a request is untrusted. This module holds the bounds the service holds requests to,
turns pids, kinds, layers and a title regex (compiled in RE2, linear time; refused without it) into
an EventFilter, and bounds GetSnapshot's page tokens (servers/cursors.py makes and reads them: a listing's
random id and page number, nothing of the ledger). A bad field raises InvalidArgument, `field: reason`,
which the service answers with INVALID_ARGUMENT. ServerLimits, the bounds on what all clients
together may take (streams, message sizes, threads), lives here too, beside the other bounds:
the stream slots, the service and the server read it from this module, which imports no other
module of the package.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace.model.events import Kind, Layer
from kvtrace.model.processes import TitlePattern
from kvtrace.servers.hub import EventFilter

try:  # google-re2: linear-time matching for clients' regexes. A host without it refuses them.
    import re2
except ImportError:  # pragma: no cover - depends on the host
    re2 = None

MAX_FILTER_PIDS = 1024
MAX_TITLE_REGEX_CHARS = 1024
MAX_REGEX_MEMORY_BYTES = 8 << 20  # RE2's budget for one compiled title regex
NO_SAFE_REGEX = "this agent has no safe regex engine; install google-re2 (pip install google-re2)"
MAX_SIZE_BYTES = 1 << 50  # 1 PiB: no GPU allocation is larger; beyond it the value is a mistake
DEFAULT_PAGE_SIZE = 1000
MAX_PAGE_SIZE = 10000
MAX_PAGE_TOKEN_CHARS = 256
DEFAULT_SUSPECTS = 100
MAX_SUSPECTS = 10000
MAX_MIN_AGE_SECONDS = 365 * 24 * 3600.0
# SetProcessDepth: how long an operator's request holds (`kvtrace deep --for`).
DEFAULT_DEPTH_SECONDS = 600.0
MIN_DEPTH_SECONDS = 1.0
MAX_DEPTH_SECONDS = 24 * 3600.0
MAX_PID = 1 << 22  # the kernel's largest pid_max (64-bit)


@dataclass(frozen=True)
class ServerLimits:
    # Concurrent StreamEvents calls, all endpoints together. When all are taken, the stream that has
    # not read for longest is ended (if that is at least evict_stalled_seconds) for the new one;
    # otherwise the new one gets RESOURCE_EXHAUSTED.
    # Each socket has its own (issue 31: the admin socket never waits behind the group socket).
    max_streams: int = 64
    evict_stalled_seconds: float = 10.0
    # With every slot taken, streams quiet this long are probed (slots.py): probe_bytes of filler, more than
    # gRPC's windows and the socket's buffers absorb (measured: about 5 MiB), so a stream that does not read
    # blocks; blocked probe_stall_seconds it is ended for the new one, which waits up to probe_wait_seconds.
    probe_quiet_seconds: float = 10.0
    probe_bytes: int = 16 << 20
    probe_stall_seconds: float = 2.0
    probe_wait_seconds: float = 4.0
    max_probes: int = 8  # streams probed at once, the quiet longest first
    probe_again_seconds: float = 60.0  # a stream that passed a probe (it reads) is not probed again sooner
    # The group socket's shares per user (peers.py): connections, and streams a connection may carry.
    max_group_connections_per_user: int = 4
    max_streams_per_connection: int = 4
    max_receive_message_bytes: int = 4 << 20
    batch_max_events: int = 512  # events per StreamEventsResponse
    # ... with EVENT_ENCODING_COLUMNS (~25 bytes an event). Each response costs the stream's thread a
    # hand-over of the GIL or two (a few ms while the event loop is busy): big ones keep it fed.
    column_batch_max_events: int = 8192
    # A stream waiting for events wakes at once for an event, a cancel or the shutdown; besides
    # that it looks at its call this often (a cheap wake-up, not a poll for events).
    idle_wake_seconds: float = 1.0
    health_poll_seconds: float = 1.0
    extra_workers: int = 16  # threads beyond max_streams, for unary calls and health watches


class InvalidArgument(Exception):
    """A request field is wrong; becomes INVALID_ARGUMENT with `field: reason`."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")


def _enum_values(field: str, values, enum_type) -> frozenset:
    """Proto3 keeps unknown enum numbers as plain ints: refuse them, and the zero value, by name."""
    members = []
    for index, value in enumerate(values):
        if value not in enum_type._value2member_map_:
            raise InvalidArgument(f"{field}[{index}]", f"unknown or unspecified value {value}")
        members.append(enum_type(value))
    return frozenset(members)


def _pids(field: str, pids) -> frozenset[int]:
    if len(pids) > MAX_FILTER_PIDS:
        raise InvalidArgument(field, f"{len(pids)} pids; at most {MAX_FILTER_PIDS}")
    return frozenset(pids)


def compile_title_regex(pattern: str) -> TitlePattern:
    """A client's title regex in RE2, whose matching is linear in the text: `(a+)+$` cannot stall
    the agent. Python's `re` backtracks (exponential time), so without RE2 the filter is refused."""
    if len(pattern) > MAX_TITLE_REGEX_CHARS:
        raise InvalidArgument("title_regex", f"longer than {MAX_TITLE_REGEX_CHARS} characters")
    if re2 is None:
        raise InvalidArgument("title_regex", NO_SAFE_REGEX)
    options = re2.Options()
    options.log_errors = False  # a client's typo is its error, not a line in the agent's log
    options.max_mem = MAX_REGEX_MEMORY_BYTES
    try:
        return re2.compile(pattern, options)
    except re2.error as error:
        reason = error.args[0] if error.args else error
        if isinstance(reason, bytes):
            reason = reason.decode("utf-8", "replace")
        raise InvalidArgument("title_regex", f"not a valid RE2 regular expression: {reason}") from None


def stream_filter(request: service_pb2.StreamEventsRequest, redacted_titles: bool = False) -> EventFilter:
    title_regex = compile_title_regex(request.title_regex) if request.title_regex else None
    # A negative int64 sent by a careless client arrives as a uint64 above 2**63: absurd as well.
    if request.min_size_bytes > MAX_SIZE_BYTES:
        raise InvalidArgument("min_size_bytes", f"{request.min_size_bytes} is more than 1 PiB")
    # In the redacted view the regex sees redacted titles: it must not probe for a secret.
    return EventFilter(pids=_pids("pids", request.pids), title_regex=title_regex,
                       redacted_titles=redacted_titles and title_regex is not None,
                       kinds=_enum_values("kinds", request.kinds, Kind),
                       layers=_enum_values("layers", request.layers, Layer),
                       min_size_bytes=request.min_size_bytes)


