"""Two of issue 31's attacks at once against the real agent: the goals hold as for each alone.

GIVEN a `kvtrace agent` process (`--cmdline 'hog|workload'`, the kernel's maps at their defaults)
WHEN for ATTACK_SECONDS nobody forks short-lived CUDA children at 650 a second (the exit storm) and, at the same
time, uid 61999 fills its share of the kernel ledger with made-up allocations, filler after filler (refused past
its share), and root starts a workload in the middle (13 cudaMalloc of 1 MiB, held)
THEN root's 26 ledger entries are in the agent's snapshot exactly (address, size, GPU 0) and its ListProcesses
row (`kvtrace ps`) shows the 13 MiB within 1 s of its last call, the agent's loop never went more than 1 s
without a turn, and 5 s after the attack no gone pid holds an object. (The agent as it runs by default: its site
sample, which read the filler's whole ledger in a turn of the loop for 4-7 s, runs on a thread of its own.)

The attack and its measures are bench/attacks.py's (RESULTS §Q: the same for 60 s, and each attack alone).
"""
import os
import sys
from pathlib import Path

from harness import require_tracing_here

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from attacks import Options, measure_once, verdicts  # noqa: E402

ATTACK_SECONDS = 20
FILL = 300_000  # more than the user's share of the ledger (262 144 entries): the rest refused


def test_the_exit_storm_and_the_ledger_filler_at_once_leave_a_root_workload_traced_exactly():
    require_tracing_here()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = measure_once(("storm", "filler"), Options(seconds=ATTACK_SECONDS, fill=FILL), env)
    print(f"\n{result}")
    for goal, figure, wanted, met in verdicts(result):
        print(f"  {goal:30} {figure:55} goal {wanted:35} {'met' if met else 'MISSED'}")
    # THEN both attacks ran: children forked and exited, the filler's share filled and the rest refused
    assert result["storm_children"] > ATTACK_SECONDS * 100 and result["fillers"] >= 1 and not result["filler_errors"]
    assert result["share_full"] > 0 and result["ledger_full"] == 0
    # AND root is traced exactly and listed within 1 s of its last call
    assert result["root_exact"], result.get("root_entries")
    assert result["root_listed_s"] is not None and result["root_listed_s"] <= 1.0
    # AND no gone pid keeps objects 5 s after the attack
    assert result["phantoms_gone_s"] is not None and result["phantoms_gone_s"] <= 5.0, result["phantoms_left"]
    # AND the loop never went more than 1 s without a turn
    assert result["late_turns"] == 0 and result["gap_ms"] <= 1000, result["gap_grew_at"]
