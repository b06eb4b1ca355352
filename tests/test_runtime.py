"""Sampling parameters, sampler and the batching loop, on the tiny dummy model (CPU)."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, ConfigError, KvCacheConfig, SamplingParams
from kiln.config import SchedulerConfig
from kiln.runtime.sampler import filter_logits


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("dummy:tiny", device="cpu", max_seq_len=256, max_batch_size=8, progress=False)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_sampling_params_reject_out_of_range(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}=.* is invalid: "):
        SamplingParams(**kwargs)


def test_top_k_and_top_p_filters() -> None:
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    kept = lambda x: torch.isfinite(x).nonzero().flatten().tolist()  # noqa: E731
    assert kept(filter_logits(logits, 2, 1.0)) == [0, 1]
    assert kept(filter_logits(logits, -1, 0.5)) == [0]  # 0.5 alone reaches top_p
    assert kept(filter_logits(logits, -1, 0.51)) == [0, 1]
    assert kept(filter_logits(logits, -1, 0.8)) == [0, 1, 2]
    assert kept(filter_logits(logits, 0, 1e-9)) == [0]  # the top token always survives


def test_greedy_is_deterministic_and_batch_independent(tiny: LLM) -> None:
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(40)), [9]]
    batched = [o.outputs[0].token_ids for o in tiny.generate(prompts, p)]
    alone = [tiny.generate([pr], p)[0].outputs[0].token_ids for pr in prompts]
    assert batched == alone
    assert all(len(t) == 12 for t in batched)


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny: LLM) -> None:
    p = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    alone = tiny.generate([[1, 2, 3]], p)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=20, temperature=0.8)
    batch = tiny.generate([[4, 4], [1, 2, 3], [8] * 30], [others, p, others])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=99)
    assert tiny.generate([[1, 2, 3]], other_seed)[0].outputs[0].token_ids != alone


def test_sampling_follows_the_distribution(tiny: LLM) -> None:
    """Draws from the sampler's Gumbel-max path land on tokens at their softmax rates: one
    sequence's noise stream, step after step (its number of output tokens moves it on)."""
    from kiln.runtime.sampler import Sampler
    from kiln.runtime.sequence import Sequence

    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    sampler = Sampler((), seed=0)
    seq = Sequence("0", [1], SamplingParams(temperature=1.0), 10)
    counts = torch.zeros(3)
    for _ in range(4000):
        tok = sampler(logits, [seq]).token_ids[0]
        counts[tok] += 1
        seq.output_token_ids.append(tok)
    freq = counts / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.03), freq


def test_stop_token_and_max_tokens_and_min_tokens(tiny: LLM) -> None:
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    toks = tiny.generate([[3, 1, 4]], greedy)[0].outputs[0].token_ids
    stop = toks[5]
    first = toks.index(stop)
    out = tiny.generate(
        [[3, 1, 4]], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop])
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == toks[: first + 1]
    out = tiny.generate([[3, 1, 4]], SamplingParams(max_tokens=7, temperature=0))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 7
    banned = SamplingParams(
        max_tokens=10, min_tokens=first + 3, temperature=0, stop_token_ids=[stop]
    )
    out = tiny.generate([[3, 1, 4]], banned)[0].outputs[0]
    assert stop not in out.token_ids[: first + 3]


def test_generation_stops_at_max_seq_len(tiny: LLM) -> None:
    prompt = list(range(250))
    out = tiny.generate([prompt], SamplingParams(max_tokens=100, temperature=0))[0].outputs[0]
    assert out.finish_reason == "length"
    assert len(prompt) + len(out.token_ids) == 256


def test_chunked_prefill_and_tiny_kv_cache_give_the_same_tokens(tiny: LLM) -> None:
    """max_num_tokens=16 splits prompts into chunks; a 6-block cache forces requests to
    wait for blocks. Greedy results equal the unconstrained engine's; every block returns."""
    small = LLM(
        "dummy:tiny",
        device="cpu",
        max_seq_len=256,
        max_batch_size=3,
        max_num_tokens=16,
        kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=96),
        progress=False,
    )
    p = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    prompts = [list(range(i, i + 3 + 7 * i)) for i in range(8)]
    want = [o.outputs[0].token_ids for o in tiny.generate(prompts, p)]
    got = [o.outputs[0].token_ids for o in small.generate(prompts, p)]
    assert got == want
    assert small.stats().kv_cache_usage == 0.0


def test_prompt_logprobs_in_row_chunks_across_prefill_chunks(tiny: LLM) -> None:
    """Prompt logprobs made a few rows at a time (5 here, across 16-token prefill steps and
    three requests a step) equal those made at once, and the teacher-forced reference."""
    from kiln.runtime.logprobs import PROMPT_LOGPROB_ROWS, prompt_logprob_rows

    from .util import prefill_logits

    assert prompt_logprob_rows(1) == PROMPT_LOGPROB_ROWS and prompt_logprob_rows(4096) == 4096
    assert tiny.core.prompt_logprob_rows == PROMPT_LOGPROB_ROWS  # more than any prompt here
    small = LLM("dummy:tiny", device="cpu", max_seq_len=256, max_batch_size=3,
                max_num_tokens=16, progress=False)  # fmt: skip
    small.core.prompt_logprob_rows = 5
    p = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=3)
    prompts = [[(7 * i + 3 * j) % 512 for j in range(n)] for i, n in enumerate((41, 2, 23))]
    chunked = [o.prompt_logprobs for o in small.generate(prompts, p)]
    whole = [o.prompt_logprobs for o in tiny.generate(prompts, p)]
    for prompt, got, want in zip(prompts, chunked, whole, strict=True):
        assert got is not None and want is not None and len(got) == len(prompt)
        assert got[0] is None and want[0] is None
        ref = prefill_logits(tiny.engine, prompt).log_softmax(-1)
        for i in range(1, len(prompt)):
            assert got[i].keys() == want[i].keys() and len(got[i]) >= 3, (i, got[i])
            for t, e in got[i].items():
                assert e.rank == want[i][t].rank, (i, t)
                assert abs(e.logprob - ref[i - 1, t].item()) < 1e-4, (i, t)
    assert small.stats().kv_cache_usage == 0.0


def test_bad_requests_are_refused_before_anything_runs(tiny: LLM) -> None:
    p = SamplingParams(max_tokens=4)
    with pytest.raises(ConfigError, match=r"prompt_token_ids=.*\[0, 512\)"):
        tiny.generate([[1, 512]], p)
    with pytest.raises(ConfigError, match="prompt_token_ids"):
        tiny.generate([[1, -3]], p)
    with pytest.raises(ConfigError, match="empty prompt"):
        tiny.generate([[]], p)
    with pytest.raises(ConfigError, match=r"max_seq_len is 256"):
        tiny.generate([list(range(300))], p)
    small = LLM(
        "dummy:tiny",
        device="cpu",
        max_seq_len=256,
        progress=False,
        kv_cache_config=KvCacheConfig(max_tokens=64),
    )
    with pytest.raises(ConfigError, match=r"max_tokens=100 is invalid: .* engine.s 64 tokens"):
        small.generate([[1, 2]], SamplingParams(max_tokens=100))
    assert tiny.stats().kv_cache_usage == 0.0


def test_blocks_return_when_the_model_fails_mid_run(tiny: LLM, monkeypatch) -> None:
    calls = {"n": 0}
    real = tiny.core.runner.execute

    def flaky(batch, *rest):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real(batch, *rest)

    monkeypatch.setattr(tiny.core.runner, "execute", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        tiny.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=8))
    assert tiny.stats().kv_cache_usage == 0.0
    monkeypatch.undo()
    assert len(tiny.generate([[1]], SamplingParams(max_tokens=3))[0].outputs[0].token_ids) >= 1


def test_text_prompts_use_byte_fallback_without_tokenizer(tiny: LLM) -> None:
    out = tiny.generate("héllo", SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.prompt == "héllo"
    assert out.prompt_token_ids == list("héllo".encode())
    assert isinstance(out.outputs[0].text, str)


def test_logprobs_and_prompt_logprobs_through_the_engine(tiny: LLM) -> None:
    """Sampled-token and prompt logprobs equal log_softmax of a teacher-forced prefill."""
    from .util import prefill_logits

    prompt = [5, 17, 3, 99, 42, 7]
    p = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = tiny.generate([prompt], p)[0]
    toks = out.outputs[0].token_ids
    ref = prefill_logits(tiny.engine, prompt + toks).log_softmax(-1)  # (L, V)
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    # a one-token prompt (no prefill step: its token is decoded at once) has [None] too
    assert tiny.generate([[5]], p)[0].prompt_logprobs == [None]
    for i in range(1, len(prompt)):
        entry = plp[i][prompt[i]]
        assert abs(entry.logprob - ref[i - 1, prompt[i]].item()) < 1e-4
        assert len(plp[i]) <= 3  # the actual token plus the top 2
    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == len(toks)
    for j, (tok, entry) in enumerate(zip(toks, lps, strict=True)):
        row = ref[len(prompt) - 1 + j]
        assert abs(entry[tok].logprob - row[tok].item()) < 1e-4
        assert entry[tok].rank == 1  # greedy picks the top token
        top3 = set(row.topk(3).indices.tolist())
        assert top3 <= set(entry)


def test_n_children_without_a_block_for_their_copy_compute_their_own_prompt(tiny: LLM) -> None:
    """max_utilization, 6 blocks of 16: A holds 3, B (n=3) takes 2 for its 20-token prompt;
    at the fork one block is left, so the third sequence queues and recomputes the prompt."""
    small = LLM(
        "dummy:tiny",
        device="cpu",
        max_seq_len=256,
        progress=False,
        kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=96),
        scheduler_config=SchedulerConfig("max_utilization"),
    )
    a, b = list(range(40)), list(range(100, 120))
    pa = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    pb = SamplingParams(n=3, max_tokens=10, temperature=0, ignore_eos=True)
    outs = small.generate([a, b], [pa, pb])
    assert small.core.num_fork_fallbacks > 0
    want_a = tiny.generate([a], pa)[0].outputs[0].token_ids
    want_b = tiny.generate([b], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert outs[0].outputs[0].token_ids == want_a
    assert [c.token_ids for c in outs[1].outputs] == [want_b[0].outputs[0].token_ids] * 3
    assert small.stats().kv_cache_usage == 0.0
    small.core.blocks.check_invariants([])


@pytest.mark.parametrize("stage", ["capture", "warmup"])
def test_load_out_of_memory_says_what_to_change(
    tiny: LLM, stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU load that runs out of memory warming kernels or capturing CUDA graphs (after
    the KV cache took its share) names the stage, the memory, and the settings to change
    (driven here on the CPU engine with the GPU calls stood in for)."""
    import kiln.llm as kl

    llm = tiny

    def oom(*a: object, **k: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 346.00 MiB.")

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (int(0.15 * 2**30), 80 << 30))
    if stage == "capture":
        monkeypatch.setattr(llm.core.runner, "capture_cuda_graphs", oom)
        want = "capturing the decode steps as CUDA graphs (batches of up to 8 sequences)"
    else:
        monkeypatch.setattr(kl, "warm_up_kernels", oom)
        want = "the kernel warm-up (batches of up to 8 sequences)"
    with pytest.raises(ConfigError) as info:
        llm._warm_and_capture(stage == "warmup", [1, 2, 8])
    msg = str(info.value)
    assert msg.startswith(want + " ran out of GPU memory: 0.1 of 80.0 GiB free"), msg
    cache = sum(t.numel() * t.element_size() for t in llm.kv.layers) / 2**30
    frac = "kv_cache_config.free_gpu_memory_fraction=0.9"
    assert f"the KV cache holding {cache:.1f} GiB ({frac})" in msg
    for knob in ("--kv-cache-max-tokens", "cuda_graph_batch_sizes", "enforce_eager=True"):
        assert knob in msg
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)


def test_kv_budget_counts_cached_bytes_but_keeps_a_step_free() -> None:
    from kiln.runtime.memory import kv_budget_bytes

    gib = 2**30
    # the first and second loads of the H100 measurement: the same room, the same budget
    first = kv_budget_bytes(60 * gib, 10 * gib + gib, 10 * gib, 9 * gib, 0.9)
    second = kv_budget_bytes(61 * gib, 10 * gib, 10 * gib, 9 * gib, 0.9)
    assert first == second == int(52 * gib * 0.9)
    # at fraction 1 the cached gigabyte is not lent out: a whole step's peak stays free
    assert kv_budget_bytes(60 * gib, 11 * gib, 10 * gib, 9 * gib, 1.0) == 51 * gib
    # the cap binds at 0.9 once the cached bytes pass about a ninth of the free ones
    assert kv_budget_bytes(20 * gib, 14 * gib, 10 * gib, 2 * gib, 0.9) == 18 * gib
    assert kv_budget_bytes(20 * gib, 11 * gib, 10 * gib, 2 * gib, 0.9) == int(19 * gib * 0.9)
    # no room: nothing, never a negative budget
    assert kv_budget_bytes(gib, 0, 0, 2 * gib, 0.9) == 0
