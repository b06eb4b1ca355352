"""Decode attention with rotary and the new K / V write in it (``KILN_DECODE_ROPE``,
``rope=``): the output and the cache are the rotary reference's then attention's, in the
kernel and in the attention layer. On the CPU the interpreter runs the programs one after
another; the GPU test runs them at once, in a graph replayed several times. The sm_90
compile (the rotary path's registers) is checked in ``tests/test_decode_sm90.py``."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import decode_attention as da
from kiln.kernels.attention import paged_attention_ref
from tests.decode_cases import DEV, decode_batch


def _batch(ctx: list[int], bs: int, hk: int, hq: int, d: int, dtype: torch.dtype,
           width: int | None = None) -> tuple:  # fmt: skip
    """``decode_batch``'s cache and metadata."""
    _, cache, _, _, meta = decode_batch(ctx, bs, hk, hq, d, dtype, width=width)
    return cache, meta


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
@pytest.mark.parametrize("prefetch", [0, 1])
def test_rope_in_decode_attention(splits: int, nb: int, window: int | None, prefetch: int,
                                  monkeypatch) -> None:  # fmt: skip
    """``rope``: decode attention rotates q and the new key itself and writes the new K and V
    to the cache: the same output as the rotary kernel's reference then the attention
    reference, and the same cache (the padding token's slot -1: nothing written); with
    one split (``DIRECT``) and several; with each split's first chunk read before the PDL
    wait (``PREFETCH``, as on Hopper; the interpreter runs it in order) or not."""
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
                               blocks_per_step=nb, rope=(pos, cos_sin, slots))  # fmt: skip
    torch.testing.assert_close(out[: len(ctx)], ref[: len(ctx)], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)


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
        torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)
        monkeypatch.setattr(da, "ROPE_MAX_SEQS", n - 1)
        layer(pos, x, cache.clone(), meta)
        assert rotary_calls == [1, 1]


@pytest.mark.gpu
def test_rope_in_decode_attention_in_a_replayed_cuda_graph() -> None:
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
                                   tok, out, d**-0.5, 8192,
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
