"""Whole prompts over an fp8 cache attend over their own keys and values as computed
(``fresh_kv``), not as the cache rounds them; prompts with a cached prefix and decode
tokens still read the cache. The kernels run under the Triton interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.kernels import attention as attn
from kiln.kernels.attention import paged_attention_ref
from kiln.kernels.prefill_attention import prefill_attention_triton
from kiln.layers import attention as layer_attention
from tests.test_gpu_fastpath import small_llama3  # noqa: F401
from tests.test_kv_fp8 import DEV, _dequantized, _fp8_cache, _meta

HQ, HK, D = 4, 2, 16
# whole prompts (new == context), a chunk after a 27-token prefix, a decode token
NEW, CTX = [20, 3, 9, 1, 33], [20, 30, 9, 14, 33]
WHOLE = [0, 2, 4]


def _case(dtype: torch.dtype, bs: int):
    torch.manual_seed(5)
    nblocks = sum(-(-c // bs) for c in CTX) + 1
    scales = torch.tensor([0.02, 0.3], device=DEV)
    cache = _fp8_cache(nblocks, bs, HK, D, scales)
    meta = _meta(NEW, CTX, bs, nblocks)
    t = sum(NEW)
    q = torch.randn(t, HQ, D, device=DEV).to(dtype)
    # the step's keys and values as computed, laid out as in qkv: (T, Hk, D) views of rows
    qkv = (torch.randn(t, (HQ + 2 * HK) * D, device=DEV) * 3).to(dtype)
    kf = qkv[:, HQ * D : (HQ + HK) * D].view(t, HK, D)
    vf = qkv[:, (HQ + HK) * D :].view(t, HK, D)
    # reference cache: the fp8 cache dequantized, the whole prompts' slots holding kf / vf
    fresh = _dequantized(cache, scales).clone()
    starts = meta.query_start_loc_cpu
    for i in WHOLE:
        for p in range(CTX[i]):
            blk = int(meta.block_tables[i, p // bs])
            fresh[0, blk, p % bs] = kf[starts[i] + p].float()
            fresh[1, blk, p % bs] = vf[starts[i] + p].float()
    ref_fresh = paged_attention_ref(q, fresh, meta, D**-0.5)
    ref_cache = paged_attention_ref(q, _dequantized(cache, scales), meta, D**-0.5)
    return cache, scales, meta, q, (kf, vf), ref_fresh, ref_cache


def _rows(seqs: list[int]) -> list[int]:
    starts = [0]
    for n in NEW:
        starts.append(starts[-1] + n)
    return [r for i in seqs for r in range(starts[i], starts[i + 1])]


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # probabilities round to bfloat16 before the PV dot
        err = (out.float() - ref.float()).abs() / ref.float().abs().max()
        assert float(err.max()) <= 2**-6 and float(err.mean()) <= 2**-9, (err.max(), err.mean())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [8, 12, 16])
def test_kernel_reads_whole_prompts_fresh(dtype: torch.dtype, bs: int) -> None:
    cache, scales, meta, q, fresh_kv, ref_fresh, ref_cache = _case(dtype, bs)
    out = torch.full_like(q, float("nan"))
    rows = torch.tensor(WHOLE, dtype=torch.int32, device=DEV)
    prefill_attention_triton(
        q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out, D**-0.5,
        max(NEW[i] for i in WHOLE), None, rows, BLOCK_M=16, BLOCK_N=16, kv_scale=scales,
        fresh_kv=fresh_kv,
    )  # fmt: skip
    whole = _rows(WHOLE)
    _close(out[whole], ref_fresh[whole], dtype)
    # not the cache's values: the fp8 rounding would differ by far more than the tolerance
    assert float((ref_fresh[whole] - ref_cache[whole]).abs().max()) > 0.1
    others = [r for r in range(q.shape[0]) if r not in whole]
    assert bool(out[others].isnan().all())  # only the rows asked for are written


def test_split_rows_whole_and_rest() -> None:
    _, _, meta, *_ = _case(torch.float32, 8)
    split = meta.split_rows()
    assert split.whole == WHOLE and split.decode == [3] and split.prefill == [0, 1, 2, 4]
    assert split.whole_rows.tolist() == WHOLE and split.rest_rows.tolist() == [1]
    assert (split.whole_max_new, split.rest_max_new) == (33, 3)
    only = _meta([5, 7], [5, 7], 8, 3).split_rows()  # all whole: no row lists at all
    assert only.whole == [0, 1] and only.whole_rows is None and only.rest_rows is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatcher_mixed_step(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of whole prompts, a continued prompt and a decode token through the
    dispatcher's Triton path: whole prompts from ``fresh_kv``, the rest from the cache;
    without ``fresh_kv`` every row from the cache."""
    # a GPU's decode attention needs blocks of at least 16 tokens (tl.dot tiles)
    cache, scales, meta, q, fresh_kv, ref_fresh, ref_cache = _case(
        dtype, 16 if DEV == "cuda" else 8
    )
    monkeypatch.setattr(attn, "use_triton", lambda x: True)
    monkeypatch.setattr(attn, "tuned", lambda name: {"BLOCK_M": 16, "BLOCK_N": 16})
    out = attn.paged_attention(q, cache, meta, D**-0.5, None, scales, fresh_kv=fresh_kv)
    whole, rest = _rows(WHOLE), _rows([1, 3])
    _close(out[whole], ref_fresh[whole], dtype)
    _close(out[rest], ref_cache[rest], dtype)
    meta._split = None
    out = attn.paged_attention(q, cache, meta, D**-0.5, None, scales)
    _close(out, ref_cache, dtype)


@pytest.mark.gpu
def test_engine_prompts_skip_the_fp8_rounding(
    small_llama3,  # noqa: F811
    tmp_path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """End to end: an fp8-KV engine's prompt logprobs, whole prompts attending over their
    own K/V, are much closer to a bf16-KV engine's (same weights) than with every read
    through the fp8 cache, whose rounding they then skip."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    gen = torch.Generator().manual_seed(11)
    seqs = [[int(t) for t in torch.randint(5, 500, (n,), generator=gen)] for n in (90, 200, 333)]
    score = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=0)
    kw = dict(device="cuda", dtype="bfloat16", max_seq_len=1024, progress=False)

    def lps(llm: LLM) -> torch.Tensor:
        outs = llm.generate(seqs, score, use_tqdm=False)
        pairs = [(s, o) for s, o in zip(seqs, outs, strict=True)]
        return torch.tensor(
            [o.prompt_logprobs[i][s[i]].logprob for s, o in pairs for i in range(1, len(s))]
        )

    plain = lps(LLM(str(small_llama3), **kw))
    fp8 = LLM(str(small_llama3), kv_cache_dtype="fp8", **kw)
    fresh = lps(fp8)
    monkeypatch.setattr(layer_attention, "FRESH_PREFILL", False)
    cached = lps(fp8)
    d_fresh, d_cached = (fresh - plain).abs(), (cached - plain).abs()
    assert float(d_cached.mean()) > 0  # the cache's rounding shows
    assert float(d_fresh.mean()) < 0.5 * float(d_cached.mean()), (d_fresh.mean(), d_cached.mean())
