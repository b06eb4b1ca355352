"""The in-flight batching runtime on the embedded SmolLM2 (CPU, fp32): batching,
preemption, prefix reuse and chunking must never change what greedy decoding produces."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest

from kiln import LLM, KvCacheConfig, SamplingParams
from kiln.config import SchedulerConfig

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "hex",
    "bright",
    "violet",
    "zebras",
    "near",
    "old",
    "stone",
    "bridges",
    "and",
    "rivers",
]


def prompts(n: int, seed: int = 0, prefix: str = "") -> list[str]:
    rng = random.Random(seed)
    return [
        prefix + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 48))) for _ in range(n)
    ]


def texts(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def new_llm(**kw) -> LLM:
    return LLM(progress=False, **kw)


@pytest.fixture(scope="module")
def alone_64(smollm2_llm: LLM) -> tuple[list[str], list[list[int]]]:
    ps = prompts(64)
    return ps, [smollm2_llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in ps]


def test_64_prompts_alone_equal_one_batch(alone_64) -> None:
    ps, alone = alone_64
    llm = new_llm(max_batch_size=64)
    outs = llm.generate(ps, GREEDY)
    assert texts(outs) == alone
    st = llm.stats()
    assert st.num_running == st.num_waiting == 0
    assert st.kv_cache_usage == 0.0


def test_preemption_changes_nothing(alone_64) -> None:
    ps, alone = alone_64
    llm = new_llm(
        max_batch_size=64,
        kv_cache_config=KvCacheConfig(max_tokens=1536),
        scheduler_config=SchedulerConfig("max_utilization"),
    )
    outs = llm.generate(ps, GREEDY)
    st = llm.stats()
    print(f"preemptions forced: {st.num_preemptions}")
    assert st.num_preemptions > 0
    assert texts(outs) == alone
    assert st.kv_cache_usage == 0.0


def test_block_reuse_saves_prefill_and_changes_nothing() -> None:
    system = " ".join(WORDS * 4) + ". "  # ~100 shared tokens
    ps = prompts(16, seed=3, prefix=system)
    on = new_llm(kv_cache_config=KvCacheConfig(enable_block_reuse=True), max_batch_size=4)
    off = new_llm(kv_cache_config=KvCacheConfig(enable_block_reuse=False), max_batch_size=4)
    got_on, got_off = texts(on.generate(ps, GREEDY)), texts(off.generate(ps, GREEDY))
    s_on, s_off = on.stats(), off.stats()
    print(
        f"prefill tokens: reuse {s_on.prompt_tokens_computed}, no reuse "
        f"{s_off.prompt_tokens_computed}; hit rate {s_on.prefix_cache_hit_rate:.2f}"
    )
    assert got_on == got_off
    assert s_on.prompt_tokens_computed < s_off.prompt_tokens_computed
    assert s_off.prefix_cache_hits == 0 and s_on.prefix_cache_hits > 0
    assert s_on.prompt_tokens_computed + s_on.prefix_cache_hits == s_off.prompt_tokens_computed
    # after a reset the same prompts find nothing of the first run, and come out the same
    assert on.reset_prefix_cache() > 0 and on.reset_prefix_cache() == 0
    hits = on.stats().prefix_cache_hits
    assert texts(on.generate(ps[:1], GREEDY)) == got_on[:1]
    assert on.stats().prefix_cache_hits == hits


def test_chunked_prefill_of_a_long_prompt(smollm2_llm: LLM) -> None:
    long = " ".join(WORDS * 10)  # ~250 tokens
    want = smollm2_llm.generate(long, GREEDY, use_tqdm=False)[0]
    chunked = new_llm(max_num_tokens=64, kv_cache_config=KvCacheConfig(enable_block_reuse=False))
    got = chunked.generate(long, GREEDY, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    n = len(got.prompt_token_ids)
    # ceil(n / 64) prefill chunks, the last of which samples the first token, then decodes
    assert chunked.stats().steps == -(-n // 64) + GREEDY.max_tokens - 1


def test_abort_mid_generation_returns_every_block(smollm2_llm: LLM) -> None:
    llm = smollm2_llm
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    async def main() -> list:
        async def consume(i: int, stop_after: int | None) -> object:
            last = None
            async for out in llm.generate_async(prompts(1, seed=i)[0], params, f"abort-{i}"):
                last = out
                if stop_after is not None and len(out.outputs[0].token_ids) >= stop_after:
                    llm.abort(f"abort-{i}")
            return last

        return await asyncio.gather(*(consume(i, 3 + i if i % 2 else None) for i in range(6)))

    outs = asyncio.run(main())
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "abort"] * 3
    assert llm.stats().kv_cache_usage == 0.0
    llm.core.blocks.check_invariants([])


def test_leaving_a_stream_early_aborts_it(smollm2_llm: LLM) -> None:
    llm = smollm2_llm
    params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)

    async def main() -> int:
        n = 0
        async for _ in llm.generate_async("Tell me a long story.", params):
            n += 1
            if n == 3:
                break
        while llm.core.has_unfinished():
            await asyncio.sleep(0.01)
        return n

    assert asyncio.run(main()) == 3
    assert llm.stats().kv_cache_usage == 0.0


def test_seeded_sample_is_the_same_alone_and_in_a_busy_batch(smollm2_llm: LLM) -> None:
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=77)
    alone = smollm2_llm.generate("Write a haiku about rain.", p, use_tqdm=False)[0]
    busy = prompts(12, seed=5)
    others = SamplingParams(max_tokens=24, temperature=1.0)
    outs = smollm2_llm.generate(
        [*busy[:6], "Write a haiku about rain.", *busy[6:]],
        [others] * 6 + [p] + [others] * 6,
        use_tqdm=False,
    )
    assert outs[6].outputs[0].text == alone.outputs[0].text
    assert outs[6].outputs[0].token_ids == alone.outputs[0].token_ids


def test_streamed_text_joins_to_the_final_text(smollm2_llm: LLM) -> None:
    p = SamplingParams(max_tokens=40, temperature=0, stop=["Paris"])

    async def main() -> list:
        return [
            o
            async for o in smollm2_llm.generate_async(
                "Question: What is the capital of France? Answer: The capital of France is", p
            )
        ]

    outs = asyncio.run(main())
    texts_seen = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts_seen))
    final = outs[-1].outputs[0]
    assert outs[-1].finished and final.finish_reason == "stop" and final.stop_reason == "Paris"
    assert "Paris" not in final.text
    m = outs[-1].metrics
    assert m.time_to_first_token >= m.queue_time >= 0
    assert len(m.token_times) == len(final.token_ids)


def test_n_sequences_share_the_prompt(smollm2_llm: LLM) -> None:
    p = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5)
    out = smollm2_llm.generate("Once upon a time", p, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    greedy = SamplingParams(n=2, max_tokens=8, temperature=0)
    g = smollm2_llm.generate("Once upon a time", greedy, use_tqdm=False)[0]
    assert g.outputs[0].token_ids == g.outputs[1].token_ids
    assert smollm2_llm.stats().kv_cache_usage == 0.0
