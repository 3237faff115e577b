"""Issue 31, attacks 2, 3 and 6 on the Python side: the shares' rule, who is named when refused, library
slots per user, and figures a process chooses bounded on /metrics and on the wire (the probes' side:
tests/integration/test_shares_kernel.py)."""
from __future__ import annotations

import ctypes

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvtrace.model.agent import OutstandingTotal, PartyShare, TrackedProcess
from kvtrace.model.events import Api, Layer, Memory
from kvtrace.model.findings import ProcessGpu
from kvtrace.model.ledger import LedgerCounts, TotalsKey
from kvtrace.servers.metrics import METRICS, KvtraceCollector
from kvtrace.session import Session
from kvtrace.sources.bpf import abi
from kvtrace.sources.bpf.discovery import FileId
from kvtrace.sources.bpf.shares import (
    MAX_DEVICES,
    UID_USERS,
    RawShare,
    Share,
    ShareWatch,
    ledger_share,
    max_object_bytes,
    share_batch,
    share_cflags,
)
from kvtrace.sources.bpf.source import BpfOptions, BpfSource
from kvtrace.wire.agent import process_growth_to_proto, process_to_proto
from kvtrace.wire.common import U64_MAX
from test_bpf_source import LibraryProbes, _library


def test_the_shares_of_a_map_leave_the_others_a_reserve():
    share = Share(1 << 20)
    assert (share.user, share.users, share.root) == (262_144, 524_288, 786_432)
    assert share.of(1000) == 262_144 and share.of(0) == 786_432
    flags = share_cflags(1 << 20, 16384)
    assert "-DKVT_SHARE_USER_LEDGER=262144" in flags and "-DKVT_SHARE_USERS_TOTALS=8192" in flags
    assert f"-DKVT_MAX_OBJECT_BYTES={1 << 42}" in flags


def test_no_sum_of_a_full_ledger_of_the_largest_objects_can_wrap():
    for entries in (1, 23, 4096, 1 << 20, 3_000_000, 1 << 24):
        bound = max_object_bytes(entries)
        assert bound & (bound - 1) == 0  # a power of two
        assert entries * bound <= 1 << 62 < entries * bound * 2


def test_the_probes_device_bound_is_the_header_s():
    assert f"#define KVT_MAX_DEVICES {MAX_DEVICES}\n" in (abi.probes_dir() / "kvtrace.h").read_text()
    assert f"#define KVT_UID_USERS {UID_USERS:#x}u" in (abi.probes_dir() / "kvtrace.h").read_text()


class ShareMaps:
    def __init__(self, users, processes) -> None:
        self.users, self.processes, self.process_reads = users, processes, 0

    def read_shares(self, by_pid: bool):
        if by_pid:
            self.process_reads += 1
        return self.processes if by_pid else self.users


def _raw(uid: int, entries: int, refused: int, totals_refused: int = 0) -> RawShare:
    return RawShare(ledger_entries=entries, totals_keys=3, refused_entries=refused, refused_totals=totals_refused,
                    uid=uid)


def test_a_refused_user_and_its_processes_are_named_and_nobody_else():
    # GIVEN uid 1001 refused 23 entries (pid 4242 refused 19 of them, pid 4243 4), root and uid 1002 refused none
    maps = ShareMaps([(0, _raw(0, 37, 0)), (1001, _raw(1001, 262_144, 23)), (1002, _raw(1002, 5, 0)),
                      (UID_USERS, _raw(UID_USERS, 262_149, 0))],
                     [(4242, _raw(1001, 200_000, 19)), (4243, _raw(1001, 62_144, 4)), (77, _raw(0, 37, 0))])
    session = Session()
    watch = ShareWatch(maps, session, 1 << 20, 16384)
    # WHEN the source reports
    watch.report(now=100.0)
    # THEN the shares component is down and names uid 1001, its figures and both of its processes, most refused first
    (status,) = [c for c in session.components() if c.name == "shares"]
    assert not status.up
    assert status.reason.startswith("uid 1001 holds 262144 of its 262144 ledger entries")
    assert "23 allocations counted, not stored; by pid 4242, pid 4243" in status.reason
    assert "uid 0" not in status.reason and "1002" not in status.reason
    assert [(p.uid, p.pid, p.refused_entries) for p in session.shares()] == [(1001, 0, 23), (1001, 4242, 19),
                                                                               (1001, 4243, 4)]
    # AND the processes are read again only after PROCESS_READ_SECONDS, however often it reports
    watch.report(now=101.0)
    assert maps.process_reads == 1


def test_a_user_refused_long_ago_below_its_share_is_no_longer_degraded():
    # GIVEN uid 1001 was refused 23 entries, and now holds 5 (its processes exited)
    maps = ShareMaps([(1001, _raw(1001, 5, 23))], [])
    session = Session()
    watch = ShareWatch(maps, session, 1 << 20, 16384)
    watch.report(now=100.0)
    assert not [c for c in session.components() if c.name == "shares"][0].up
    # WHEN no refusal came for 60 s
    watch.report(now=160.0)
    # THEN the component is up again, and its count stays for /metrics
    (status,) = [c for c in session.components() if c.name == "shares"]
    assert status.up and [(p.uid, p.refused_entries) for p in session.shares()] == [(1001, 23)]


def test_nobody_refused_leaves_the_component_up():
    session = Session()
    ShareWatch(ShareMaps([(0, _raw(0, 37, 0))], []), session, 1 << 20, 16384).report(now=1.0)
    (status,) = [c for c in session.components() if c.name == "shares"]
    assert status.up and status.reason == "" and session.shares() == []


# ---- library slots (attack 3) ----

def test_one_users_copies_of_libcudart_take_a_quarter_of_the_slots_and_root_still_attaches(monkeypatch):
    # GIVEN 64 slots, and 80 copies of libcudart mapped by processes of uid 1001 only
    probes = LibraryProbes()
    session = Session()
    tracer = BpfSource(session, BpfOptions(max_libraries=64))
    tracer.probes = probes
    targets = tracer.targets
    owner = {1001: 1001, 1002: 1002, 1: 0}
    monkeypatch.setattr(targets, "_uids_of", lambda pids: frozenset(owner[pid] for pid in pids))
    for number in range(80):
        targets.attach(_library(number, 1001))
    # THEN 16 are attached (its share), 64 wait, each refusal counted
    assert len(probes.live) == 16 and targets.share_refusals == 64
    # WHEN uid 1002 maps 20 of its own: 16 attach (the users together hold 32: half)
    for number in range(100, 120):
        targets.attach(_library(number, 1002))
    assert len(probes.live) == 32
    # AND a third user finds the users' half taken
    waiting = _library(200, 1001)
    targets.attach(waiting)
    assert FileId(1, 200) not in probes.live
    # WHEN root's process maps a newly installed libcudart
    targets.attach(_library(300, 1))
    # THEN it is attached at once
    assert FileId(1, 300) in probes.live
    # AND the libraries component says who waits and why
    tracer._report(dict.fromkeys(abi.COUNTERS, 0))
    (status,) = [c for c in session.components() if c.name == "libraries"]
    assert not status.up and status.reason.startswith("69 libraries wait for probes: 33 attached")
    assert "copy116/libcudart.so.12 (the users' libraries hold their share of slots (32 of 32" in status.reason
    assert targets.waiting_why["/home/u/copy79/libcudart.so.12"] == (
        "uid 1001 holds its share of library slots (16: a quarter of --max-libraries 64)")


# ---- figures a process chooses (attack 6) ----

def _scrape(ledger: LedgerCounts, shares=()) -> dict[str, list]:
    return _collector(ledger, shares)[1]()


def _collector(ledger: LedgerCounts, shares=()):
    """A collector of `ledger` and `shares` (a list the caller may change between scrapes), and its scrape."""
    class State:
        latest = None

        def ledger_counts(self):
            return ledger

        def components(self):
            return []

        def counters(self):
            return {}

        def process_titles(self):
            return {4242: "attacker"}

        def cross_checks(self):
            return []

        def cross_check_totals(self):
            return {}

        def process_depths(self):
            return {}

        def shares(self):
            return list(shares)  # as it is at each scrape

    collector = KvtraceCollector(State(), State())

    def scrape() -> dict[str, list]:
        families: list[GaugeMetricFamily | CounterMetricFamily] = list(collector.collect())
        return {family.name: family.samples for family in families}
    return collector, scrape


def test_a_process_with_8194_gpus_and_20_error_codes_gets_a_few_series():
    # GIVEN one process with bytes on 8 194 device ordinals (as before the probes' bound), failures with 20 codes
    totals = {TotalsKey(4242, device, Layer.DRIVER, Memory.DEVICE): (device + 1, 1) for device in range(8194)}
    failures = {(Api.cuMemAlloc_v2, code): code + 1 for code in range(20)}
    ledger = LedgerCounts(totals=totals, allocations_total={}, frees_total={}, failures_total=failures)
    samples = _scrape(ledger)
    # THEN its 8 largest GPUs have series, the other 8 186 are summed as gpu="other", bytes kept exactly
    outstanding = [s for s in samples["kvtrace_outstanding_bytes"] if s.labels["pid"] == "4242"]
    assert len(outstanding) == 9
    assert {s.labels["gpu"] for s in outstanding} == {*map(str, range(8186, 8194)), "other"}
    assert sum(s.value for s in outstanding) == sum(device + 1 for device in range(8194))
    # AND the 8 most frequent error codes have series, the other 12 one "other"
    failed = samples["kvtrace_allocation_failures"]
    assert len(failed) == 9 and [s for s in failed if s.labels["error_code"] == "other"][0].value == sum(range(1, 13))


def test_the_first_users_refused_keep_their_series_and_other_only_grows():
    """A counter's series must not vanish nor go down: the first 8 users refused are named for good (most
    refused first among those new in one scrape), every later one is "other" however its count ranks."""
    shares = [PartyShare(1000 + n, 0, 10, 1, n + 1, 0) for n in range(10)]
    ledger = LedgerCounts(totals={}, allocations_total={}, frees_total={}, failures_total={})
    collector, scrape = _collector(ledger, shares)

    def refused():
        samples = scrape()["kvtrace_share_refused"]
        return {s.labels["user"]: s.value for s in samples if s.labels["resource"] == "ledger"}

    first = refused()
    assert first == {**{str(uid): uid - 999 for uid in range(1002, 1010)}, "other": 1 + 2}
    # WHEN the two users in "other" are refused most of all, and a new user comes
    shares[:] = [PartyShare(1000, 0, 10, 1, 500, 0), PartyShare(1001, 0, 10, 1, 400, 0), *shares[2:],
                 PartyShare(1010, 0, 10, 1, 1000, 0)]
    second = refused()
    # THEN the named keep their series and "other" only grows
    assert set(second) == set(first)
    assert second["other"] == 500 + 400 + 1000
    assert {spec.name for spec in METRICS} >= {"kvtrace_share_refused_total"}


def test_a_total_of_2000_objects_of_2_to_the_62_bytes_saturates_on_the_wire():
    # GIVEN a process whose total (from a recording, or before the probes' bound) is 2 000 × 2^62 bytes
    size = 2000 * 2**62
    process = TrackedProcess(4242, "attacker", "attacker", "",
                             [OutstandingTotal(0, Layer.DRIVER, Memory.DEVICE, size, 2000)])
    # THEN it converts (held at the field's bounds) instead of failing the whole response
    assert process_to_proto(process).totals[0].size_bytes == U64_MAX
    row = ProcessGpu(pid=4242, title="attacker", device=0, outstanding_bytes=size, nvml_used_bytes=0,
                     unattributed_bytes=-size, growth_bytes_per_second_1m=0.0, growth_bytes_per_second_15m=0.0,
                     time_to_oom_seconds=None, allocations_1m=2000, frees_1m=0, free_ratio_1m=None)
    message = process_growth_to_proto(row)
    assert message.outstanding_bytes == U64_MAX and message.unattributed_bytes == -(2**63)


def test_the_share_record_matches_the_header():
    from test_abi import _SIZES, _struct_fields

    fields = _struct_fields("kvt_share")
    assert [name for name, _ in fields] == [name for name, _ in RawShare._fields_]
    offset = 0
    for name, c_type in fields:
        assert getattr(RawShare, name).offset == offset, name
        offset += _SIZES[c_type]
    assert ctypes.sizeof(RawShare) == offset == 48


def test_a_share_is_a_whole_number_of_batches():
    for entries in (16, 1000, 1024, 3000, 4096, 1_000_000, 1 << 20, 1 << 22):
        batch = share_batch(entries)
        share = ledger_share(entries)
        assert batch & (batch - 1) == 0 and batch <= 64
        assert share.user % batch == share.users % batch == share.root % batch == 0
        assert 0 <= Share(entries).user - share.user < batch and 0 <= Share(entries).root - share.root < batch
        # what the probes are given (-D flags) is that share
        flags = share_cflags(entries, 1024)
        assert f"-DKVT_SHARE_USER_LEDGER={share.user}" in flags and f"-DKVT_SHARE_ROOT_LEDGER={share.root}" in flags
        assert f"-DKVT_SHARE_USERS_LEDGER={share.users}" in flags and f"-DKVT_SHARE_BATCH={batch}" in flags
    assert share_batch(1 << 20) == 64 and share_batch(16) == 1
    # --max-ledger-entries 1000000: a quarter is 250 000, not a whole number of 64s
    assert ledger_share(1_000_000).user == 249_984 and ledger_share(1_000_000).root == 749_952
    assert ledger_share(1_000_000).users == 499_968
