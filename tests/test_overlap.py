"""Overlapped stepping (the host finishes step N while the device runs step N+1) gives the
same results as plain stepping: tokens, text, finish reasons, logprobs, and every block
back. On the CPU nothing actually overlaps, but every code path (placeholders, tokens
resolved on the device by the embedding, late finishes, discarded extra tokens) runs the
same way."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, KvCacheConfig, SamplingParams
from kiln.config import SchedulerConfig
from kiln.kernels.attention import AttentionMetadata
from kiln.runtime.cuda_graphs import DecodeGraphs


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


def _same(a: list, b: list, logprob_atol: float = 0.0) -> None:
    """Equal outputs; logprob values within ``logprob_atol`` (0: bit for bit), with the same
    tokens and ranks at every position."""
    for x, y in zip(a, b, strict=True):
        for c, d in zip(x.outputs, y.outputs, strict=True):
            assert c.token_ids == d.token_ids
            assert c.text == d.text
            assert (c.finish_reason, c.stop_reason) == (d.finish_reason, d.stop_reason)
            if not logprob_atol or c.logprobs is None or d.logprobs is None:
                assert c.logprobs == d.logprobs
                continue
            for p, q in zip(c.logprobs, d.logprobs, strict=True):
                assert p.keys() == q.keys()
                for t in p:
                    assert (p[t].rank, p[t].decoded_token) == (q[t].rank, q[t].decoded_token)
                    assert abs(p[t].logprob - q[t].logprob) <= logprob_atol, (t, p[t], q[t])


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


def _tight(**kw: int) -> LLM:
    """An engine whose 384-token cache preempts (max_utilization: the newest first)."""
    return LLM("dummy:tiny", device="cpu", max_seq_len=256, max_batch_size=16, progress=False,
               kv_cache_config=KvCacheConfig(max_tokens=384, tokens_per_block=16),
               scheduler_config=SchedulerConfig("max_utilization"), **kw)  # fmt: skip


def test_preemption_under_overlap() -> None:
    llm = _tight()
    prompts = [list(range(i, i + 30 + 5 * i)) for i in range(12)]
    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain, over = _both(llm, prompts, [p] * 12)
    _same(plain, over)
    assert llm.stats().num_preemptions > 0


def test_prompt_logprobs_survive_preemption_mid_prompt(tiny: LLM) -> None:
    """Sequences preempted while (or after) computing their prompts recompute it in steps
    of 24 tokens that need not match the first time's: every prompt position still gets
    its logprob once, equal to a roomy engine's, with plain and overlapped stepping (the
    logprobs stay on the device until their step is read back). Before, a recomputation
    whose first chunk ended inside the known positions lost the rest of the prompt's."""
    llm = _tight(max_num_tokens=24)
    prompts = [list(range(i, i + 30 + 9 * i)) for i in range(12)]
    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=2)
    preempted = llm.stats().num_preemptions
    plain, over = _both(llm, prompts, [p] * 12)
    assert llm.stats().num_preemptions - preempted >= 20  # in both runs, prompts among them
    _same(plain, over)
    roomy = tiny.generate(prompts, p, use_tqdm=False)
    for prompt, want, *runs in zip(prompts, roomy, plain, over, strict=True):
        assert want.prompt_logprobs is not None
        for run in runs:  # batches differ, and with them the CPU's float rounding a little
            got = run.prompt_logprobs
            assert got is not None and len(got) == len(prompt) and got[0] is None
            for i in range(1, len(prompt)):
                w = want.prompt_logprobs[i]
                assert got[i].keys() == w.keys() and prompt[i] in got[i], (i, got[i])
                for t, e in got[i].items():
                    assert e.rank == w[t].rank and abs(e.logprob - w[t].logprob) < 1e-4, (i, t)


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


class _Replay:
    """A captured graph's stand-in on the CPU: replaying runs the same forward on the same
    static inputs into the same shared logits buffer."""

    def __init__(self, graphs: DecodeGraphs, b: int) -> None:
        self.graphs, self.b = graphs, b

    def replay(self) -> None:
        self.graphs._forward(self.b)


class _CpuGraphs(DecodeGraphs):
    def _meta(self, b: int) -> AttentionMetadata:
        # the CPU reference attention reads the host's context lengths, which a graph
        # cannot have: the stand-in reads them from the static inputs at replay
        meta = super()._meta(b)
        meta.seq_lens_cpu = self.inputs.views(b)[3].tolist()
        return meta

    def capture(self) -> None:
        self.inputs.reset(self.kv.null_block, self.kv.tokens_per_block)
        vocab = self.model.config.vocab_size
        self.logits = torch.empty(self.max_batch, vocab)
        for b in self.batch_sizes:
            self.graphs[b] = (_Replay(self, b), self.logits[:b])  # type: ignore[assignment]


def test_graph_inputs_and_prev_tokens_through_replays() -> None:
    """The CUDA graphs' data flow on the CPU, with replay stand-ins: packed inputs per batch
    size, padding rows, the sampler writing into ``prev`` (``out=``) and the next replay's
    embedding resolving the placeholders there, mixed with eager (prefill) steps that read
    them too. Greedy and seeded sampled tokens equal plain eager stepping's."""
    llm = LLM("dummy:tiny", device="cpu", max_seq_len=256, max_batch_size=8, progress=False)
    prompts = [list(range(5 + i, 5 + i + 3 + 5 * i % 17)) for i in range(11)]
    params = [
        SamplingParams(max_tokens=9 + i % 4, temperature=0.8 if i % 2 else 0.0, seed=i,
                       logprobs=2 if i % 3 == 0 else None)
        for i in range(11)
    ]  # fmt: skip
    llm.core.overlap = False
    plain = llm.generate(prompts, params, use_tqdm=False)
    runner = llm.core.runner
    runner.graphs = _CpuGraphs(runner.model, runner.kv, runner.device, 256, [1, 2, 4, 8])
    runner.graphs.capture()
    prevs = []
    sample = llm.core.sampler.sample_async

    def spy(logits, seqs, out=None):
        prevs.append(out is not None and out.data_ptr() == runner.graphs.inputs.prev.data_ptr())
        return sample(logits, seqs, out)

    llm.core.sampler.sample_async = spy
    try:
        llm.core.overlap = True
        graph0 = runner.graph_steps
        over = llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.graphs = None
        del llm.core.sampler.sample_async
    assert runner.graph_steps - graph0 >= 8 and all(prevs)
    # the replays run padded batches (1, 2, 4, 8 rows): a CPU BLAS may sum a row otherwise
    # at another row count (seen: 5e-7 on an AVX2-only EPYC), so logprobs match to 1e-5
    _same(plain, over, logprob_atol=1e-5)
    assert llm.stats().kv_cache_usage == 0.0
