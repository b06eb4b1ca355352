"""Decode attention with the splits merged by the split that finishes last
(``KILN_DECODE_FUSED_MERGE``, ``decode_attention_triton(fused_merge=True)``): the output
is the reference's, no reduction kernel is launched, and every counter is back at zero
after each call, so the next call (a CUDA graph's next replay) starts clean. On the CPU
the interpreter runs the programs one after another; the GPU tests run them at once, in a
graph replayed several times. The sm_90 compile (one gpu-scope acquire-release atomic
behind a CTA barrier, the partials read past L1) is checked in
``tests/test_decode_sm90.py``."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import decode_attention as da
from kiln.kernels import decode_tiles
from kiln.kernels.attention import AttentionMetadata, paged_attention_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(ctx: list[int], bs: int, hk: int, hq: int, d: int, dtype: torch.dtype,
           width: int | None = None) -> tuple:  # fmt: skip
    """One decode token per sequence over a random paged cache with scattered blocks."""
    nblocks = sum(-(-c // bs) for c in ctx) + 1
    cache = torch.randn(2, nblocks, bs, hk, d, device=DEV, dtype=dtype)
    perm = torch.randperm(nblocks).tolist()
    tables = [[perm.pop() for _ in range(-(-c // bs))] for c in ctx]
    width = width or max(map(len, tables))
    n = len(ctx)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=DEV),
        seq_lens=lens,
        block_tables=bt.to(DEV),
        slot_mapping=torch.zeros(n, dtype=torch.long, device=DEV),
        query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=ctx,
    )
    return cache, meta


def _spy(monkeypatch) -> list[tuple[str, object]]:
    """Records each launch of the partial kernel (with its FUSE) and of the reduction."""
    launched: list[tuple[str, object]] = []

    class Spy:
        def __init__(self, name, real):
            self.name, self.real = name, real

        def __getitem__(self, grid):
            def launch(*a, **k):
                launched.append((self.name, k.get("FUSE")))
                return self.real[grid](*a, **k)

            return launch

    monkeypatch.setattr(da, "_decode_partial", Spy("partial", da._decode_partial))
    monkeypatch.setattr(da, "_decode_reduce", Spy("reduce", da._decode_reduce))
    return launched


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
