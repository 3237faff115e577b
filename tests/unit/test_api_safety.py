"""The API is safe to leave running on a fleet: untrusted title regexes cannot stall it, the group
socket shows no more than /metrics does, and streams that never read cost no work.

GIVEN the real gRPC server on a fake agent, WHEN clients misbehave or lack privilege, THEN the agent
stays bounded and each view carries only what it should.
"""
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest

from fake_agent import TITLES, FakeAgent, MiB, event, served
from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import agent_service_pb2_grpc as service_grpc
from kvtrace.client import AgentClient
from kvtrace.model.events import Api, Kind, Layer, StackStatus
from kvtrace.model.stacks import Frame, Stack
from kvtrace.servers.api.redaction import redact_info
from kvtrace.servers.api.requests import ServerLimits

SECRET = "sk-kvtrace-secret-0123"
SECRET_TITLE = f"vllm serve /models/llama --api-key {SECRET} --port 8000"
REDACTED_TITLE = "vllm serve /models/llama --api-key *** --port 8000"
UNIT = Path(__file__).resolve().parent


def wait_for(condition, timeout_seconds=10.0):
    deadline = time.monotonic() + timeout_seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def group_stub(server):
    return service_grpc.AgentServiceStub(grpc.insecure_channel(f"unix:{server.config.socket}"))


def admin_stub(server):
    return service_grpc.AgentServiceStub(grpc.insecure_channel(f"unix:{server.config.admin_path}"))


def first_events(responses, count):
    messages = []
    for response in responses:
        messages.extend((response.view, message) for message in response.events)
        if sum(m.WhichOneof("payload") == "allocation" for _, m in messages) >= count:
            break
    responses.cancel()
    return messages


# ---- 4: a client's title regex runs in linear time, or not at all ----

_REGEX_PROBE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from fake_agent import event
    from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
    from kvtrace.servers.api.requests import stream_filter
    from kvtrace.servers.hub import EventHub

    pattern, title = sys.argv[2], sys.argv[3]
    hub = EventHub()
    hostile = hub.subscribe(stream_filter(service_pb2.StreamEventsRequest(title_regex=pattern)))
    other = hub.subscribe()
    events = [event(address=i, title=title if i == 0 else "VLLM::Worker_TP0") for i in range(2000)]
    started = time.perf_counter()
    for item in events:
        hub.publish(item)
    elapsed = time.perf_counter() - started
    print(f"{elapsed:.6f} {len(other.read(4096, 0))} {len(hostile.read(4096, 0))}")
""")


def publish_with_title_regex(pattern: str, title: str) -> tuple[float, int, int]:
    """(seconds the hub took to publish 2000 events, events the other subscriber got, events the
    regex's subscriber got), in a subprocess: a backtracking engine must fail the test, not hang it."""
    try:
        result = subprocess.run([sys.executable, "-c", _REGEX_PROBE, str(UNIT), pattern, title],
                                capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the hub stalled for more than 20 s on title_regex {pattern!r} against {title!r}")
    assert result.returncode == 0, result.stderr
    elapsed, other, hostile = result.stdout.split()
    return float(elapsed), int(other), int(hostile)


def test_a_catastrophic_regex_does_not_stall_the_hub():
    # Python's `re` needs about 2**31 steps for this one: minutes of the agent's event loop.
    baseline, _, _ = publish_with_title_regex("Worker", "a" * 31 + "!")
    elapsed, other, hostile = publish_with_title_regex("(a+)+$", "a" * 31 + "!")
    print(f"\nhub publishing 2000 events: {baseline * 1e3:.1f} ms with a plain regex, "
          f"{elapsed * 1e3:.1f} ms with (a+)+$ against 'a'*31+'!'")
    assert other == 2000 and hostile == 0
    assert elapsed < 10 * baseline + 0.5


def test_title_regex_is_rre2_syntax_and_refused_with_the_field_named():
    with served() as (server, _):
        with pytest.raises(grpc.RpcError) as refused:
            next(group_stub(server).StreamEvents(service_pb2.StreamEventsRequest(title_regex=r"(a)\1"),
                                                 timeout=10))
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("title_regex: not a valid RE2 regular expression")


def test_without_a_safe_engine_title_regex_is_refused_and_the_agent_still_serves(monkeypatch):
    monkeypatch.setattr("kvtrace.servers.api.requests.re2", None)  # a host where google-re2 is not installed
    with served() as (server, backend):
        agent = group_stub(server)
        with pytest.raises(grpc.RpcError) as refused:
            next(agent.StreamEvents(service_pb2.StreamEventsRequest(title_regex="Worker"), timeout=10))
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "no safe regex engine; install google-re2" in refused.value.details()
        responses = agent.StreamEvents(service_pb2.StreamEventsRequest(), timeout=10)
        wait_for(lambda: backend.hub.subscriber_count() == 1)
        backend.apply(event(address=1))
        assert [m.WhichOneof("payload") for _, m in first_events(responses, 1)] == ["allocation"]


def test_the_regex_sees_a_capped_title_and_on_the_group_socket_the_redacted_one(monkeypatch):
    monkeypatch.setitem(TITLES, 400, SECRET_TITLE)
    monkeypatch.setitem(TITLES, 500, "x" * 5000 + " TAIL")
    monkeypatch.setitem(TITLES, 600, f"echo {SECRET}")  # not a flag's value: shown as is
    monkeypatch.setitem(TITLES, 700, "short TAIL")
    with served() as (server, backend):
        probes = {
            "group secret": group_stub(server).StreamEvents(
                service_pb2.StreamEventsRequest(title_regex=SECRET), timeout=10),
            "group name": group_stub(server).StreamEvents(
                service_pb2.StreamEventsRequest(title_regex=r"--api-key \*\*\*"), timeout=10),
            "admin secret": admin_stub(server).StreamEvents(
                service_pb2.StreamEventsRequest(title_regex=SECRET), timeout=10),
            "admin tail": admin_stub(server).StreamEvents(
                service_pb2.StreamEventsRequest(title_regex="TAIL"), timeout=10),
        }
        wait_for(lambda: backend.hub.subscriber_count() == len(probes))
        backend.apply(event(pid=400, address=1), event(pid=500, address=2), event(pid=400, address=3),
                      event(pid=600, address=4), event(pid=700, address=5))
        counts = {"group secret": 1, "group name": 2, "admin secret": 3, "admin tail": 1}
        got = {name: [m.pid for _, m in first_events(responses, counts[name]) if m.HasField("allocation")]
               for name, responses in probes.items()}
    # The redacted view's regex cannot find the secret it does not show; 5000 characters are past
    # the 4096 a regex sees.
    assert got == {"group secret": [600], "group name": [400, 400], "admin secret": [400, 400, 600],
                   "admin tail": [700]}


# ---- 7: who sees what ----

def secret_backend(monkeypatch) -> tuple[FakeAgent, int]:
    monkeypatch.setitem(TITLES, 200, SECRET_TITLE)
    from test_cli_leaks_top import leaky_backend

    backend = leaky_backend()
    stack_id = backend.stacks.intern(Stack((Frame("forward", "/app/model.py", 42),)))
    return backend, stack_id


def assert_redacted_allocation(message):
    allocation = message.allocation
    assert (allocation.address, allocation.handle, allocation.stream, allocation.caller_address,
            allocation.stack_id) == (0, 0, 0, 0, 0)


def test_group_socket_streams_redacted_events_without_stacks(monkeypatch):
    backend, stack_id = secret_backend(monkeypatch)
    with served(backend) as (server, backend):
        group = group_stub(server).StreamEvents(service_pb2.StreamEventsRequest(pids=[200]), timeout=10)
        admin = admin_stub(server).StreamEvents(service_pb2.StreamEventsRequest(pids=[200]), timeout=10)
        wait_for(lambda: backend.hub.subscriber_count() == 2)
        backend.apply(event(address=0x7F00AA, stack_id=stack_id, stack_status=StackStatus.OK,
                            caller_address=0x401234, stream=7),
                      event(kind=Kind.SET_DEVICE, api=Api.cudaSetDevice, address=0xC0FFEE, caller_address=0x401),
                      event(api=Api.cuMemMap, address=0x7F00BB, handle=0x99, layer=Layer.VMM))
        redacted, full = first_events(group, 2), first_events(admin, 2)
    assert {view for view, _ in redacted} == {service_pb2.VIEW_REDACTED}
    assert [m.WhichOneof("payload") for _, m in redacted] == ["allocation", "device_change", "allocation"]
    for _, message in redacted:
        assert message.title == REDACTED_TITLE and SECRET not in str(message)
        if message.HasField("allocation"):
            assert_redacted_allocation(message)
        else:
            assert (message.device_change.context, message.device_change.caller_address) == (0, 0)
    assert {view for view, _ in full} == {service_pb2.VIEW_FULL}
    assert [m.WhichOneof("payload") for _, m in full][:2] == ["stack_definition", "allocation"]
    assert full[1][1].title == SECRET_TITLE and full[1][1].allocation.address == 0x7F00AA


def test_group_socket_snapshot_is_redacted_and_its_page_tokens_hide_addresses(monkeypatch):
    backend, _ = secret_backend(monkeypatch)
    with served(backend) as (server, _):
        group, admin = group_stub(server), admin_stub(server)
        pages, request = [], service_pb2.GetSnapshotRequest(pids=[200], page_size=50)
        while True:
            page = group.GetSnapshot(request, timeout=10)
            pages.append(page)
            if not page.next_page_token:
                break
            request.page_token = page.next_page_token
        full = list(admin.GetSnapshot(service_pb2.GetSnapshotRequest(pids=[200], page_size=10000),
                                      timeout=10).allocations)
    redacted = [allocation for page in pages for allocation in page.allocations]
    assert len(pages) > 1 and len(redacted) == len(full) > 100
    assert {page.view for page in pages} == {service_pb2.VIEW_REDACTED} and not any(p.stacks for p in pages)
    for allocation in redacted:
        assert allocation.title == REDACTED_TITLE
        assert (allocation.address, allocation.caller_address, allocation.stack_id, allocation.handle,
                allocation.stream) == (0, 0, 0, 0, 0)
    assert sorted(a.size_bytes for a in redacted) == sorted(a.size_bytes for a in full)
    for page in pages[:-1]:  # a token names a listing and a page, nothing of the ledger
        cursor, _, number = page.next_page_token.partition(".")
        assert len(cursor) == 16 and number.isdigit()
    # a listing of the admin socket is no listing of the group socket's (each socket keeps its own)
    with served(backend) as (server, _):
        group, admin = group_stub(server), admin_stub(server)
        admin_page = admin.GetSnapshot(service_pb2.GetSnapshotRequest(pids=[200], page_size=50), timeout=10)
        assert admin_page.next_page_token
        with pytest.raises(grpc.RpcError) as refused:
            group.GetSnapshot(service_pb2.GetSnapshotRequest(pids=[200], page_size=50,
                                                             page_token=admin_page.next_page_token), timeout=10)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_group_socket_snapshot_in_columns_is_redacted_as_its_messages(monkeypatch):
    backend, _ = secret_backend(monkeypatch)
    with served(backend) as (server, _):
        request = service_pb2.GetSnapshotRequest(pids=[200], page_size=10000,
                                                 encoding=service_pb2.SNAPSHOT_ENCODING_COLUMNS)
        page, full = group_stub(server).GetSnapshot(request, timeout=10), admin_stub(server).GetSnapshot(request,
                                                                                                          timeout=10)
    columns = page.columns
    assert page.view == service_pb2.VIEW_REDACTED and not page.stacks and not page.allocations
    assert len(columns.pid) == len(full.columns.pid) > 100 and any(full.columns.address)
    assert not (columns.address or columns.caller_address or columns.stack_id or columns.handle or columns.stream)
    assert [label.title for label in columns.processes] == [REDACTED_TITLE]
    assert sorted(columns.size_bytes) == sorted(full.columns.size_bytes)


def test_group_socket_processes_suspects_growth_and_info_are_redacted(monkeypatch):
    backend, _ = secret_backend(monkeypatch)
    with served(backend) as (server, _):
        group, admin = group_stub(server), admin_stub(server)
        answers = {name: (getattr(group, name)(request, timeout=10), getattr(admin, name)(request, timeout=10))
                   for name, request in (("ListProcesses", service_pb2.ListProcessesRequest()),
                                         ("ListLeakSuspects", service_pb2.ListLeakSuspectsRequest()),
                                         ("GetGrowth", service_pb2.GetGrowthRequest()),
                                         ("GetAgentInfo", service_pb2.GetAgentInfoRequest()))}
    for name, (redacted, full) in answers.items():
        assert redacted.view == service_pb2.VIEW_REDACTED and full.view == service_pb2.VIEW_FULL, name
        assert SECRET not in str(redacted), name
    processes, _ = answers["ListProcesses"]
    assert [p.title for p in processes.processes if p.pid == 200] == [REDACTED_TITLE]
    suspects, full_suspects = answers["ListLeakSuspects"]
    assert len(suspects.suspects) == len(full_suspects.suspects) > 0
    assert any(s.HasField("stack") for s in full_suspects.suspects)
    for suspect in suspects.suspects:
        assert not suspect.HasField("stack") and not suspect.HasField("native_caller")
        assert (suspect.stack_id, suspect.caller_address) == (0, 0)
    growth, _ = answers["GetGrowth"]
    assert [row.title for row in growth.processes if row.pid == 200] == [REDACTED_TITLE]


def test_sockets_modes_and_the_client_takes_the_admin_socket_when_it_may(monkeypatch):
    backend, _ = secret_backend(monkeypatch)
    with served(backend) as (server, _):
        assert stat.S_IMODE(os.stat(server.config.socket).st_mode) == 0o660
        assert stat.S_IMODE(os.stat(server.config.admin_path).st_mode) == 0o600
        assert os.stat(server.config.admin_path).st_uid == os.getuid()
        with AgentClient.for_socket(server.config.socket) as client:
            assert client.target == f"unix://{server.config.admin_path}"
            assert client.processes() and not client.redacted
        told = []
        with AgentClient(f"unix://{server.config.socket}") as client:
            client.on_redacted = lambda: told.append(True)
            assert [p.title for p in client.processes() if p.pid == 200] == [REDACTED_TITLE]
            client.processes()
            assert client.redacted and told == [True]  # said once


def test_admin_socket_off_serves_only_the_redacted_socket():
    with served(admin_socket="off") as (server, _):
        assert server.config.admin_path is None
        with AgentClient.for_socket(server.config.socket) as client:
            assert client.info().view == service_pb2.VIEW_REDACTED
        assert sorted(p.name for p in server.config.socket.parent.iterdir()) == ["kvtrace.sock"]


# ---- 8: streams that never read cost nothing, and cannot lock readers out ----

def never_reading_streams(server, count):
    """`count` streams whose client never reads; a small flow-control window (no BDP probing)
    makes them back up into the agent within a few hundred events. A connection each (a local subchannel
    pool): the group socket carries at most ServerLimits.max_streams_per_connection streams a connection."""
    channels, calls = [], []
    for _ in range(count):
        channel = grpc.insecure_channel(f"unix:{server.config.socket}", [("grpc.http2.bdp_probe", 0),
                                                                         ("grpc.use_local_subchannel_pool", 1)])
        channels.append(channel)
        calls.append(service_grpc.AgentServiceStub(channel).StreamEvents(service_pb2.StreamEventsRequest(),
                                                                          timeout=60))
    return channels, calls


def fill_until_stalled(backend, count):
    """Publishes until `count` streams are blocked in gRPC (their client's window is full) and
    parked in the hub (their queue is full): a stream parks long before its window is full, so
    this takes a few rounds of publishing and letting the stream threads send."""
    deadline = time.monotonic() + 60
    address = 1 << 40
    while True:
        for _ in range(500):
            backend.hub.publish(event(address=address))
            address += 1
        time.sleep(0.2)
        if backend.hub.parked_count() == count:
            time.sleep(0.5)
            if backend.hub.parked_count() == count:
                return
        assert time.monotonic() < deadline, f"{backend.hub.parked_count()} of {count} streams stalled"


def publish_to_a_reader(server, backend, first_address, count, path=None):
    """Publishes `count` events at the pace one reading client keeps up with (on the admin socket, or `path`);
    returns what it got and the agent's CPU seconds (this process: server, hub and the publishing)."""
    got, lost = [], [0]
    responses = AgentClient(f"unix://{path or server.config.admin_path}").stream_batches(pids=[200])

    def read():
        for batch in responses:
            for message in batch:
                if message.HasField("events_lost"):
                    lost[0] += message.events_lost.dropped_count
                elif message.HasField("allocation"):
                    got.append(message.allocation.address)
            if len(got) + lost[0] >= count:
                return

    def reading():  # the other subscribers are parked: they never read
        return backend.hub.subscriber_count() - backend.hub.parked_count()

    reader = threading.Thread(target=read)
    reader.start()
    wait_for(lambda: reading() == 1)
    cpu = time.process_time()
    for i in range(count):
        backend.hub.publish(event(address=first_address + i))
        if i % 200 == 199:
            wait_for(lambda i=i: len(got) + lost[0] >= i - 100)
    reader.join(30)
    cpu = time.process_time() - cpu
    responses.close()
    wait_for(lambda: reading() == 0)
    return got, lost[0], cpu


def test_streams_that_never_read_cost_no_work_and_a_reader_still_gets_every_event():
    events = 20_000
    limits = ServerLimits(max_streams=80)
    with served(limits=limits, max_queued_events=256) as (server, backend):
        got, lost, idle_cpu = publish_to_a_reader(server, backend, 0, events)
        assert got == list(range(events)) and lost == 0
        channels, calls = never_reading_streams(server, 72)
        wait_for(lambda: backend.hub.subscriber_count() == 72)
        fill_until_stalled(backend, 72)
        got, lost, stalled_cpu = publish_to_a_reader(server, backend, events, events)
        print(f"\nagent CPU for {events} events with one reader: {idle_cpu:.2f} s; with 72 streams "
              f"that never read as well: {stalled_cpu:.2f} s")
        assert got == list(range(events, 2 * events)) and lost == 0
        assert stalled_cpu < 1.5 * idle_cpu + 0.5
        for channel in channels:
            channel.close()


def test_when_every_slot_is_taken_the_longest_stalled_stream_makes_room():
    limits = ServerLimits(max_streams=4, evict_stalled_seconds=0.5)
    with served(limits=limits, max_queued_events=64) as (server, backend):
        channels, calls = never_reading_streams(server, 4)
        wait_for(lambda: backend.hub.subscriber_count() == 4)
        fill_until_stalled(backend, 4)
        got, lost, _ = publish_to_a_reader(server, backend, 10_000, 50, path=server.config.socket)
        assert len(got) == 50 and lost == 0  # the group's view: addresses redacted
        # Only now do the stalled clients read: what was sent to them, then how their stream ended.
        ended = []

        def read_to_the_end(call):
            try:
                for _ in call:
                    pass
            except grpc.RpcError as error:
                ended.append((error.code(), error.details()))

        readers = [threading.Thread(target=read_to_the_end, args=(call,)) for call in calls]
        for reader in readers:
            reader.start()
        wait_for(lambda: ended)
        for channel in channels:  # the other three are still served: end them here
            channel.close()
        for reader in readers:
            reader.join(10)
        exhausted = [details for code, details in ended if code is grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert len(exhausted) == 1 and "you did not read for" in exhausted[0]
        assert server.group_slots.evicted_total == 1 and server.slots.evicted_total == 0


def test_streams_that_read_are_never_evicted():
    limits = ServerLimits(max_streams=2, evict_stalled_seconds=0.2)
    with served(limits=limits) as (server, backend):
        agent = group_stub(server)
        first = agent.StreamEvents(service_pb2.StreamEventsRequest(), timeout=10)
        second = agent.StreamEvents(service_pb2.StreamEventsRequest(), timeout=10)
        wait_for(lambda: backend.hub.subscriber_count() == 2)
        time.sleep(0.5)  # idle, waiting for events: not stalled
        with pytest.raises(grpc.RpcError) as refused:
            next(agent.StreamEvents(service_pb2.StreamEventsRequest(), timeout=10))
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert server.group_slots.evicted_total == 0 and server.group_slots.refused_total == 1
        first.cancel()
        second.cancel()


def test_a_parked_subscriber_is_told_its_gap_exactly():
    backend = FakeAgent()
    with served(backend, max_queued_events=8) as (server, backend):
        subscription = backend.hub.subscribe()
        for i in range(30):
            backend.hub.publish(event(address=i, size=MiB))
        assert backend.hub.parked_count() == 1
        items = subscription.read(100, 0)
        assert len(items) == 8
        gap = subscription.read(100, 0)
        assert [(lost.dropped_count, lost.kernel_lost_count) for lost in gap] == [(22, 0)]
        backend.hub.publish(event(address=99))
        assert [item.address for item in subscription.read(100, 0)] == [99]
        backend.hub.unsubscribe(subscription)


def test_group_socket_info_names_no_paths_or_pids():
    info = service_pb2.GetAgentInfoResponse(
        attached_libraries=[service_pb2.AttachedLibrary(path="/proc/4242/root/home/alice/venv/libcudart.so.12",
                                                        symbols=["cudaMalloc"], pids=[4242])],
        components=[service_pb2.ComponentHealth(name="bpf", up=True),
                    service_pb2.ComponentHealth(name="attach:/home/bob/x/libcudart.so.12", up=False,
                                                reason="attaching failed: /home/bob/x/libcudart.so.12"),
                    service_pb2.ComponentHealth(name="libraries", up=False,
                                                reason="3 libraries wait for probes: e.g. /home/carol/libcudart.so")])
    redacted = str(redact_info(info))
    for private in ("/home", "/proc/4242", "4242", "alice", "bob", "carol"):
        assert private not in redacted, private
    assert "libcudart.so.12" in redacted and 'name: "attach"' in redacted and 'name: "libraries"' in redacted
