"""Micro-benchmarks of single kernels on a CUDA device, timed with CUDA events (not one of
``kiln bench``'s commands). ``python -m kiln.bench.kernels`` prints the prefill attention
kernel's TFLOP/s for every tuning candidate next to torch's SDPA (flash attention)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def attention_flops(
    seq_len: int, prefix_len: int, num_heads: int, head_dim: int, window: int | None = None
) -> int:
    """Causal attention FLOPs of one sequence's ``seq_len`` new tokens after ``prefix_len``
    cached ones: 4 * Hq * D per (query, visible key) pair (QK^T and PV, 2 FLOPs a MAC)."""
    pairs = 0
    for p in range(prefix_len, prefix_len + seq_len):
        pairs += p + 1 if window is None else min(p + 1, window)
    return 4 * num_heads * head_dim * pairs


def _time_ms(fn: Callable[[], Any], iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def bench_prefill_attention(
    seq_len: int = 4096,
    num_seqs: int = 1,
    prefix_len: int = 0,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    tokens_per_block: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    sliding_window: int | None = None,
    iters: int = 20,
    warmup: int = 3,
    **config: int,
) -> float:
    """TFLOP/s of ``prefill_attention_triton`` on ``num_seqs`` sequences of ``seq_len`` new
    tokens after ``prefix_len`` cached ones each (Llama-3.1-8B's heads by default), blocks
    scattered over the cache. ``config``: BLOCK_M, BLOCK_N, num_warps, num_stages."""
    from kiln.kernels.prefill_attention import prefill_attention_triton

    dev = torch.device("cuda")
    ctx = prefix_len + seq_len
    per_seq = -(-ctx // tokens_per_block)
    nblocks = num_seqs * per_seq
    cache = torch.randn(
        2, nblocks, tokens_per_block, num_kv_heads, head_dim, device=dev, dtype=dtype
    )
    tables = torch.randperm(nblocks, device=dev).view(num_seqs, per_seq).to(torch.int32)
    lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device=dev)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32, device=dev) * seq_len
    q = torch.randn(num_seqs * seq_len, num_heads, head_dim, device=dev, dtype=dtype)
    out = torch.empty_like(q)

    def run() -> None:
        prefill_attention_triton(
            q,
            cache,
            tables,
            lens,
            starts,
            out,
            head_dim**-0.5,
            seq_len,
            sliding_window,
            **config,
        )

    ms = _time_ms(run, iters, warmup)
    flops = num_seqs * attention_flops(seq_len, prefix_len, num_heads, head_dim, sliding_window)
    return flops / (ms * 1e-3) / 1e12


def bench_sdpa_prefill(
    seq_len: int = 4096,
    num_seqs: int = 1,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    iters: int = 20,
    warmup: int = 3,
) -> float:
    """TFLOP/s of torch's causal SDPA (flash attention) with GQA on contiguous tensors,
    no cache, no prefix: the figure to hold the paged kernel against."""
    dev = torch.device("cuda")
    q = torch.randn(num_seqs, num_heads, seq_len, head_dim, device=dev, dtype=dtype)
    k = torch.randn(num_seqs, num_kv_heads, seq_len, head_dim, device=dev, dtype=dtype)
    v = torch.randn_like(k)

    def run() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    ms = _time_ms(run, iters, warmup)
    flops = num_seqs * attention_flops(seq_len, 0, num_heads, head_dim)
    return flops / (ms * 1e-3) / 1e12


def bench_prefill_candidates(**kwargs: Any) -> list[tuple[dict[str, int], float]]:
    """``bench_prefill_attention`` for every tuning candidate of the head size and dtype,
    fastest first (a candidate that fails to compile or launch is left out)."""
    from kiln.kernels.prefill_attention import prefill_config_candidates

    head_dim = kwargs.get("head_dim", 128)
    dtype = kwargs.get("dtype", torch.bfloat16)
    results = []
    for config in prefill_config_candidates(head_dim, dtype):
        try:
            results.append((config, bench_prefill_attention(**kwargs, **config)))
        except Exception as exc:  # out of shared memory and the like
            print(f"{config}: {type(exc).__name__}: {exc}")
    return sorted(results, key=lambda r: -r[1])


if __name__ == "__main__":  # pragma: no cover - needs a GPU
    for length, seqs in ((4096, 1), (1024, 4), (16384, 1)):
        print(f"seq_len {length} x {seqs}: sdpa {bench_sdpa_prefill(length, seqs):.0f} TFLOP/s")
        for cfg, tflops in bench_prefill_candidates(seq_len=length, num_seqs=seqs):
            print(f"  {tflops:6.0f} TFLOP/s  {cfg}")
