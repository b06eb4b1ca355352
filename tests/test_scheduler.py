"""Block manager and scheduler without a model: a fake step appends token 7 to every
sequence whose logits would be sampled. Invariants are checked after every step."""

from __future__ import annotations

import random

import pytest

from kiln.config import SchedulerConfig
from kiln.runtime.block_manager import BlockManager
from kiln.runtime.scheduler import Scheduler
from kiln.runtime.sequence import Sequence
from kiln.sampling_params import SamplingParams


def make(prompt_len: int, max_tokens: int, rid: str = "r", first_token: int = 0) -> Sequence:
    prompt = list(range(first_token, first_token + prompt_len))
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens), prompt_len + max_tokens)


def run(sched: Scheduler, seqs: list[Sequence], max_steps: int = 10_000) -> dict[str, int]:
    """Drive to completion; return counters. Checks every invariant on every step."""
    for s in seqs:
        sched.add(s)
    stats = {"steps": 0, "prefill_tokens": 0, "max_batch": 0, "max_tokens_step": 0}
    live = list(seqs)
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.scheduled or out.refused, "no progress: the scheduler would hang"
        stats["steps"] += 1
        stats["prefill_tokens"] += out.num_prefill_tokens
        stats["max_batch"] = max(stats["max_batch"], len(out.scheduled))
        stats["max_tokens_step"] = max(stats["max_tokens_step"], out.num_tokens)
        assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
        for s in out.scheduled:
            done = s.completes
            s.seq.num_computed += s.num_new_tokens
            sched.blocks.commit_full_blocks(s.seq)
            assert len(s.seq.block_ids) * sched.blocks.tokens_per_block >= s.seq.num_computed
            if done:
                s.seq.output_token_ids.append(7)
                if len(s.seq.output_token_ids) >= s.seq.params.max_tokens:
                    s.seq.finish_reason = "length"
                    sched.finish(s.seq)
        sched.blocks.check_invariants([s for s in live if not s.finished])
        assert stats["steps"] < max_steps
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks
    sched.blocks.check_invariants([])
    return stats


def scheduler(
    num_blocks: int,
    policy: str = "guaranteed_no_evict",
    reuse: bool = True,
    batch: int = 8,
    tokens: int = 64,
    bs: int = 4,
) -> Scheduler:
    bm = BlockManager(num_blocks, bs, enable_block_reuse=reuse)
    return Scheduler(SchedulerConfig(policy), bm, batch, tokens)


def test_token_budget_and_batch_size_hold_and_everything_finishes() -> None:
    sched = scheduler(200, batch=5, tokens=16)
    seqs = [make(random.Random(i).randint(1, 40), 5, f"r{i}", 1000 * i) for i in range(20)]
    stats = run(sched, seqs)
    assert stats["max_batch"] <= 5
    assert stats["max_tokens_step"] <= 16
    assert all(len(s.output_token_ids) == 5 for s in seqs)
    assert sched.num_preemptions == 0


def test_chunked_prefill_splits_a_long_prompt() -> None:
    sched = scheduler(100, tokens=10)
    seq = make(35, 2)
    sched.add(seq)
    chunks = []
    while seq.num_computed < 35:
        out = sched.schedule()
        chunks.append(out.scheduled[0].num_new_tokens)
        seq.num_computed += chunks[-1]
    assert chunks == [10, 10, 10, 5]


def test_guaranteed_no_evict_never_preempts_and_waits_for_room() -> None:
    # 12 blocks of 4 tokens; each request may need ceil((10 + 10) / 4) = 5 blocks, so only
    # two run at a time even though their prompts alone would let four in
    sched = scheduler(12)
    stats = run(sched, [make(10, 10, f"r{i}", 100 * i) for i in range(5)])
    assert sched.num_preemptions == 0
    assert stats["max_batch"] == 2


def test_max_utilization_preempts_the_newest_and_recomputes() -> None:
    sched = scheduler(12, policy="max_utilization")
    seqs = [make(10, 10, f"r{i}", 100 * i) for i in range(5)]
    run(sched, seqs)
    assert sched.num_preemptions > 0
    assert all(len(s.output_token_ids) == 10 for s in seqs)
    assert sum(s.num_preemptions for s in seqs) == sched.num_preemptions


def test_a_request_that_can_never_fit_is_refused_at_once() -> None:
    sched = scheduler(4)  # 16 tokens of cache
    big, small = make(30, 5, "big"), make(3, 2, "small", 500)
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    assert out.refused == [big] and big.finish_reason == "error"
    assert [s.seq for s in out.scheduled] == [small]


@pytest.mark.parametrize("reuse", [True, False])
def test_prefix_reuse_shares_full_blocks_and_saves_prefill(reuse: bool) -> None:
    sched = scheduler(64, reuse=reuse)
    first = make(18, 2, "a")  # blocks [0..3], [4..7], [8..11], [12..15] full; 16, 17 partial
    run(sched, [first])
    second = make(18, 2, "b")  # the same prompt
    sched.add(second)
    out = sched.schedule()
    expected_cached = 16 if reuse else 0
    assert second.num_cached_tokens == expected_cached
    assert out.scheduled[0].num_new_tokens == 18 - expected_cached
    assert sched.blocks.prefix_hits == expected_cached


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    sched = scheduler(64)
    run(sched, [make(16, 1, "a")])
    again = make(16, 1, "b")
    sched.add(again)
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 4  # the last block is recomputed
    assert again.num_cached_tokens == 12


def test_reset_prefix_cache_forgets_free_blocks_and_keeps_held_ones() -> None:
    sched = scheduler(64)
    run(sched, [make(18, 2, "a")])  # 4 full blocks cached, all free again
    held = make(12, 2, "h", 500)  # 3 full blocks, still held while the cache is reset
    sched.add(held)
    out = sched.schedule()
    held.num_computed += out.scheduled[0].num_new_tokens
    sched.blocks.commit_full_blocks(held)
    assert len(sched.blocks.cached) == 4 + 3
    assert sched.blocks.reset_prefix_cache() == 4
    assert sched.blocks.reset_prefix_cache() == 0
    assert len(sched.blocks.cached) == 3
    again = make(18, 2, "b")  # a's prompt: nothing of it is found now
    sched.add(again)
    sched.schedule()
    assert again.num_cached_tokens == 0
    twin = make(12, 2, "t", 500)  # the held prompt's blocks are still shared (its last
    # block is recomputed, as every prompt's last token is)
    sched.add(twin)
    sched.schedule()
    assert twin.num_cached_tokens == 8
    sched.blocks.check_invariants([held, again, twin])


def test_lru_eviction_of_unreferenced_cached_blocks() -> None:
    """a's 4 full blocks stay cached after it ends; b then needs 9 of the 10 blocks and takes
    the never-cached ones first, then a's blocks tail first: only a's first block survives."""
    sched = scheduler(10)  # 40 tokens
    run(sched, [make(16, 1, "a")])
    assert len(sched.blocks.cached) == 4
    run(sched, [make(33, 1, "b", 1000)])
    again = make(16, 1, "c")
    sched.add(again)
    sched.schedule()
    assert again.num_cached_tokens == 4


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    bm = BlockManager(16, 4)
    parent = make(10, 3)
    bm.start(parent, [])
    assert bm.grow(parent, 10)
    parent.num_computed = 10
    bm.commit_full_blocks(parent)
    child = make(10, 3, "r")
    copy = bm.fork(parent, child)
    assert child.block_ids[:2] == parent.block_ids[:2]
    assert copy == (parent.block_ids[2], child.block_ids[2])
    assert bm.ref[parent.block_ids[0]] == 2 and bm.ref[parent.block_ids[2]] == 1
    bm.check_invariants([parent, child])
    bm.free_sequence(parent)
    bm.free_sequence(child)
    bm.check_invariants([])
    assert bm.num_free_blocks == 16


def test_random_workload_keeps_invariants() -> None:
    rng = random.Random(0)
    for policy in ("guaranteed_no_evict", "max_utilization"):
        sched = scheduler(40, policy=policy, batch=6, tokens=24)
        shared = list(range(12))
        seqs = []
        for i in range(30):
            s = make(rng.randint(1, 30), rng.randint(1, 12), f"{policy}{i}", 100 * i)
            if rng.random() < 0.5:  # half share a prefix, so blocks get reused
                s.prompt_token_ids = shared + s.prompt_token_ids
                s.max_total_len += len(shared)
            seqs.append(s)
        run(sched, seqs)
        assert all(s.finished for s in seqs)
