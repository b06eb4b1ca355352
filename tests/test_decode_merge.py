"""Decode attention with the splits merged by the split that finishes last
(``KILN_DECODE_FUSED_MERGE``, ``decode_attention_triton(fused_merge=True)``): the output
is the reference's, no reduction kernel is launched, and every counter is back at zero
after each call, so the next call (a CUDA graph's next replay) starts clean. And with
rotary and the new K / V write in decode attention (``KILN_DECODE_ROPE``, ``rope=``): the
output and the cache are the rotary reference's then attention's, in the kernel and in
the attention layer. On the CPU the interpreter runs the programs one after another; the
GPU tests run them at once, in a graph replayed several times. The sm_90 compiles (one
gpu-scope acquire-release atomic behind a CTA barrier, the partials read past L1; the
rotary path's registers) are checked in ``tests/test_decode_sm90.py``."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import decode_attention as da
from kiln.kernels import decode_tiles
from kiln.kernels.attention import paged_attention_ref
from tests.decode_cases import DEV, decode_batch, spy_launches

# the interpreter writes the reference's cache bit for bit; compiled for a GPU the rotation
# contracts into FMAs, a float32 ulp away (2.4e-7 at most on an H100)
CACHE_ATOL = 0.0 if DEV == "cpu" else 1e-6


def _batch(ctx: list[int], bs: int, hk: int, hq: int, d: int, dtype: torch.dtype,
           width: int | None = None) -> tuple:  # fmt: skip
    """``decode_batch``'s cache and metadata."""
    _, cache, _, _, meta = decode_batch(ctx, bs, hk, hq, d, dtype, width=width)
    return cache, meta


def _spy(monkeypatch) -> list[tuple[str, object]]:
    """Records each launch of the partial kernel (with its FUSE) and of the reduction."""
    return spy_launches(monkeypatch, da, {"partial": "_decode_partial",
                                          "reduce": "_decode_reduce"}, "FUSE")  # fmt: skip


def _counters_zero(device: torch.device) -> bool:
    return all(int(c.abs().sum()) == 0 for c in decode_tiles._COUNTERS.get(device, []))


@pytest.mark.parametrize(
    "splits,window,nb", [(2, None, 1), (3, 5, 2), (5, None, 2), (16, None, 1), (16, 5, 1)]
)
def test_fused_merge_matches_the_reference(splits: int, window: int | None, nb: int,
                                           monkeypatch) -> None:  # fmt: skip
    """Three query heads a kv head (the merge's head tile padded to four), odd contexts
    from one token, more splits than some sequences have chunks; two calls on fresh
    queries, each equal to the reference, the counters zero after each. (Blocks of four
    tokens, four a step, a bound of 160 tokens: 2, 3, 5 and 10 splits of the ten chunks
    in the interpreter, ten merged eight at a time.)"""
    torch.manual_seed(splits + 10 * nb)
    launched = _spy(monkeypatch)
    hk, hq, d, bs = 2, 6, 16, 4
    ctx = [1, 7, 8, 9, 30, 61]
    cache, meta = _batch(ctx, bs, hk, hq, d, torch.float32)
    tok = torch.arange(len(ctx), device=DEV)
    for call in range(2):
        q = torch.randn(len(ctx), hq, d, device=DEV)
        out = torch.full_like(q, float("nan"))
        da.decode_attention_triton(q, cache, meta.block_tables, meta.seq_lens, tok, out,
                                   d**-0.5, 160, window, splits, blocks_per_step=nb,
                                   fused_merge=True)  # fmt: skip
        ref = paged_attention_ref(q, cache, meta, d**-0.5, window)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        assert _counters_zero(q.device), f"call {call}: a counter was left set"
    assert launched == [("partial", True)] * 2


def test_fused_merge_off_by_default_and_not_for_one_split(monkeypatch) -> None:
    """``FUSED_MERGE`` 0 (the default): the reduction kernel merges; one split writes the
    output itself either way (``DIRECT``), with no counter."""
    launched = _spy(monkeypatch)
    cache, meta = _batch([5, 9], 4, 1, 2, 16, torch.float32)
    q = torch.randn(2, 2, 16, device=DEV)
    tok = torch.arange(2, device=DEV)
    args = (q, cache, meta.block_tables, meta.seq_lens, tok, torch.empty_like(q), 0.25, 64)
    assert da.FUSED_MERGE == 0
    da.decode_attention_triton(*args, None, 2)
    da.decode_attention_triton(*args, None, 1, fused_merge=True)
    monkeypatch.setattr(da, "FUSED_MERGE", 1)
    da.decode_attention_triton(*args, None, 2)
    assert launched == [("partial", False), ("reduce", None), ("partial", False),
                        ("partial", True)]  # fmt: skip


def test_fused_merge_over_an_fp8_cache() -> None:
    """Over an fp8 cache (v scale applied to each split's partial before the merge): the
    same output as the reduction kernel's, to float32 rounding."""
    from kiln.kernels.attention import KV_FP8

    torch.manual_seed(4)
    hk, hq, d, bs = 2, 8, 16, 4
    ctx = [3, 17, 40]
    cache, meta = _batch(ctx, bs, hk, hq, d, torch.float32)
    cache = (cache * 60).clamp(-448, 448).to(KV_FP8)
    scales = torch.tensor([0.02, 0.3], device=DEV)
    q = torch.randn(len(ctx), hq, d, device=DEV)
    tok = torch.arange(len(ctx), device=DEV)
    outs = []
    for fused in (False, True):
        out = torch.empty_like(q)
        da.decode_attention_triton(q, cache, meta.block_tables, meta.seq_lens, tok, out,
                                   d**-0.5, 40, None, 4, kv_scale=scales,
                                   fused_merge=fused)  # fmt: skip
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    assert _counters_zero(q.device)


def test_merge_counters_grow_and_keep_the_old() -> None:
    """A request past the buffer makes a larger one (zeros) and keeps the old, which CUDA
    graphs captured earlier still use; smaller requests get the newest."""
    dev = torch.device("meta")  # a device of its own: the other tests' buffers untouched
    try:
        a = decode_tiles.merge_counters(dev, 10)
        assert a.numel() == 4096 and a.dtype == torch.int32
        assert decode_tiles.merge_counters(dev, 4096) is a
        b = decode_tiles.merge_counters(dev, 5000)
        assert b.numel() == 5000 and decode_tiles._COUNTERS[dev] == [a, b]
        assert decode_tiles.merge_counters(dev, 7) is b
    finally:
        decode_tiles._COUNTERS.pop(dev, None)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_fused_merge_in_a_replayed_cuda_graph(fp8: bool) -> None:
    """Llama-3.1-8B's heads, the engine's limit as ``max_seq_len`` (many splits, most
    idle at short contexts), contexts 1 to 4,096: a CUDA graph of several layers' calls
    (the counters shared) replayed five times, each replay equal to the reference and to
    the reduction kernel's output, the counters zero after."""
    torch.manual_seed(6)
    bs, hk, hq, d = 32, 8, 32, 128
    ctx = [1, 31, 33, 150, 257, 1000, 4096]
    cache, meta = _batch(ctx, bs, hk, hq, d, torch.bfloat16, width=8192 // bs)
    scales = None
    if fp8:
        from kiln.kernels.attention import KV_FP8, dequantize_cache

        cache = (cache.float() * 8).clamp(-448, 448).to(KV_FP8)
        scales = torch.tensor([0.02, 0.05], device=DEV)
    n = len(ctx)
    tok = torch.arange(n, device=DEV)
    qs = [torch.randn(n, hq, d, device=DEV, dtype=torch.bfloat16) for _ in range(4)]
    outs = [torch.empty_like(q) for q in qs]

    def step(fused: bool) -> None:
        for q, out in zip(qs, outs, strict=True):
            da.decode_attention_triton(q, cache, meta.block_tables, meta.seq_lens, tok, out,
                                       d**-0.5, 8192, kv_scale=scales,
                                       fused_merge=fused)  # fmt: skip

    step(False)
    plain = [o.clone() for o in outs]
    step(True)  # compile, and make the counters outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(True)
    ref_cache = dequantize_cache(cache, scales) if fp8 else cache
    for _ in range(5):
        for o in outs:
            o.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for q, out, p in zip(qs, outs, plain, strict=True):
            ref = paged_attention_ref(q.float(), ref_cache.float(), meta, d**-0.5)
            torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(out, p, rtol=1e-2, atol=1e-2)
        assert _counters_zero(cache.device)


def _rope_case(ctx: list[int], bs: int, hk: int, hq: int, d: int, dtype: torch.dtype,
               pad_rows: int = 0) -> tuple:  # fmt: skip
    """A decode step's unrotated qkv rows, positions, cos / sin table and the new tokens'
    slots (``pad_rows`` more sequences of one token whose slot is -1, as a CUDA graph's
    padding), over a random cache."""
    from kiln.layers.rotary import RotaryEmbedding

    cache, meta = _batch(ctx + [1] * pad_rows, bs, hk, hq, d, dtype)
    n = len(ctx) + pad_rows
    qkv = torch.randn(n, (hq + 2 * hk) * d, device=DEV, dtype=dtype)
    pos = meta.seq_lens.long() - 1
    bt = meta.block_tables.long()
    slots = bt[torch.arange(n), pos // bs] * bs + pos % bs
    slots[len(ctx) :] = -1
    cos_sin = RotaryEmbedding(d, max(ctx) + 1, 10000.0, None).cos_sin(torch.device(DEV))
    return cache, meta, qkv, pos, cos_sin, slots


@pytest.mark.parametrize("splits,nb,window", [(1, 1, None), (2, 1, None), (3, 2, 5), (16, 1, None)])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_rope_in_decode_attention(splits: int, nb: int, window: int | None, fused: bool,
                                  prefetch: int, monkeypatch) -> None:  # fmt: skip
    """``rope``: decode attention rotates q and the new key itself and writes the new K and V
    to the cache: the same output as the rotary kernel's reference then the attention
    reference, and the same cache (the padding token's slot -1: nothing written); with
    one split (``DIRECT``), several, and the fused merge; with each split's first chunk
    read before the PDL wait (``PREFETCH``, as on Hopper; the interpreter runs it in
    order) or not."""
    from kiln.kernels.rotary import rotary_write_kv_ref

    monkeypatch.setattr(da, "prefetch_for", lambda mode: prefetch)
    torch.manual_seed(splits + nb)
    hk, hq, d, bs = 2, 6, 16, 4
    ctx = [1, 4, 5, 9, 30, 61]
    cache, meta, qkv, pos, cos_sin, slots = _rope_case(ctx, bs, hk, hq, d, torch.float32, 1)
    ref_cache = cache.clone()
    q_ref = rotary_write_kv_ref(qkv, pos, cos_sin, ref_cache, slots, hq, hk, d)
    ref = paged_attention_ref(q_ref, ref_cache, meta, d**-0.5, window)
    n = len(ctx) + 1
    out = torch.full((n, hq, d), float("nan"), device=DEV)
    q = qkv[:, : hq * d].view(n, hq, d)
    da.decode_attention_triton(q, cache, meta.block_tables, meta.seq_lens,
                               torch.arange(n, device=DEV), out, d**-0.5, 160, window, splits,
                               blocks_per_step=nb, fused_merge=fused,
                               rope=(pos, cos_sin, slots))  # fmt: skip
    torch.testing.assert_close(out[: len(ctx)], ref[: len(ctx)], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=CACHE_ATOL)
    assert _counters_zero(q.device)


def test_rope_needs_qkv_rows_and_a_plain_cache() -> None:
    """``rope`` with q not a view of qkv rows, or over an fp8 cache: a ValueError that says
    what is needed."""
    from kiln.kernels.attention import KV_FP8

    cache, meta, qkv, pos, cos_sin, slots = _rope_case([5, 9], 4, 1, 2, 16, torch.float32)
    args = (cache, meta.block_tables, meta.seq_lens, torch.arange(2))
    out = torch.empty(2, 2, 16)
    with pytest.raises(ValueError, match="q must be the q heads of"):
        da.decode_attention_triton(torch.randn(2, 2, 16), *args, out, 0.25, 64,
                                   rope=(pos, cos_sin, slots))  # fmt: skip
    q = qkv[:, :32].view(2, 2, 16)
    with pytest.raises(ValueError, match="fp8 KV cache"):
        da.decode_attention_triton(q, cache.to(KV_FP8), *args[1:], out, 0.25, 64,
                                   kv_scale=torch.ones(2), rope=(pos, cos_sin, slots))  # fmt: skip


@pytest.mark.parametrize("ctx", [[3, 9, 17, 30], [13]])
def test_attention_layer_takes_rope_in_decode(ctx: list[int], monkeypatch) -> None:
    """The attention layer with ``KILN_DECODE_ROPE=1`` at a decode graph's step (as if on a
    GPU: the interpreter runs the kernel), of several sequences or of one (batch-1 decode,
    whose q view has a row stride of its own): the rotary kernel is not called, and the
    layer's output and cache equal those of the rotary-then-attention path; at a step of
    more than ``ROPE_MAX_SEQS`` sequences the rotary path runs."""
    from kiln.checkpoint.dummy import PRESETS
    from kiln.config import ModelConfig
    from kiln.layers import attention as la
    from kiln.layers.rotary import RotaryEmbedding

    torch.manual_seed(8)
    cfg = ModelConfig(**PRESETS["tiny"])
    rot = RotaryEmbedding(cfg.head_dim, 512, cfg.rope_theta, None)
    layer = la.Attention(cfg, rot, dtype=torch.float32, device=DEV)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    n = len(ctx)
    cache, meta = _batch(ctx, 4, cfg.num_key_value_heads, cfg.num_attention_heads,
                         cfg.head_dim, torch.float32)  # fmt: skip
    pos = meta.seq_lens.long() - 1
    rows = torch.arange(n, device=DEV)
    meta.slot_mapping = meta.block_tables.long()[rows, pos // 4] * 4 + pos % 4
    meta.decode_only, meta.max_seq_len = True, 64
    x = torch.randn(n, cfg.hidden_size, device=DEV)
    rotary_calls = []
    real_rotary = la.rotary_write_kv
    monkeypatch.setattr(la, "rotary_write_kv", lambda *a, **k: rotary_calls.append(1)
                        or real_rotary(*a, **k))  # fmt: skip
    monkeypatch.setattr(la, "use_triton", lambda t: True)
    ref_cache = cache.clone()
    with torch.no_grad():
        ref = layer(pos, x, ref_cache, meta)  # KILN_DECODE_ROPE=0: the rotary path
        assert rotary_calls == [1]
        monkeypatch.setattr(da, "ROPE", 1)
        out = layer(pos, x, cache, meta)
        assert rotary_calls == [1]  # not called again
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache, ref_cache, rtol=0, atol=CACHE_ATOL)
        monkeypatch.setattr(da, "ROPE_MAX_SEQS", n - 1)
        layer(pos, x, cache.clone(), meta)
        assert rotary_calls == [1, 1]


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_rope_in_decode_attention_in_a_replayed_cuda_graph(fused: bool) -> None:
    """Llama-3.1-8B's heads over a bf16 cache, the engine's limit as ``max_seq_len``, one to
    eight sequences' worth (contexts 1 to 4,096) and a padding row (slot -1): decode
    attention with ``rope`` in a CUDA graph replayed three times against the rotary kernel
    then decode attention, outputs and caches within bf16 rounding."""
    from kiln.kernels.rotary import rotary_write_kv_triton

    torch.manual_seed(9)
    bs, hk, hq, d = 32, 8, 32, 128
    ctx = [1, 33, 150, 257, 1000, 2049, 4096]
    cache, meta, qkv, pos, cos_sin, slots = _rope_case(ctx, bs, hk, hq, d, torch.bfloat16, 1)
    bt = torch.zeros(len(ctx) + 1, 8192 // bs, dtype=torch.int32, device=DEV)
    bt[:, : meta.block_tables.shape[1]] = meta.block_tables
    n = len(ctx) + 1
    tok = torch.arange(n, device=DEV)
    ref_cache = cache.clone()
    q = rotary_write_kv_triton(qkv, pos, cos_sin, ref_cache, slots, hq, hk, d)
    ref = torch.empty_like(q)
    da.decode_attention_triton(q, ref_cache, bt, meta.seq_lens, tok, ref, d**-0.5, 8192)
    out = torch.empty_like(q)

    def step() -> None:
        da.decode_attention_triton(qkv[:, : hq * d].view(n, hq, d), cache, bt, meta.seq_lens,
                                   tok, out, d**-0.5, 8192, fused_merge=fused,
                                   rope=(pos, cos_sin, slots))  # fmt: skip

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out[:-1], ref[:-1], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(cache, ref_cache, rtol=1e-2, atol=1e-2)
        assert _counters_zero(cache.device)
