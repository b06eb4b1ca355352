"""Overlapped stepping (the host finishes step N while the device runs step N+1) gives the
same results as plain stepping: tokens, text, finish reasons, logprobs, and every block
back. On the CPU nothing actually overlaps, but every code path (placeholders, tokens
patched in on the device, late finishes, discarded extra tokens) runs the same way."""

from __future__ import annotations

import pytest

from kiln import LLM, KvCacheConfig, SamplingParams
from kiln.config import SchedulerConfig


def _both(llm: LLM, prompts: list, params: list[SamplingParams]) -> tuple[list, list]:
    old = llm.core.overlap
    try:
        llm.core.overlap = False
        plain = llm.generate(prompts, params, use_tqdm=False)
        llm.core.overlap = True
        steps0 = llm.core.steps
        over = llm.generate(prompts, params, use_tqdm=False)
        assert llm.core.steps > steps0
    finally:
        llm.core.overlap = old
    assert llm.stats().kv_cache_usage == 0.0
    llm.core.blocks.check_invariants([])
    return plain, over


def _same(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        assert len(x.outputs) == len(y.outputs)
        for c, d in zip(x.outputs, y.outputs, strict=True):
            assert c.token_ids == d.token_ids
            assert c.text == d.text
            assert (c.finish_reason, c.stop_reason) == (d.finish_reason, d.stop_reason)
            assert c.logprobs == d.logprobs


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("dummy:tiny", device="cpu", max_seq_len=256, max_batch_size=16, progress=False)


def test_greedy_sampled_and_mixed_requests(tiny: LLM) -> None:
    prompts = [list(range(3 + i, 3 + i + 1 + 7 * i % 40)) for i in range(24)]
    # stops that will fire: a token and a character greedy decoding produces a few steps in
    probe = tiny.generate(prompts, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    params = []
    for i in range(24):
        kind = i % 6
        if kind == 0:
            p = SamplingParams(max_tokens=1 + i, temperature=0)
        elif kind == 1:
            p = SamplingParams(max_tokens=20, temperature=0.9, seed=i, logprobs=3)
        elif kind == 2:  # penalties: these steps are read back before the next launch
            p = SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.3)
        elif kind == 3:  # n > 1 forks
            p = SamplingParams(max_tokens=12, temperature=0.7, seed=i, n=3)
        elif kind == 4:
            text = probe[i].outputs[0].text
            mid = len(text) // 2
            stop = [text[mid : mid + 2]] if text.strip() else None
            p = SamplingParams(max_tokens=30, temperature=0, min_tokens=2, stop=stop)
        else:
            tok = probe[i].outputs[0].token_ids[4]
            p = SamplingParams(max_tokens=25, temperature=0, stop_token_ids=[tok])
        params.append(p)
    plain, over = _both(tiny, prompts, params)
    _same(plain, over)
    stops = [o.outputs[0].stop_reason for o in plain[4::6] + plain[5::6]]
    assert sum(r is not None for r in stops) >= 4, stops  # stop strings and ids did fire


def test_preemption_under_overlap() -> None:
    llm = LLM(
        "dummy:tiny",
        device="cpu",
        max_seq_len=256,
        max_batch_size=16,
        progress=False,
        kv_cache_config=KvCacheConfig(max_tokens=384, tokens_per_block=16),
        scheduler_config=SchedulerConfig("max_utilization"),
    )
    prompts = [list(range(i, i + 30 + 5 * i)) for i in range(12)]
    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain, over = _both(llm, prompts, [p] * 12)
    _same(plain, over)
    assert llm.stats().num_preemptions > 0


def test_abort_while_a_token_is_in_flight(tiny: LLM) -> None:
    core = tiny.core
    core.overlap = True
    try:
        reqs = [
            core.make_request(list(range(5 + i)), SamplingParams(max_tokens=50, ignore_eos=True))
            for i in range(6)
        ]
        for r in reqs:
            core.add_request(r)
        for _ in range(6):
            core.step()
        assert core._in_flight is not None  # a launched step is still unread
        for r in reqs[::2]:
            core.abort(r.request_id)
        outs = {}
        while core.has_unfinished():
            for o in core.step():
                outs[o.request_id] = o
        for i, r in enumerate(reqs):
            o = outs[r.request_id]
            assert o.finished
            toks = o.outputs[0].token_ids
            assert -1 not in toks
            if i % 2 == 0:
                assert o.outputs[0].finish_reason == "abort" and len(toks) < 50
            else:
                assert len(toks) == 50
        assert tiny.stats().kv_cache_usage == 0.0
        core.blocks.check_invariants([])
    finally:
        core.overlap = False


def test_smollm2_text_and_stop_strings(smollm2_llm: LLM) -> None:
    prompts = ["The capital of France is", "List three colors:", "1, 2, 3,"]
    params = [
        SamplingParams(max_tokens=24, temperature=0),
        SamplingParams(max_tokens=24, temperature=0, stop=[","]),
        SamplingParams(max_tokens=24, temperature=0.8, seed=3, logprobs=2),
    ]
    plain, over = _both(smollm2_llm, prompts, params)
    _same(plain, over)
