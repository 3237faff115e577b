"""Issue 31, attack 4: the vLLM plugin's socket under a flood of one user's processes and an impostor.

Shares per user (model/user_shares.py) in the listener: one user's senders take at most their share, a flood
is refused before decoding, counted and named; an engine's KV layout outlives its sender's place. Trust
(model/vllm.py's vllm_tie, analysis/vllm.py): reports count as an engine's only from a process the kernel ties
to vLLM; an impostor is kept apart, labelled (untrusted), and raises no finding."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from kvtrace.analysis.vllm import VllmAnalysis
from kvtrace.model.processes import ProcessInfo
from kvtrace.model.user_shares import MAX_NAMED_USERS, OTHER_USER, UserShares
from kvtrace.model.vllm import FindingKind, KvRequest, RequestState, SchedulerReport, VllmView, vllm_tie
from kvtrace.session import Session
from kvtrace.sources.vllm import listener as listener_module
from kvtrace.sources.vllm.listener import VllmListener

NS = 1_000_000_000
T0 = 1_700_000_000
GiB = 1 << 30
ALICE, BOB = 4242, 4343  # uids (not in the user database: named by number)


@pytest.fixture
def short_dir():
    directory = tempfile.mkdtemp(prefix="kvs", dir="/tmp")
    yield Path(directory)
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def sleepers():
    """Live processes to send from (the listener's sweep forgets pids that are gone)."""
    children = [subprocess.Popen(["sleep", "60"]) for _ in range(7)]
    yield [child.pid for child in children]
    for child in children:
        child.kill()
        child.wait()


def scheduler(running: int = 0) -> bytes:
    return json.dumps({"v": 1, "type": "scheduler", "blocks_total": 1000, "blocks_free": 990, "running": running,
                       "waiting": 0, "allocated_total": 30, "freed_total": 20, "requests": []}).encode()


def layout() -> bytes:
    return json.dumps({"v": 1, "type": "kv_cache", "device": 0, "tensors": [[1 << 40, 64 << 20]],
                       "num_blocks": 1001, "page_size_bytes": 65536, "block_size": 16}).encode()


# ---- shares ----


def test_a_user_at_its_share_is_refused_and_the_others_keep_their_places():
    shares = UserShares("vllm_senders", capacity=5, per_user=2, noun="senders")
    for uid in (ALICE, ALICE, BOB):
        assert shares.admits(uid)
        shares.take(uid)
    assert not shares.admits(ALICE) and shares.admits(BOB)
    assert shares.full_for(ALICE) == "user 4242 holds 2 senders, its share of 2"
    for _ in range(23):
        shares.refuse(ALICE)
    assert shares.counters() == {"share_refused/vllm_senders/4242": 23}
    assert shares.describe().startswith("23 refused for want of a share (4242 23); last: user 4242 (uid 4242)")
    shares.give_back(ALICE)
    assert shares.admits(ALICE) and shares.total == 2


def test_refused_users_beyond_the_named_ones_count_as_other():
    shares = UserShares("group_connections", capacity=64, per_user=1)
    for uid in range(10_000, 10_000 + MAX_NAMED_USERS + 5):
        shares.take(uid)  # at its share
        shares.refuse(uid)
    assert len(shares.counters()) == MAX_NAMED_USERS + 1
    assert shares.refused[OTHER_USER] == 5 and shares.refused_total == MAX_NAMED_USERS + 5


def test_a_flood_of_one_user_is_refused_before_decoding_and_named(short_dir, sleepers):
    """GIVEN 2 places a user of 8, WHEN 7 processes of one user report 23 times each and root's engine
    reports, THEN the user holds 2 places, the other 5 processes' 115 messages are refused (none decoded),
    root's engine has its place, and the component names the user."""
    session = Session()
    listener = VllmListener(session, str(short_dir / "vllm.sock"), max_senders=8, max_senders_per_user=2,
                            max_messages_per_second_per_pid=1000)
    decoded = []
    real_decode = listener_module.decode_message
    listener_module.decode_message = lambda *args: decoded.append(args[1]) or real_decode(*args)
    try:
        for _ in range(23):
            for pid in sleepers:
                listener.handle_datagram(scheduler(), pid, uid=ALICE)
        listener.handle_datagram(layout(), os.getpid(), uid=0)
        listener.handle_datagram(scheduler(), os.getpid(), uid=0)
    finally:
        listener_module.decode_message = real_decode
    view = session.vllm_view()
    assert set(view.schedulers) == {sleepers[0], sleepers[1], os.getpid()}
    assert set(decoded) == {sleepers[0], sleepers[1], os.getpid()} and len(decoded) == 2 * 23 + 2
    assert listener.rejected == 5 * 23 and listener.shares.held == {ALICE: 2, 0: 1}
    listener._report_counters()
    assert session.counters()["share_refused/vllm_senders/4242"] == 115
    [component] = [c for c in session.components() if c.name == "vllm_plugin"]
    assert component.up and "115 refused for want of a share" in component.reason
    assert "user 4242 (uid 4242), user 4242 holds 2 senders, its share of 2" in component.reason


def test_a_silent_sender_gives_its_place_and_its_layout_survives(short_dir, sleepers):
    session = Session()
    listener = VllmListener(session, str(short_dir / "vllm.sock"), max_senders=8, max_senders_per_user=1)
    engine, newcomer = sleepers[0], sleepers[1]
    listener.handle_datagram(layout(), engine, uid=ALICE)
    listener.handle_datagram(scheduler(), engine, uid=ALICE)
    listener.handle_datagram(scheduler(), newcomer, uid=ALICE)  # the share is full and the engine reports
    assert listener.rejected == 1 and set(listener._senders) == {engine}
    listener._senders[engine].last_seen -= listener_module.SILENT_SECONDS
    listener.handle_datagram(scheduler(), newcomer, uid=ALICE)
    view = session.vllm_view()
    assert set(listener._senders) == {newcomer} and listener.evicted == 1
    assert set(view.schedulers) == {newcomer} and set(view.layouts) == {engine}  # the layout survives
    listener._sweep()
    assert set(session.vllm_view().layouts) == {engine}  # alive: kept
    subprocess.run(["kill", str(engine)], check=True)
    os.waitpid(engine, 0)
    listener._sweep()
    assert session.vllm_view().layouts == {}  # gone: its layout goes too


def test_a_refusal_because_the_pool_is_full_names_no_user_at_its_share():
    shares = UserShares("vllm_senders", capacity=2, per_user=2, noun="senders")
    shares.take(ALICE)
    shares.take(ALICE)
    assert not shares.admits(BOB)
    shares.refuse(BOB)  # Bob holds nothing: the pool is full, not Bob's share
    shares.refuse(ALICE)
    assert shares.counters() == {"share_refused/vllm_senders/(pool full)": 1, "share_refused/vllm_senders/4242": 1}


def test_doctor_words_a_pool_full_refusal_truthfully(monkeypatch):
    import argparse

    from kvtrace import client as client_module
    from kvtrace import config as config_module
    from kvtrace.cli import doctor

    class Info:
        components = ()
        counters = {"share_refused/vllm_senders/(pool full)": 3, "share_refused/vllm_senders/alice": 2}

    class Agent:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def info(self):
            return Info()

    class Config:
        class socket:
            @staticmethod
            def exists():
                return True

    monkeypatch.setattr(config_module, "config_from_args", lambda args: Config)
    monkeypatch.setattr(client_module.AgentClient, "for_config", classmethod(lambda cls, config: Agent()))
    details = [finding.message for finding in doctor.agent_findings(argparse.Namespace())]
    assert any(detail.startswith("3 refused because all places were held, to users within their share")
               for detail in details)
    assert not any("user (pool full)" in detail for detail in details)
    assert any(detail.startswith("2 refused to user alice at its share") for detail in details)


def test_a_garbage_datagram_evicts_no_silent_sender(short_dir, sleepers):
    """The victim is picked before the newcomer's report is decoded, but evicted only once it decodes: garbage
    from a newcomer costs the silent sender neither its place nor its scheduler state."""
    session = Session()
    listener = VllmListener(session, str(short_dir / "vllm.sock"), max_senders=8, max_senders_per_user=1)
    engine, newcomer = sleepers[0], sleepers[1]
    listener.handle_datagram(scheduler(), engine, uid=ALICE)
    listener._senders[engine].last_seen -= listener_module.SILENT_SECONDS
    listener.handle_datagram(b"{not json", newcomer, uid=ALICE)
    assert set(listener._senders) == {engine} and listener.evicted == 0 and listener.rejected == 1
    assert set(session.vllm_view().schedulers) == {engine}
    listener.handle_datagram(scheduler(), newcomer, uid=ALICE)  # a good report takes the place
    assert set(listener._senders) == {newcomer} and listener.evicted == 1


def test_a_traced_vllm_newcomer_takes_a_strangers_place_never_the_reverse(short_dir, sleepers, monkeypatch):
    session = Session()
    listener = VllmListener(session, str(short_dir / "vllm.sock"), max_senders=8, max_senders_per_user=2)
    engine, flood = sleepers[0], sleepers[1:4]
    monkeypatch.setattr(listener, "_vllm_tied", lambda: lambda pid: pid == engine)
    listener.handle_datagram(scheduler(), flood[0], uid=ALICE)
    listener.handle_datagram(scheduler(), flood[1], uid=ALICE)
    listener.handle_datagram(scheduler(), engine, uid=ALICE)  # the engine, of the same user, is let in
    assert set(listener._senders) == {flood[1], engine}
    listener.handle_datagram(scheduler(), flood[2], uid=ALICE)  # a stranger never takes the engine's place
    listener.handle_datagram(scheduler(), flood[0], uid=ALICE)
    assert set(listener._senders) == {flood[1], engine} and listener.rejected == 2


# ---- trust ----


def info(pid: int, title: str, parent: int = 1) -> ProcessInfo:
    return ProcessInfo(pid, title, title[:15], "", "", T0 - 1000.0, 0.0, parent)


def test_the_kernel_ties_a_sender_to_vllm_by_title_memory_and_parent_chain():
    processes = {100: info(100, "VLLM::EngineCore"), 101: info(101, "VLLM::Worker_TP0", parent=100),
                 200: info(200, "VLLM::EngineCore"), 300: info(300, "python offline.py"),
                 301: info(301, "python fake.py", parent=1), 302: info(302, "VLLM::Worker_TP0", parent=301)}
    traced = {101, 300, 302}
    assert vllm_tie(100, processes, traced) == ""  # its worker holds the memory
    assert vllm_tie(101, processes, traced) == ""
    assert vllm_tie(300, processes, traced) == ""  # an engine in the script's own process
    assert vllm_tie(200, processes, traced) == ("it holds no traced GPU memory, and no vLLM worker that does "
                                                "descends from it")
    assert vllm_tie(301, processes, traced) == "it holds no traced GPU memory and its title is not a vLLM engine's"
    assert vllm_tie(400, processes, traced) == "it holds no traced GPU memory and kvtrace does not know its title"


def test_where_nvml_is_up_traced_bytes_alone_do_not_tie_a_sender():
    """A stub cuMemAlloc fakes traced bytes, not the driver's list: where NVML is up, only a pid it lists
    (or whose vLLM worker it lists) is tied; where NVML is down, traced bytes are the only word."""
    from kvtrace.model.vllm import gpu_holders

    processes = {100: info(100, "VLLM::EngineCore"), 101: info(101, "VLLM::Worker_TP0", parent=100),
                 666: info(666, "VLLM::EngineCore")}
    traced = {(666, 0): 30 * GiB, (101, 0): 10 * GiB}
    assert vllm_tie(666, processes, gpu_holders(traced, None)) == ""  # NVML down: the traced bytes
    nvml_up = gpu_holders(traced, {101})
    assert vllm_tie(666, processes, nvml_up) != ""  # faked bytes, not on the driver's list
    assert vllm_tie(100, processes, nvml_up) == ""  # its worker is on the list
    view = VllmView()
    for pid in (100, 666):
        view.schedulers[pid] = SchedulerReport(pid, T0 * NS, 1000, 990, 0, 0, 30, 20, ())
    analysis = VllmAnalysis()
    analysis.update(view, processes, traced, {}, T0 * NS, 0, gpu_pids={101})
    assert [sender.pid for sender in analysis.untrusted] == [666]
    analysis.update(view, processes, traced, {}, (T0 + 1) * NS, NS)  # NVML down
    assert analysis.untrusted == ()


def test_the_listener_ties_a_newcomer_by_the_analysis_rule(short_dir, sleepers):
    from kvtrace.model.gpus import GpuMemory, NvmlProcessMemory, NvmlSample

    session = Session()
    listener = VllmListener(session, str(short_dir / "vllm.sock"))
    engine = sleepers[0]
    assert not listener._vllm_tied()(engine)  # no GPU memory by anyone's word
    session.ingest(NvmlSample(T0 * NS, (GpuMemory(0, "GPU-0", "H100", 80 * GiB, GiB, 79 * GiB, 0),),
                              (NvmlProcessMemory(0, engine, GiB),)))  # NVML up: the driver lists the engine
    assert listener._vllm_tied()(engine) and not listener._vllm_tied()(sleepers[1])


def test_an_impostor_is_kept_apart_labelled_and_raises_no_finding():
    """GIVEN a real engine (titled, 30 GiB traced) and an impostor with no GPU memory (its title unknown, then
    titled as vLLM's), both sending a layout of 1 TiB claimed and an aborted request holding 6 blocks for 100 s,
    THEN only the engine is an engine with its finding; the impostor is an UntrustedSender labelled (untrusted)."""
    held = (KvRequest("leak-1", RequestState.ABORTED, 6, 100.0),)
    view = VllmView()
    for pid in (100, 777):
        view.schedulers[pid] = SchedulerReport(pid, T0 * NS, 1000, 900, 0, 0, 30, 20, held)
    from kvtrace.model.vllm import KvCacheLayout, KvTensor
    view.layouts[777] = KvCacheLayout(777, T0 * NS, 0, (KvTensor(1 << 44, 1 << 40),), 1001, 65536, 16)
    processes = {100: info(100, "VLLM::EngineCore")}
    analysis = VllmAnalysis()
    engines, findings = analysis.update(view, processes, {(100, 0): 30 * GiB}, {}, T0 * NS, 0)
    assert [engine.engine_pid for engine in engines] == [100]
    assert [(finding.engine_pid, finding.kind) for finding in findings] == [
        (100, FindingKind.BLOCKS_HELD_AFTER_FINISH)]
    [impostor] = analysis.untrusted
    assert (impostor.pid, impostor.label, impostor.kv_tensor_bytes, impostor.scheduler) == (
        777, "(untrusted)", 1 << 40, True)
    processes[777] = info(777, "VLLM::EngineCore")  # it titles itself as vLLM's: still no GPU memory
    engines, findings = analysis.update(view, processes, {(100, 0): 30 * GiB}, {}, (T0 + 1) * NS, NS)
    assert {engine.engine_pid: engine.plugin for engine in engines} == {100: True, 777: False}
    assert {finding.engine_pid for finding in findings} == {100}
    assert [sender.label for sender in analysis.untrusted] == ["(untrusted) VLLM::EngineCore"]


def test_the_group_socket_is_not_told_other_users_untrusted_pids():
    from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
    from kvtrace.servers.api.redaction import redact_info

    message = service_pb2.GetAgentInfoResponse()
    message.components.add(name="vllm_trust", up=True, reason="1 plugin senders not tied to vLLM: pid 777 ...")
    message.components.add(name="vllm_plugin", up=True, reason="23 refused for want of a share (nobody 23)")
    redacted = {component.name: component.reason for component in redact_info(message).components}
    assert redacted == {"vllm_trust": "", "vllm_plugin": "23 refused for want of a share (nobody 23)"}


def test_the_group_socket_is_not_told_the_titles_the_shares_component_names():
    from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
    from kvtrace.servers.api.redaction import redact_info

    message = service_pb2.GetAgentInfoResponse()
    message.components.add(name="shares", up=False, reason="ledger refused to uid 1000: python train.py --token s3cr3t")
    redacted = {component.name: component.reason for component in redact_info(message).components}
    assert redacted == {"shares": ""}


def test_nvmls_list_of_gpu_processes_ties_an_engine_with_tracing_off():
    view = VllmView()
    view.schedulers[100] = SchedulerReport(100, T0 * NS, 1000, 990, 0, 0, 30, 20, ())
    analysis = VllmAnalysis()
    analysis.update(view, {}, {}, {}, T0 * NS, 0)
    assert [sender.pid for sender in analysis.untrusted] == [100]
    engines, _ = analysis.update(view, {}, {}, {}, (T0 + 1) * NS, NS, gpu_pids={100})
    assert [(engine.engine_pid, engine.plugin) for engine in engines] == [(100, True)] and analysis.untrusted == ()


def test_kvtrace_vllm_lists_untrusted_senders_with_why_and_the_group_socket_does_not():
    """GetVllmEngines carries the untrusted senders (by pid, filtered like engines); `kvtrace vllm` prints them
    apart from the engines, each with its reason and claims; the redacted view drops them."""
    from kvtrace.cli.vllm import format_untrusted
    from kvtrace.model.findings import AnalysisSnapshot
    from kvtrace.model.vllm import UntrustedSender
    from kvtrace.servers.api.redaction import redact_vllm_engines
    from kvtrace.wire import untrusted_sender_from_proto, vllm_engines_to_json_dict, vllm_engines_to_proto

    senders = (UntrustedSender(888, "", "it holds no traced GPU memory and kvtrace does not know its title"),
               UntrustedSender(777, "VLLM::EngineCore", "it holds no traced GPU memory", 1 << 40, True))
    snapshot = AnalysisSnapshot(timestamp_ns=T0 * NS, vllm_untrusted=senders)
    response = vllm_engines_to_proto(snapshot)
    assert [untrusted_sender_from_proto(sender) for sender in response.untrusted_senders] == [senders[1], senders[0]]
    assert [sender.pid for sender in vllm_engines_to_proto(snapshot, frozenset({888})).untrusted_senders] == [888]
    assert [sender.pid for sender in vllm_engines_to_proto(snapshot, frozenset({5})).untrusted_senders] == []
    assert vllm_engines_to_json_dict(response)["untrusted_senders"][0] == {
        "pid": 777, "title": "VLLM::EngineCore", "reason": "it holds no traced GPU memory",
        "kv_tensor_bytes": 1 << 40, "scheduler": True}
    assert format_untrusted([untrusted_sender_from_proto(sender) for sender in response.untrusted_senders]) == (
        "not tied to vLLM, their plugin reports kept apart (no engine, no finding): 2\n"
        "  pid 777 (untrusted) VLLM::EngineCore: it holds no traced GPU memory; claims 1.0 TiB of KV tensors, "
        "sends scheduler reports\n"
        "  pid 888 (untrusted): it holds no traced GPU memory and kvtrace does not know its title")
    assert format_untrusted([]) == ""
    assert list(redact_vllm_engines(response).untrusted_senders) == []
