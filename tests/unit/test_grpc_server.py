"""The kvtrace.v1 server over a fake backend on a temporary Unix socket: streams with every filter,
in-band loss, validation, limits, snapshot pages, health, reflection, socket safety and mTLS."""
import os
import platform
import socket
import stat
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from fake_agent import (
    ALL_KINDS,
    STREAM_FILTER_CASES,
    FakeAgent,
    MiB,
    event,
    own_group,
    served,
    short_directory,
    stream_filter_events,
)
from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import agent_service_pb2_grpc as service_grpc
from kvtrace._proto.kvtrace.v1 import events_pb2
from kvtrace.client import AgentClient
from kvtrace.config import ApiConfig
from kvtrace.errors import CommandError, ExitCode
from kvtrace.model.events import Api, Kind, Layer, Memory, ObjectKind, StackStatus
from kvtrace.model.stacks import Frame, Stack
from kvtrace.servers.api.listeners import ServerSetupError
from kvtrace.servers.api.requests import ServerLimits
from kvtrace.servers.api.server import SERVICE_NAME, AgentServer
from kvtrace.wire import event_from_proto, event_to_json, event_to_proto, message_to_json, stack_from_proto

FAST_HEALTH = ServerLimits(health_poll_seconds=0.05)


def stub(server) -> service_grpc.AgentServiceStub:
    """On the admin socket: full detail (tests/unit/test_api_safety.py has the redacted view)."""
    channel = grpc.insecure_channel(f"unix:{server.config.admin_path}")
    return service_grpc.AgentServiceStub(channel)


def wait_for(condition, timeout_seconds=5.0):
    deadline = time.monotonic() + timeout_seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def collect(responses, count):
    """Reads responses until `count` events (not loss reports or stacks) came; returns all messages."""
    messages = []
    for response in responses:
        messages.extend(response.events)
        if sum(1 for m in messages if m.WhichOneof("payload") not in ("events_lost", "stack_definition")) >= count:
            return messages
    return messages


# ---- the wire format mirrors the model ----

def proto_name(name: str) -> str:
    """cuMemAlloc_v2 -> CU_MEM_ALLOC_V2, the buf-style name of a model enum member."""
    out = ""
    for index, char in enumerate(name):
        if char.isupper() and index and name[index - 1].islower():
            out += "_"
        out += char.upper()
    return out


@pytest.mark.parametrize("model, wire, prefix", [
    (Api, events_pb2.Api, "API_"), (Kind, events_pb2.EventKind, "EVENT_KIND_"),
    (Layer, events_pb2.Layer, "LAYER_"), (ObjectKind, events_pb2.ObjectKind, "OBJECT_KIND_"),
    (Memory, events_pb2.Memory, "MEMORY_"), (StackStatus, events_pb2.StackStatus, "STACK_STATUS_")])
def test_wire_enums_have_the_model_numbers(model, wire, prefix):
    # A model member numbered 0 (StackStatus.NOT_WALKED) is the wire's UNSPECIFIED.
    assert {prefix + proto_name(m.name): m.value for m in model if m.value != 0} == \
        {name: number for name, number in wire.items() if number != 0}


@pytest.mark.parametrize("model_event", ALL_KINDS, ids=lambda e: f"{e.kind.name}-{e.api.name}")
def test_every_kind_survives_the_wire(model_event):
    message = events_pb2.Event.FromString(event_to_proto(model_event).SerializeToString())
    assert event_from_proto(message) == model_event
    assert message_to_json(message) == event_to_json(model_event)


def test_events_from_a_newer_agent_are_skipped_not_fatal():
    message = event_to_proto(event())
    message.allocation.api = 99
    assert event_from_proto(message) is None


# ---- streaming ----

@pytest.mark.parametrize("request_fields, wanted", STREAM_FILTER_CASES)
def test_stream_filters(request_fields, wanted):
    events = stream_filter_events()
    with served() as (server, backend):
        responses = stub(server).StreamEvents(service_pb2.StreamEventsRequest(**request_fields), timeout=10)
        wait_for(lambda: backend.hub.subscriber_count() == 1)
        backend.apply(*events)
        got = [event_from_proto(m) for m in collect(responses, len(wanted))]
        responses.cancel()
    assert got == [events[i] for i in wanted]


def test_stream_sends_each_stack_once_before_its_first_use():
    backend = FakeAgent()
    stack = Stack((Frame("forward", "model.py", 42), Frame("<module>", "serve.py", 7)))
    stack_id = backend.stacks.intern(stack)
    with served(backend) as (server, backend):
        responses = stub(server).StreamEvents(service_pb2.StreamEventsRequest(), timeout=10)
        wait_for(lambda: backend.hub.subscriber_count() == 1)
        backend.apply(event(address=1, stack_id=stack_id, stack_status=StackStatus.OK),
                      event(address=2, stack_id=stack_id, stack_status=StackStatus.OK))
        messages = collect(responses, 2)
        responses.cancel()
    assert [m.WhichOneof("payload") for m in messages] == ["stack_definition", "allocation", "allocation"]
    assert stack_from_proto(messages[0].stack_definition) == (stack_id, stack)
    assert messages[2].allocation.stack_id == stack_id


def test_slow_stream_loses_only_its_own_events_and_is_told_exactly():
    published = 20_000
    with served(max_queued_events=4096) as (server, backend):
        fast = AgentClient.for_socket(server.config.socket)
        fast_got = []
        fast_batches = fast.stream_batches()
        # Without BDP probing gRPC's flow-control window stays small, so the unread stream backs up
        # into its hub queue within a few thousand events instead of megabytes.
        slow = grpc.insecure_channel(f"unix:{server.config.socket}", [("grpc.http2.bdp_probe", 0)])
        slow_responses = service_grpc.AgentServiceStub(slow).StreamEvents(service_pb2.StreamEventsRequest())

        def read_fast():
            for batch in fast_batches:
                fast_got.extend(batch)
                if len(fast_got) >= published:
                    return

        reader = threading.Thread(target=read_fast)
        reader.start()
        wait_for(lambda: backend.hub.subscriber_count() == 2)
        for i in range(published):
            backend.hub.publish(event(address=i))
            if i % 500 == 0:  # the fast reader keeps up within its queue; the slow one reads nothing
                wait_for(lambda i=i: len(fast_got) >= i - 1000)
        reader.join(30)
        # Only now does the slow one read: what gRPC buffered, then its queue, then the gap.
        received, dropped = 0, 0
        for response in slow_responses:
            for message in response.events:
                if message.HasField("events_lost"):
                    dropped += message.events_lost.dropped_count
                else:
                    received += 1
            if received + dropped >= published:
                break
        fast.close()
        slow.close()
    assert [m.allocation.address for m in fast_got] == list(range(published))
    assert not any(m.HasField("events_lost") for m in fast_got)
    assert dropped > 0
    assert received + dropped == published


def test_kernel_losses_are_reported_in_band():
    with served() as (server, backend):
        responses = stub(server).StreamEvents(service_pb2.StreamEventsRequest(), timeout=10)
        wait_for(lambda: backend.hub.subscriber_count() == 1)
        backend.apply(event(address=1))
        backend.lose(23)
        backend.apply(event(address=2))
        messages = collect(responses, 2)
        responses.cancel()
    assert [m.WhichOneof("payload") for m in messages] == ["allocation", "events_lost", "allocation"]
    assert messages[1].events_lost.kernel_lost_count == 23 and messages[1].events_lost.dropped_count == 0


def test_stream_limit_gives_resource_exhausted_and_frees_its_slot():
    with served(limits=ServerLimits(max_streams=2)) as (server, backend):
        agent = stub(server)
        first = agent.StreamEvents(service_pb2.StreamEventsRequest(), timeout=10)
        second = agent.StreamEvents(service_pb2.StreamEventsRequest(), timeout=10)
        wait_for(lambda: backend.hub.subscriber_count() == 2)
        with pytest.raises(grpc.RpcError) as refused:
            next(agent.StreamEvents(service_pb2.StreamEventsRequest(), timeout=10))
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        first.cancel()
        wait_for(lambda: backend.hub.subscriber_count() == 1)
        third = agent.StreamEvents(service_pb2.StreamEventsRequest(), timeout=10)
        wait_for(lambda: backend.hub.subscriber_count() == 2)
        second.cancel()
        third.cancel()


def test_stream_deadline_is_honoured_and_unsubscribes():
    with served() as (server, backend):
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as expired:
            list(stub(server).StreamEvents(service_pb2.StreamEventsRequest(), timeout=0.3))
        assert expired.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 3
        wait_for(lambda: backend.hub.subscriber_count() == 0)


def test_stop_ends_streams_with_unavailable_and_removes_the_socket():
    with served() as (server, backend):
        client = AgentClient.for_socket(server.config.socket)
        batches = client.stream_batches()
        errors = []

        def read():
            try:
                for _ in batches:
                    pass
            except CommandError as error:
                errors.append(error)

        reader = threading.Thread(target=read)
        reader.start()
        wait_for(lambda: backend.hub.subscriber_count() == 1)
        started = time.monotonic()
        server.stop(grace_seconds=5)
        reader.join(10)
        assert time.monotonic() - started < 3
        assert not server.config.socket.exists()
        client.close()
    assert errors and errors[0].exit_code == ExitCode.AGENT_UNREACHABLE
    assert "stopped" in str(errors[0])


# ---- bad requests ----

@pytest.mark.parametrize("request_fields, field", [
    ({"title_regex": "(unclosed"}, "title_regex"),
    ({"title_regex": "x" * 1025}, "title_regex"),
    ({"kinds": [99]}, "kinds[0]"),
    ({"kinds": [events_pb2.EVENT_KIND_ALLOC, events_pb2.EVENT_KIND_UNSPECIFIED]}, "kinds[1]"),
    ({"layers": [7]}, "layers[0]"),
    ({"min_size_bytes": (1 << 64) - 1}, "min_size_bytes"),  # -1 from a signed client
    ({"min_size_bytes": 2 << 50}, "min_size_bytes"),  # 2 PiB
    ({"pids": list(range(1025))}, "pids"),
])
def test_bad_stream_requests_name_the_field_and_the_server_keeps_serving(request_fields, field):
    with served() as (server, backend):
        agent = stub(server)
        with pytest.raises(grpc.RpcError) as refused:
            next(agent.StreamEvents(service_pb2.StreamEventsRequest(**request_fields), timeout=5))
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith(f"{field}: ")
        assert agent.GetAgentInfo(service_pb2.GetAgentInfoRequest(), timeout=5).version == "0.1.0"
        assert backend.hub.subscriber_count() == 0


@pytest.mark.parametrize("request_fields, field", [
    ({"page_size": 10001}, "page_size"),
    ({"page_size": -1}, "page_size"),
    ({"page_token": "not a token"}, "page_token"),
    ({"page_token": "0123456789abcdef.1"}, "page_token"),  # the shape of a token, of no open listing
    ({"page_token": "x" * 300}, "page_token"),
    ({"layers": [0]}, "layers[0]"),
    ({"pids": list(range(2000))}, "pids"),
])
def test_bad_snapshot_requests_name_the_field(request_fields, field):
    with served() as (server, _):
        agent = stub(server)
        with pytest.raises(grpc.RpcError) as refused:
            agent.GetSnapshot(service_pb2.GetSnapshotRequest(**request_fields), timeout=5)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith(f"{field}: ")
        assert agent.GetSnapshot(service_pb2.GetSnapshotRequest(), timeout=5).next_page_token == ""


def test_oversized_request_is_refused_and_the_server_keeps_serving():
    with served() as (server, _):
        agent = stub(server)
        with pytest.raises(grpc.RpcError) as refused:
            agent.GetSnapshot(service_pb2.GetSnapshotRequest(page_token="x" * (5 << 20)), timeout=5)
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert agent.GetAgentInfo(service_pb2.GetAgentInfoRequest(), timeout=5).version == "0.1.0"


# ---- snapshot, processes, info ----

def test_snapshot_pages_list_every_object_once_in_one_pass():
    backend = FakeAgent()
    for i in range(23):
        backend.apply(event(pid=(100, 200, 300)[i % 3], address=0x1000 * (23 - i), size=MiB + i))
    passes = []
    outstanding = backend.session.outstanding

    def counted(pids=()):
        passes.append(pids)
        return outstanding(pids)

    backend.session.outstanding = counted
    with served(backend) as (server, backend):
        agent = stub(server)
        pages, token = [], ""
        while True:
            response = agent.GetSnapshot(service_pb2.GetSnapshotRequest(page_size=5, page_token=token), timeout=5)
            pages.append(list(response.allocations))
            if token:  # the same token again (a client's retry) gets the same page
                again = agent.GetSnapshot(service_pb2.GetSnapshotRequest(page_size=5, page_token=token), timeout=5)
                assert list(again.allocations) == pages[-1] and again.next_page_token == response.next_page_token
            token = response.next_page_token
            if not token:
                break
            # Freed between pages: must not disturb what follows.
            backend.apply(event(kind=Kind.FREE, api=Api.cuMemFree_v2, pid=pages[-1][0].pid,
                                address=pages[-1][0].address))
        with pytest.raises(grpc.RpcError) as closed:  # the last page closed the listing
            agent.GetSnapshot(service_pb2.GetSnapshotRequest(page_size=5, page_token=token or "0" * 16 + ".5"),
                              timeout=5)
        assert closed.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "list again from the first page" in closed.value.details()
    assert [len(page) for page in pages] == [5, 5, 5, 5, 3]
    listed = [(a.pid, a.address) for page in pages for a in page]
    assert len(set(listed)) == 23 and len(passes) == 1  # every object once, from one pass
    first = pages[0][0]
    assert (first.title, first.comm, first.api_name, first.layer, first.device) == \
        ("VLLM::EngineCore", "VLLM::EngineCor", "cuMemAlloc_v2", events_pb2.LAYER_DRIVER, 0)


def test_snapshot_filters_by_pid_and_layer_with_attribution():
    backend = FakeAgent()
    backend.apply(event(pid=100, address=1), event(pid=300, address=2),
                  event(pid=300, address=3, api=Api.cudaMalloc, layer=Layer.RUNTIME))
    with served(backend) as (server, _):
        with AgentClient.for_socket(server.config.socket) as client:
            by_pid = list(client.snapshot(pids=[300]))
            runtime = list(client.snapshot(layers=[Layer.RUNTIME]))
    # The order the ledger is read in (no order is promised): sorted here.
    assert sorted((a.pid, a.address, a.container) for a in by_pid) == [(300, 2, "c0ffee"), (300, 3, "c0ffee")]
    assert [(a.pid, a.address) for a in runtime] == [(300, 3)]


def test_snapshot_in_columns_lists_what_the_messages_list():
    backend = FakeAgent()
    for i in range(23):
        backend.apply(event(pid=(100, 200, 300)[i % 3], address=0x1000 * (23 - i), size=MiB + i, device=i % 2))
    backend.apply(event(pid=300, address=7, api=Api.cudaMalloc, layer=Layer.RUNTIME))
    fields = ("pid", "tid", "layer", "object", "memory", "api", "size_bytes", "address", "device", "timestamp_ns",
              "caller_address", "stack_id", "mapped_count", "released", "handle", "stream", "sample_bytes", "sampled")
    with served(backend) as (server, _):
        with AgentClient.for_socket(server.config.socket) as client:
            rows = list(client.snapshot(pids=[100, 300], page_size=4))
            pages = list(client.snapshot_columns(pids=[100, 300], page_size=4))
            raw = next(client.snapshot_pages(pids=[300], page_size=100,
                                             encoding=service_pb2.SNAPSHOT_ENCODING_COLUMNS))
    assert len(pages) == 4 and not raw.allocations and len(raw.columns.pid) == 8  # in columns, not messages
    listed = sorted(row for columns, _ in pages for row in zip(*(getattr(columns, name) for name in fields),
                                                                strict=True))
    assert listed == sorted(tuple(getattr(row, name) for name in fields) for row in rows) and len(listed) == 16
    labels = {pid: label for columns, _ in pages for pid, label in columns.labels.items()}
    assert labels == {row.pid: (row.comm, row.title, row.container) for row in rows}


def test_a_listing_may_change_encoding_between_pages():
    """A listing begun in columns (whose pass reads rows) or in messages (entries) answers its next pages in
    whichever encoding each asks for: every entry once, the same as one listing in messages."""
    backend = FakeAgent()
    for i in range(23):
        backend.apply(event(pid=(100, 200)[i % 2], address=0x1000 * (i + 1), size=MiB + i, device=i % 2))
    columns_encoding, messages = service_pb2.SNAPSHOT_ENCODING_COLUMNS, service_pb2.SNAPSHOT_ENCODING_MESSAGES
    with served(backend) as (server, _):
        with AgentClient.for_socket(server.config.socket) as client:
            whole = sorted((a.pid, a.address, a.size_bytes, a.device, a.comm) for a in client.snapshot())
        agent = stub(server)
        for first, then in [(columns_encoding, messages), (messages, columns_encoding)]:
            listed, token, encoding = [], "", first
            while True:
                page = agent.GetSnapshot(service_pb2.GetSnapshotRequest(page_size=5, page_token=token,
                                                                       encoding=encoding), timeout=5)
                labels = {label.pid: label.comm for label in page.columns.processes}
                listed += [(a.pid, a.address, a.size_bytes, a.device, a.comm) for a in page.allocations]
                listed += [(pid, address, size, device, labels[pid]) for pid, address, size, device in zip(
                    page.columns.pid, page.columns.address, page.columns.size_bytes,
                    page.columns.device or [0] * len(page.columns.pid), strict=True)]
                token, encoding = page.next_page_token, then
                if not token:
                    break
            assert sorted(listed) == whole and len(whole) == 23, (first, then)


def test_list_processes_and_agent_info():
    backend = FakeAgent()
    backend.apply(event(pid=200, address=1, size=MiB, device=0), event(pid=200, address=2, size=MiB, device=1),
                  event(pid=100, address=3, size=3 * MiB))
    with served(backend) as (server, _):
        with AgentClient.for_socket(server.config.socket) as client:
            processes = client.processes()
            info = client.info()
    assert [p.pid for p in processes] == [100, 200]
    assert sorted((t.device, t.size_bytes, t.object_count) for t in processes[1].totals) == \
        [(0, MiB, 1), (1, MiB, 1)]
    assert processes[1].title == "VLLM::Worker_TP0"
    assert info.kernel_release == platform.release() and dict(info.counters)["events_seen"] == 3
    assert [(lib.path, list(lib.pids)) for lib in info.attached_libraries] == [("/usr/lib/libcuda.so.1", [100, 200])]
    assert [(c.name, c.up, c.reason) for c in info.components] == [("bpf", True, "")]


# ---- health and reflection ----

def test_health_follows_the_backend():
    with served(limits=FAST_HEALTH) as (server, backend):
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"unix:{server.config.socket}"))

        def status():
            return health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status

        assert status() == health_pb2.HealthCheckResponse.SERVING
        backend.stall()
        wait_for(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING)
        backend.session.report_component("bpf", True)
        wait_for(lambda: status() == health_pb2.HealthCheckResponse.SERVING)


def test_reflection_lists_the_services_on_the_socket():
    with served() as (server, _):
        reflection = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(f"unix:{server.config.socket}"))
        responses = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {service.name for service in next(responses).list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names


# ---- the socket: permissions and fail-closed start ----

def test_socket_is_0660_with_the_group_in_a_0750_directory():
    with served() as (server, _):
        path = server.config.socket
        info = os.stat(path)
        assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o660
        assert info.st_gid == os.getgid()
        assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o750


def start_at(path, **config):
    agent = FakeAgent()
    server = AgentServer(agent.session, agent.analyzer, ApiConfig(socket=path, group=own_group(), **config))
    server.start()
    return server


@pytest.mark.parametrize("make", [
    lambda path: path.write_text("not a socket"),
    lambda path: path.mkdir(),
    lambda path: path.symlink_to("/etc/passwd"),
], ids=["file", "directory", "symlink"])
def test_refuses_a_path_that_is_not_a_socket_and_leaves_it(make):
    with short_directory() as directory:
        path = directory / "kvtrace.sock"
        make(path)
        before = os.lstat(path)
        with pytest.raises(ServerSetupError, match="exists and is not a socket"):
            start_at(path)
        assert os.lstat(path) == before


def test_removes_a_stale_socket_but_refuses_a_live_one():
    with short_directory() as directory:
        path = directory / "kvtrace.sock"
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(str(path))
        stale.close()  # the file stays, nobody listens
        server = start_at(path)
        try:
            with pytest.raises(ServerSetupError, match="already serving"):
                start_at(path)
            assert AgentClient.for_socket(path).info().version == "0.1.0"
        finally:
            server.stop(0)


def test_leaves_the_mode_of_an_existing_directory_alone():
    with short_directory() as directory:
        directory.chmod(0o755)
        server = start_at(directory / "kvtrace.sock")
        server.stop(0)
        assert stat.S_IMODE(directory.stat().st_mode) == 0o755


def test_refuses_a_socket_path_too_long_for_unix_sockets():
    with short_directory() as directory:
        with pytest.raises(ServerSetupError, match="longer than 107 bytes"):
            start_at(directory / ("x" * 120))


def test_missing_group_falls_back_to_roots_group(caplog):
    with short_directory() as directory:
        path = directory / "kvtrace.sock"
        agent = FakeAgent()
        server = AgentServer(agent.session, agent.analyzer, ApiConfig(socket=path, group="kvtrace-no-such-group"))
        if os.geteuid() != 0:  # giving a file root's group needs root: fail closed
            with pytest.raises(ServerSetupError, match="group 0 and mode 0660"):
                server.start()
            assert not path.exists()
            return
        server.start()
        server.stop(0)
    assert "does not exist" in caplog.text and "groupadd" in caplog.text


# ---- TCP: mutual TLS only ----

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for localhost, a client of that CA and a client of another CA."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory = tmp_path_factory.mktemp("pki")
    now = datetime.datetime.now(datetime.timezone.utc)

    def write(name, key, cert):
        (directory / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        (directory / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def certificate(name, issuer=None, ca=False, server=False):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        issuer_key, issuer_cert = issuer or (key, None)
        builder = (x509.CertificateBuilder().subject_name(subject)
                   .issuer_name(issuer_cert.subject if issuer_cert else subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        cert = builder.sign(issuer_key, hashes.SHA256())
        write(name, key, cert)
        return key, cert

    ca = certificate("kvtrace test CA", ca=True)
    other_ca = certificate("someone else's CA", ca=True)
    certificate("server", issuer=ca, server=True)
    certificate("client", issuer=ca)
    certificate("stranger", issuer=other_ca)
    return directory


@pytest.fixture
def tls_server(pki):
    with served(tcp_listen="127.0.0.1:0", tls_cert=pki / "server.crt", tls_key=pki / "server.key",
                tls_client_ca=pki / "kvtrace test CA.crt") as (server, backend):
        yield server


def tls_channel(pki, server, client=None):
    root = (pki / "kvtrace test CA.crt").read_bytes()
    if client is None:
        credentials = grpc.ssl_channel_credentials(root_certificates=root)
    else:
        credentials = grpc.ssl_channel_credentials(root_certificates=root,
                                                   private_key=(pki / f"{client}.key").read_bytes(),
                                                   certificate_chain=(pki / f"{client}.crt").read_bytes())
    return grpc.secure_channel(f"localhost:{server.tcp_port}", credentials)


def info_over(channel):
    return service_grpc.AgentServiceStub(channel).GetAgentInfo(service_pb2.GetAgentInfoRequest(), timeout=5)


def test_mtls_client_of_the_ca_is_served_without_reflection(pki, tls_server):
    from kvtrace.client import ClientTls

    tls = ClientTls(pki / "client.crt", pki / "client.key", pki / "kvtrace test CA.crt", "localhost")
    with AgentClient(f"127.0.0.1:{tls_server.tcp_port}", tls=tls) as client:
        assert client.info().version == "0.1.0"
    reflection = reflection_pb2_grpc.ServerReflectionStub(tls_channel(pki, tls_server, "client"))
    with pytest.raises(grpc.RpcError) as refused:
        next(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                             timeout=5))
    assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("client", [None, "stranger"], ids=["tls-without-client-cert", "cert-of-another-ca"])
def test_mtls_rejects_clients_without_a_certificate_of_the_ca(pki, tls_server, client):
    with pytest.raises(grpc.RpcError) as refused:
        info_over(tls_channel(pki, tls_server, client))
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


def test_mtls_rejects_plaintext(tls_server):
    with pytest.raises(grpc.RpcError) as refused:
        info_over(grpc.insecure_channel(f"127.0.0.1:{tls_server.tcp_port}"))
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


def test_client_refuses_tcp_without_tls():
    with pytest.raises(CommandError, match="mutual TLS only"):
        AgentClient("127.0.0.1:7443")


def test_tcp_with_unloadable_tls_files_does_not_start(pki):
    with short_directory() as directory:
        with pytest.raises(ServerSetupError, match="TLS files do not load"):
            start_at(directory / "kvtrace.sock", tcp_listen="127.0.0.1:0", tls_cert=pki / "client.crt",
                     tls_key=pki / "server.key", tls_client_ca=pki / "kvtrace test CA.crt")
        assert not (directory / "kvtrace.sock").exists()
