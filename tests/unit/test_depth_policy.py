"""The depth policy (analysis/depth.py): which processes have their blocks traced, on what evidence.

GIVEN analysis snapshots one second apart, WHEN a process's traced bytes, forecast, unexplained memory or
vLLM findings change (or an operator asks), THEN its depth follows as the policy promises: raised on the
first snapshot with evidence (after the start-up grace), held while the evidence lasts, lowered after the
quiet window, bounded in number, and FULL only when asked for."""
import pytest

from kvtrace.analysis.depth import DepthOptions, DepthPolicy
from kvtrace.model.depth import BlocksMode, Depth, DepthCause, DepthRequest
from kvtrace.model.findings import AnalysisSnapshot, ProcessGpu
from kvtrace.model.vllm import FindingKind, VllmEngine, VllmFinding

S = 1_000_000_000
MIB = 1 << 20


def row(pid, traced, ttoom=None, unattributed=None, growth_1m=0.0):
    return ProcessGpu(pid=pid, title="", device=0, outstanding_bytes=traced, nvml_used_bytes=None,
                      unattributed_bytes=unattributed, growth_bytes_per_second_1m=growth_1m,
                      growth_bytes_per_second_15m=0.0, time_to_oom_seconds=ttoom, allocations_1m=0, frees_1m=0,
                      free_ratio_1m=None)


def snapshot(second, *rows, findings=(), engines=()):
    return AnalysisSnapshot(timestamp_ns=second * S, processes=tuple(rows), vllm_findings=tuple(findings),
                            vllm_engines=tuple(engines))


OPTIONS = DepthOptions(window_seconds=60, growth_bytes=64 * MIB, startup_grace_seconds=120, quiet_seconds=600)


def run(policy, seconds, traced_at, pids=(1,), requests=None):
    """One snapshot a second over `seconds`; traced_at(pid, second) -> traced bytes. The last decision."""
    decided = {}
    for second in seconds:
        decided, _ = policy.decide(snapshot(second, *(row(pid, traced_at(pid, second)) for pid in pids)),
                                   requests or {})
    return decided


def test_growth_raises_after_the_grace_and_quiet_lowers():
    policy = DepthPolicy(OPTIONS)
    # Start-up: 8 GiB in the first minute (weights, KV cache) raises nothing.
    decided = run(policy, range(0, 60), lambda pid, s: min(s, 40) * 200 * MIB)
    assert decided[1].depth is Depth.SEGMENTS and decided[1].cause is DepthCause.DEFAULT
    decided = run(policy, range(60, 200), lambda pid, s: 8000 * MIB)
    assert decided[1].depth is Depth.SEGMENTS
    # A leak of 2 MiB a second: 64 MiB gained within the window after 32 s.
    leak = lambda pid, s: 8000 * MIB + (s - 200) * 2 * MIB  # noqa: E731
    decided = run(policy, range(200, 232), leak)
    assert decided[1].depth is Depth.SEGMENTS
    decided = run(policy, range(232, 233), leak)
    assert decided[1].depth is Depth.BLOCKS and decided[1].cause is DepthCause.GROWTH
    assert decided[1].since_ns == 232 * S and "+64 MiB within 60 s" in decided[1].detail
    assert decided[1].sample_bytes == OPTIONS.sample_bytes
    # The leak stops at 300 s: the window shows 64 MiB gained until 328 s; held 600 s beyond that.
    flat = lambda pid, s: leak(pid, min(s, 300))  # noqa: E731
    decided = run(policy, range(233, 928), flat)
    assert decided[1].depth is Depth.BLOCKS and decided[1].since_ns == 232 * S
    decided = run(policy, range(928, 930), flat)
    assert decided[1].depth is Depth.SEGMENTS and decided[1].since_ns == 928 * S


def test_time_to_oom_unexplained_and_vllm_raise():
    policy = DepthPolicy(OPTIONS)
    for second in range(0, 200):
        decided, _ = policy.decide(snapshot(second, row(1, 0), row(2, 0, ttoom=3000.0, growth_1m=1e3),
                                            row(3, 0, unattributed=second * 5 * MIB), row(4, 0),
                                            row(6, 0, ttoom=3000.0)), {})
        if second < 120:  # starting up: no evidence counts yet
            assert {d.depth for d in decided.values()} == {Depth.SEGMENTS}
    assert decided[2].depth is Depth.BLOCKS and decided[2].cause is DepthCause.TIME_TO_OOM
    # A forecast while it no longer grows (the start-up's loading, fitted over 15 min) is no evidence.
    assert decided[6].depth is Depth.SEGMENTS
    assert decided[3].depth is Depth.BLOCKS and decided[3].cause is DepthCause.UNEXPLAINED
    assert decided[1].depth is Depth.SEGMENTS and decided[4].depth is Depth.SEGMENTS
    finding = VllmFinding(kind=FindingKind.IDLE_GROWTH, engine_pid=4, message="grows idle", value=1.0,
                          threshold=0.5, since_ns=0)
    engine = VllmEngine(engine_pid=4, title="VLLM::EngineCore", worker_pids=(4, 5))
    decided, _ = policy.decide(snapshot(200, row(4, 0), row(5, 0), findings=[finding], engines=[engine]), {})
    assert decided[4].cause is DepthCause.VLLM and decided[5].cause is DepthCause.VLLM
    assert decided[4].depth is Depth.BLOCKS and "grows idle" in decided[4].detail


def test_at_most_max_raised_on_evidence_the_strongest_first():
    policy = DepthPolicy(DepthOptions(startup_grace_seconds=0, growth_bytes=MIB, max_raised=2))
    decided = run(policy, range(0, 30), lambda pid, s: s * pid * MIB, pids=(1, 2, 3, 4))
    assert {pid for pid, d in decided.items() if d.depth is Depth.BLOCKS} == {3, 4}


def test_operator_requests_win_and_end():
    policy = DepthPolicy(OPTIONS)
    requests = {7: DepthRequest(7, Depth.FULL, requested_ns=0, until_ns=30 * S)}
    decided, ended = policy.decide(snapshot(10, row(7, 0)), requests, alive={7})
    assert decided[7].depth is Depth.FULL and decided[7].cause is DepthCause.OPERATOR
    assert decided[7].until_ns == 30 * S and decided[7].sample_bytes == 0 and ended == []
    # Its time is up: the request ends and the process is back to what the evidence says.
    decided, ended = policy.decide(snapshot(30, row(7, 0)), requests, alive={7})
    assert ended == [7] and decided[7].depth is Depth.SEGMENTS
    # A request for a process that is gone ends at once.
    requests = {8: DepthRequest(8, Depth.BLOCKS, requested_ns=0, until_ns=100 * S)}
    decided, ended = policy.decide(snapshot(31), requests, alive=set())
    assert ended == [8] and 8 not in decided
    # A process that holds no traced memory yet can be asked for (it is alive).
    decided, ended = policy.decide(snapshot(32), requests, alive={8})
    assert decided[8].depth is Depth.BLOCKS and ended == []


@pytest.mark.parametrize(("mode", "sample_bytes", "depth"), [
    (BlocksMode.ALWAYS, 512 << 10, Depth.BLOCKS), (BlocksMode.ALWAYS, 0, Depth.FULL),
    (BlocksMode.NEVER, 512 << 10, Depth.SEGMENTS)])
def test_fixed_modes(mode, sample_bytes, depth):
    policy = DepthPolicy(DepthOptions(mode=mode, sample_bytes=sample_bytes))
    decided = run(policy, range(0, 3), lambda pid, s: s * 1000 * MIB, pids=(1, 2))
    assert {d.depth for d in decided.values()} == {depth}
    assert {d.cause for d in decided.values()} == {DepthCause.CONFIGURED}
    assert {d.since_ns for d in decided.values()} == {0}


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="quiet_seconds"):
        DepthOptions(quiet_seconds=0)
    with pytest.raises(ValueError, match="max_raised"):
        DepthOptions(max_raised=-1)


def test_the_grace_counts_from_the_process_start_and_its_first_traced_memory():
    """A process that imports for minutes before CUDA starts is graced from its first traced memory; an agent
    started beside a process that runs for hours waits the grace once, then its growth counts."""
    policy = DepthPolicy(OPTIONS)
    grows = lambda pid, s: (s - 10_000) * 2 * MIB  # noqa: E731
    for second in range(10_000, 10_119):
        decided, _ = policy.decide(snapshot(second, row(1, grows(1, second)), row(2, grows(2, second))),
                                   {}, started_ns={1: 0, 2: 9_990 * S})
        assert {d.depth for d in decided.values()} == {Depth.SEGMENTS}, second
    for second in range(10_119, 10_160):
        decided, _ = policy.decide(snapshot(second, row(1, grows(1, second)), row(2, grows(2, second))),
                                   {}, started_ns={1: 0, 2: 9_990 * S})
    assert decided[1].depth is Depth.BLOCKS and decided[1].cause is DepthCause.GROWTH
    assert decided[2].depth is Depth.BLOCKS


def test_an_operator_request_does_not_erase_a_raise_on_evidence():
    """Raised on growth, asked FULL for 30 s, and the request ends: it is back at BLOCKS (its evidence is
    still within the quiet window), its blocks known since the first raise."""
    policy = DepthPolicy(DepthOptions(startup_grace_seconds=0, growth_bytes=MIB, window_seconds=60))
    decided = run(policy, range(0, 5), lambda pid, s: s * 2 * MIB)
    assert decided[1].depth is Depth.BLOCKS and decided[1].since_ns == 1 * S
    requests = {1: DepthRequest(1, Depth.FULL, requested_ns=5 * S, until_ns=35 * S)}
    decided = run(policy, range(5, 35), lambda pid, s: 8 * MIB, requests=requests)
    assert decided[1].depth is Depth.FULL and decided[1].since_ns == 1 * S  # blocks known all along
    decided, ended = policy.decide(snapshot(35, row(1, 8 * MIB)), requests, alive={1})
    assert ended == [1]
    assert decided[1].depth is Depth.BLOCKS and decided[1].cause is DepthCause.GROWTH and decided[1].since_ns == S


def test_a_reused_pid_is_another_process():
    """Its old depth, evidence and requests do not pass to a new process that took the pid."""
    policy = DepthPolicy(DepthOptions(startup_grace_seconds=0, growth_bytes=MIB, window_seconds=60))
    for second in range(0, 5):
        decided, _ = policy.decide(snapshot(second, row(1, second * 2 * MIB)), {}, started_ns={1: 1})
    assert decided[1].depth is Depth.BLOCKS
    request = DepthRequest(1, Depth.FULL, requested_ns=4 * S, until_ns=100 * S, process_started_ns=1)
    decided, ended = policy.decide(snapshot(5, row(1, 0)), {1: request}, alive={1}, started_ns={1: 5 * S})
    assert ended == [1] and decided[1].depth is Depth.SEGMENTS and decided[1].since_ns == 5 * S


def test_held_processes_keep_their_strength_against_newcomers():
    """With room for one, a process that grew 2 GiB and then went quiet is not evicted by one that grew 64 MiB."""
    policy = DepthPolicy(DepthOptions(startup_grace_seconds=0, growth_bytes=64 * MIB, window_seconds=60,
                                      max_raised=1))
    decided = run(policy, range(0, 3), lambda pid, s: (2048 if pid == 1 else 0) * MIB * s, pids=(1, 2))
    assert decided[1].depth is Depth.BLOCKS
    decided = run(policy, range(3, 100), lambda pid, s: 4096 * MIB if pid == 1 else 64 * MIB * min(s - 2, 1),
                  pids=(1, 2))
    assert decided[1].depth is Depth.BLOCKS and decided[2].depth is Depth.SEGMENTS


def test_the_mode_the_probes_can_do_decides():
    """A policy told the probes trace blocks everywhere (a kept ledger) or nowhere (no uprobe_multi) says so."""
    policy = DepthPolicy(OPTIONS)
    policy.set_mode(BlocksMode.NEVER)
    decided, _ = policy.decide(snapshot(1, row(1, 0)), {1: DepthRequest(1, Depth.FULL, 0, 10 * S)}, alive={1})
    assert decided[1].depth is Depth.SEGMENTS and decided[1].cause is DepthCause.CONFIGURED


class FakeSource:
    """What the daemon asks of the BPF source for depths."""

    def __init__(self, mode, followed=None, down="", torch=(1, 2)):
        self.blocks_mode, self.torch_blocks_down, self.followed, self.applied = mode, down, followed, []
        self.torch = set(torch)

    def follows(self, pid):
        return self.followed is None or pid in self.followed

    def deepenable_pids(self):
        return {pid for pid in self.torch if self.follows(pid)}

    def pytorch_pids(self):
        return set(self.torch)

    def set_block_depths(self, depths):
        self.applied.append(dict(depths))


def test_the_daemon_publishes_what_the_probes_do():
    """Tracing off: no depths, requests refused. A source that traces blocks everywhere: requests refused,
    every process at blocks. Auto: decisions applied to the probes and published, for followed pids only."""
    from kvtrace.daemon import Daemon, DaemonOptions
    from kvtrace.model.depth import DepthRequest as Request

    daemon = Daemon(DaemonOptions(api=None, nvml=False, tracing="off", vllm_socket="", vllm_discover=False,
                                  flight=None))
    rows = snapshot(10, row(1, MIB), row(2, MIB))
    daemon._decide_depths(rows)
    assert daemon.session.process_depths() == {} and "tracing is off" in daemon.session.depth_refusal()

    daemon.source = FakeSource(BlocksMode.ALWAYS)
    daemon._decide_depths(rows)
    assert {d.depth for d in daemon.session.process_depths().values()} == {Depth.BLOCKS}
    assert "every process" in daemon.session.depth_refusal()

    daemon.source = source = FakeSource(BlocksMode.AUTO, followed={1})
    daemon.session.set_depth_refusal("")
    daemon.session.request_depth(Request(1, Depth.FULL, requested_ns=0, until_ns=10**20))
    daemon._decide_depths(rows)
    assert daemon.session.depth_refusal() == ""
    assert {pid: d.depth for pid, d in daemon.session.process_depths().items()} == {1: Depth.FULL}
    assert source.applied == [{1: Depth.FULL}]


def test_the_start_up_is_not_growth_with_the_default_window():
    """A process that loads 8 GiB in 40 s and then stays flat is never raised (the 15-min window starts after
    its grace); one that then leaks 64 MiB is."""
    policy = DepthPolicy(DepthOptions())
    load = lambda pid, s: min(s, 40) * 200 * MIB  # noqa: E731
    for second in range(0, 1000):
        decided, _ = policy.decide(snapshot(second, row(1, load(1, second))), {}, started_ns={1: 0})
        assert decided[1].depth is Depth.SEGMENTS, second
    for second in range(1000, 1040):
        decided, _ = policy.decide(snapshot(second, row(1, load(1, second) + (second - 1000) * 2 * MIB)), {},
                                   started_ns={1: 0})
    assert decided[1].depth is Depth.BLOCKS and decided[1].cause is DepthCause.GROWTH


def test_a_process_without_pytorch_is_never_raised_and_says_why():
    """Its growth raises nothing (its segments are its holders), takes no place under max_raised, and a request
    for it waits until it maps a PyTorch allocator."""
    policy = DepthPolicy(DepthOptions(startup_grace_seconds=0, growth_bytes=MIB, window_seconds=60, max_raised=1))
    for second in range(0, 5):
        decided, _ = policy.decide(snapshot(second, row(1, second * 100 * MIB), row(2, second * MIB)), {},
                                   deepenable={2})
    assert decided[1].depth is Depth.SEGMENTS and decided[1].cause is DepthCause.NO_BLOCKS
    assert decided[2].depth is Depth.BLOCKS and decided[2].cause is DepthCause.GROWTH
    request = {1: DepthRequest(1, Depth.FULL, requested_ns=0, until_ns=100 * S)}
    decided, ended = policy.decide(snapshot(6, row(1, 0), row(2, 0)), request, alive={1, 2}, deepenable={2})
    assert decided[1].cause is DepthCause.NO_BLOCKS and ended == []
    # One that maps PyTorch's allocator whose probes cannot go in (refused, no room): not "segments are holders".
    decided, _ = policy.decide(snapshot(6, row(1, 0), row(2, 0)), {}, deepenable={2}, pytorch={1, 2})
    assert decided[1].depth is Depth.SEGMENTS and decided[1].cause is DepthCause.DEFAULT
    assert "cannot be put in" in decided[1].detail
    decided, _ = policy.decide(snapshot(7, row(1, 0), row(2, 0)), request, alive={1, 2}, deepenable={1, 2})
    assert decided[1].depth is Depth.FULL
