"""Stack sampling of PyTorch blocks (probes/usdt.h block_walked): a chosen block's bytes weigh the inverse of
its chance to be chosen, so that bytes per stack are unbiased estimates; a block passed over weighs nothing
and makes no stackless site of its own; exact entries stay exact. The probes' countdown is mirrored here in
Python over the same quantile table, to check the estimator on many blocks without a kernel."""
import math
import random

import pytest

from kvtrace.analysis.leaks import find_suspects, survey_sites
from kvtrace.model.blocks import estimated_bytes, is_estimated
from kvtrace.model.events import Api, Layer, Memory, ObjectKind, StackStatus
from kvtrace.model.ledger import LedgerKey, Outstanding
from kvtrace.model.stacks import Frame, Stack
from kvtrace.reports.flamegraph import ESTIMATED_NOTE, NO_STACK_FRAME, estimated, folded_stacks, speedscope_document
from kvtrace.sources.bpf import abi
from kvtrace.sources.bpf.loader import (
    BLOCK_SAMPLE_BYTES_MAX,
    BLOCK_SAMPLE_BYTES_MIN,
    BpfProbes,
    exponential_quantiles,
)

KiB, MiB = 1 << 10, 1 << 20
S = 256 * KiB
T0 = 1_700_000_000_000_000_000
NS = 1_000_000_000
_addresses = iter(range(0x7F00_0000_0000, 0x7F00_0000_0000 + (1 << 40), 1 << 12))


def block(size, stack_id=0, sampled=False, sample_bytes=S, pid=200, device=0, ts=T0):
    return Outstanding(LedgerKey(pid, Layer.TORCH, ObjectKind.BLOCK, next(_addresses)), size, ts, device,
                       Api.pytorch_malloc, Memory.DEVICE, stack_id=stack_id, sample_bytes=sample_bytes,
                       sampled=sampled)


def test_estimated_bytes_exact_always_walked_weighted_and_passed_over():
    # exact: no sampling (S 0), whatever the size; every non-block entry too
    assert estimated_bytes(block(16 * KiB, sample_bytes=0)) == 16 * KiB
    assert not is_estimated(block(16 * KiB, sample_bytes=0))
    # a block of at least S is always walked: weight 1
    assert estimated_bytes(block(S, sampled=True)) == S and estimated_bytes(block(3 * MiB, sampled=True)) == 3 * MiB
    assert not is_estimated(block(S, sampled=True))
    # smaller and chosen: s / P(chosen) = s / (1 - exp(-s/S)); 16 KiB at 256 KiB: about 16.5 x its size
    chosen = estimated_bytes(block(16 * KiB, sampled=True))
    assert chosen == pytest.approx(16 * KiB / (1 - math.exp(-1 / 16)), rel=1e-12)
    assert 16.4 < chosen / (16 * KiB) < 16.6 and is_estimated(block(16 * KiB, sampled=True))
    # tiny blocks weigh about S each: their chance is about s / S
    assert estimated_bytes(block(512, sampled=True)) == pytest.approx(S + 256, rel=1e-3)
    # passed over: nothing of its own (the chosen ones stand for it)
    assert estimated_bytes(block(16 * KiB, sampled=False)) == 0.0 and is_estimated(block(16 * KiB))


def test_the_quantile_table_is_the_exponential_of_mean_s():
    draws = exponential_quantiles(S)
    assert len(draws) == abi.BLOCK_SAMPLE_DRAWS and draws == sorted(draws, reverse=True)
    assert sum(draws) / len(draws) == pytest.approx(S, rel=5e-4)  # the cut tail costs 0.03 %
    # P(draw < x) is 1 - exp(-x/S) to within half a slice
    for x in (S // 16, S // 2, S, 3 * S):
        below = sum(draw < x for draw in draws) / len(draws)
        assert abs(below - (1 - math.exp(-x / S))) <= 1 / len(draws)


class _Table(dict):
    """A bcc map as set_block_sample_bytes writes it: ctypes keys and values, kept by value."""

    def __setitem__(self, key, value):
        super().__setitem__(key.value, value.value)

    def __delitem__(self, key):
        super().__delitem__(key.value)


def _probes_without_a_kernel():
    probes = BpfProbes.__new__(BpfProbes)
    probes._bpf = {b"config": _Table(), b"block_sample_draws": _Table(), b"block_full_pids": _Table()}
    return probes


def test_set_block_sample_bytes_fills_the_draws_then_the_mean_and_refuses_what_a_ledger_entry_cannot_hold():
    probes = _probes_without_a_kernel()
    probes.set_block_sample_bytes(S)
    assert probes._bpf[b"config"] == {abi.CONFIG_BLOCK_SAMPLE_BYTES: S}
    assert [probes._bpf[b"block_sample_draws"][i] for i in range(abi.BLOCK_SAMPLE_DRAWS)] == exponential_quantiles(S)
    probes.set_block_sample_bytes(0)
    assert probes._bpf[b"config"] == {abi.CONFIG_BLOCK_SAMPLE_BYTES: 0}
    for fits in (BLOCK_SAMPLE_BYTES_MIN, BLOCK_SAMPLE_BYTES_MAX):
        probes.set_block_sample_bytes(fits)
    # struct kvt_ledger_value keeps S in KiB in 16 bits: whole KiB, 4 KiB to 64 MiB - 1 KiB
    assert (BLOCK_SAMPLE_BYTES_MIN, BLOCK_SAMPLE_BYTES_MAX) == (4 * KiB, 64 * MiB - KiB)
    for wrong in (1, 4 * KiB - 1024, 4 * KiB + 1, 64 * MiB, -4 * KiB):
        with pytest.raises(ValueError, match="from 4KiB to 65535KiB"):
            probes.set_block_sample_bytes(wrong)
    assert probes._bpf[b"config"] == {abi.CONFIG_BLOCK_SAMPLE_BYTES: BLOCK_SAMPLE_BYTES_MAX}


def test_set_block_full_puts_a_process_in_and_out():
    probes = _probes_without_a_kernel()
    probes.set_block_full(42, True)
    assert probes._bpf[b"block_full_pids"] == {42: 1}
    probes.set_block_full(42, False)
    probes.set_block_full(43, False)  # never in: nothing to take out
    assert probes._bpf[b"block_full_pids"] == {}


def probe_sampling(sizes, sample_bytes, rng):
    """Which blocks of one thread the probe walks (block_walked, in Python): the countdown drawn from the same
    table at the first block, decremented by each block under S, a fresh draw once it goes below zero."""
    draws = exponential_quantiles(sample_bytes)
    countdown = None
    chosen = []
    for size in sizes:
        if size >= sample_bytes:
            chosen.append(True)
            continue
        if countdown is None:
            countdown = draws[rng.getrandbits(32) & (len(draws) - 1)]
        countdown -= size
        if countdown >= 0:
            chosen.append(False)
        else:
            countdown = draws[rng.getrandbits(32) & (len(draws) - 1)]
            chosen.append(True)
    return chosen


def test_estimates_per_stack_are_unbiased_within_four_sigma():
    """GIVEN one thread's 60 000 blocks from three stacks interleaved at random: 4 KiB-64 KiB tensors from stack
    1, 512 B ones from stack 2, and 300 KiB-2 MiB ones (all at least S: exact) from stack 3,
    WHEN the probe's countdown picks which to walk,
    THEN each stack's estimated bytes lie within 4 sigma of its true bytes, sigma^2 = sum s^2 (1-p)/p
    (independent choices of probability p = 1 - exp(-s/S): the exponential's lack of memory), and stack 3's are
    exact."""
    rng = random.Random(23)
    stacks = [rng.choice((1, 1, 2, 3)) for _ in range(60_000)]
    sizes = [rng.randrange(4 * KiB, 64 * KiB) if stack == 1 else 512 if stack == 2
             else rng.randrange(300 * KiB, 2 * MiB) for stack in stacks]
    chosen = probe_sampling(sizes, S, rng)
    entries = [block(size, stack_id=stack, sampled=pick)
               for size, stack, pick in zip(sizes, stacks, chosen, strict=True)]
    for stack in (1, 2, 3):
        true = sum(size for size, of in zip(sizes, stacks, strict=True) if of == stack)
        estimate = sum(estimated_bytes(e) for e in entries if e.stack_id == stack)
        variance = sum(s * s * math.exp(-s / S) / -math.expm1(-s / S)
                       for s, of in zip(sizes, stacks, strict=True) if of == stack and s < S)
        if stack == 3:
            assert estimate == true and variance == 0
        else:
            assert abs(estimate - true) <= 4 * math.sqrt(variance), (stack, estimate / true, math.sqrt(variance) / true)
    walked = sum(chosen)
    assert walked < len(sizes) / 3  # the point: most of the 45 000 small blocks are not walked


def test_leak_survey_estimates_sampled_sites_and_makes_no_stackless_site_of_blocks_passed_over():
    # GIVEN a process's blocks under sampling at 256 KiB: 4 chosen 16 KiB blocks of stack 7 and 60 passed over,
    # two 1 MiB blocks of stack 9 (at least S: always walked, exact), and in another process, walked in full
    # (S 0), 3 blocks without a stack
    old = T0 - 3600 * NS
    entries = [block(16 * KiB, stack_id=7, sampled=True, ts=old + i) for i in range(4)]
    entries += [block(16 * KiB, sampled=False, ts=old) for _ in range(60)]
    entries += [block(MiB, stack_id=9, sampled=True, ts=old) for _ in range(2)]
    entries += [block(KiB, sample_bytes=0, pid=300, ts=old) for _ in range(3)]
    weight = 1 / (1 - math.exp(-1 / 16))
    # WHEN surveyed
    survey = survey_sites(entries, T0, 60)
    # THEN the sites are stack 7 (estimated), stack 9 and the exact stackless one of pid 300: none from the 60
    assert {(site.pid, site.stack_id): size for site, size in survey.site_bytes.items()} == pytest.approx(
        {(200, 7): 4 * 16 * KiB * weight, (200, 9): 2 * MiB, (300, 0): 3 * KiB})
    # the counts of blocks looked at stay exact
    assert (survey.allocations_considered, survey.suspect_allocations) == (69, 69)
    report = find_suspects(entries, T0, 60, {}, {}, lambda stack_id: None)
    suspects = {(s.pid, s.stack_id): s for s in report.suspects}
    assert sorted(suspects) == [(200, 7), (200, 9), (300, 0)]
    sampled, big, exact = suspects[(200, 7)], suspects[(200, 9)], suspects[(300, 0)]
    assert sampled.estimated and sampled.outstanding_bytes == round(4 * 16 * KiB * weight)
    assert sampled.count == round(4 * weight) == 66  # 64 blocks in truth
    assert sampled.oldest_age_seconds == 3600.0
    assert not big.estimated and (big.outstanding_bytes, big.count) == (2 * MiB, 2)
    assert not exact.estimated and (exact.outstanding_bytes, exact.count) == (3 * KiB, 3)
    assert [s.stack_id for s in report.suspects] == [9, 7, 0]  # by bytes: 2 MiB, ~1.06 MiB, 3 KiB


def test_only_blocks_passed_over_make_no_suspect_at_all():
    entries = [block(16 * KiB, sampled=False, ts=T0 - 3600 * NS) for _ in range(10)]
    report = find_suspects(entries, T0, 60, {}, {}, lambda stack_id: None)
    assert report.suspects == () and (report.allocations_considered, report.suspect_allocations) == (10, 10)


def test_flame_graph_of_sampled_blocks_weighs_estimates_and_says_so():
    stack = Stack(frames=(Frame("alloc", "model.py", 7),))
    entries = [block(16 * KiB, stack_id=7, sampled=True) for _ in range(2)]
    entries += [block(16 * KiB, sampled=False) for _ in range(30)]
    entries += [block(MiB, stack_id=7, sampled=True)]
    lines = folded_stacks(entries, {7: stack}.get, {}, (Layer.TORCH,))
    expected = round(2 * 16 * KiB / (1 - math.exp(-1 / 16)) + MiB)
    assert lines == [f"pid 200;GPU 0;alloc (model.py:7);[pytorch_malloc] {expected}"]
    assert not any(NO_STACK_FRAME in line for line in lines)
    assert estimated(entries, (Layer.TORCH,)) and not estimated(entries)  # blocks are not physical layers
    document = speedscope_document(entries, {7: stack}.get, {}, (Layer.TORCH,))
    assert document["name"].endswith(ESTIMATED_NOTE) and document["profiles"][0]["weights"] == [expected]
    exact = [block(16 * KiB, stack_id=7, sample_bytes=0), block(MiB, stack_id=7, sampled=True)]
    assert not estimated(exact, (Layer.TORCH,))
    assert not speedscope_document(exact, {7: stack}.get, {}, (Layer.TORCH,))["name"].endswith(ESTIMATED_NOTE)


def test_not_sampled_is_a_stack_status_of_its_own():
    assert StackStatus.NOT_SAMPLED.value == 7 and StackStatus(7) is StackStatus.NOT_SAMPLED
