"""``kiln bench kernels``: micro-benchmarks of the attention kernels against the device's
measured ceilings (GPU only).

- decode attention: one new token per sequence over ``ctx`` cached tokens; achieved
  bandwidth = bytes of K and V read (plus q and out) / kernel time, against the measured
  copy bandwidth;
- prefill attention: a whole causal prompt of ``L`` tokens per sequence; achieved rate =
  4 * Hq * D * L(L+1)/2 FLOPs per sequence / kernel time, against the measured bf16
  matmul rate.

Shapes default to Llama-3.1-8B's attention (32 query heads, 8 kv heads, head_dim 128,
bf16, 32-token blocks); block tables are random permutations, as in a busy cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kiln.kernels.attention import AttentionMetadata


def _time_ms(fn: Callable[[], Any], reps: int = 20) -> float:
    """Median CUDA-event time of one call after two warm-ups."""
    fn()
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _paged(
    batch: int, ctx: int, new: int, hq: int, hk: int, d: int, bs: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    dev = "cuda"
    nb = -(-ctx // bs)
    cache = torch.randn(2, batch * nb, bs, hk, d, device=dev, dtype=dtype)
    tables = torch.randperm(batch * nb, device=dev).to(torch.int32).view(batch, nb)
    starts = [i * new for i in range(batch + 1)]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=dev),
        block_tables=tables,
        slot_mapping=torch.zeros(batch * new, dtype=torch.int64, device=dev),
        query_start_loc_cpu=starts,
        seq_lens_cpu=[ctx] * batch,
    )
    q = torch.randn(batch * new, hq, d, device=dev, dtype=dtype)
    return q, cache, meta


def bench_decode(
    ctx: int,
    batch: int,
    hq: int = 32,
    hk: int = 8,
    d: int = 128,
    bs: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    copy_bandwidth: float | None = None,
) -> dict[str, Any]:
    from kiln.kernels.decode_attention import decode_attention_triton

    q, cache, meta = _paged(batch, ctx, 1, hq, hk, d, bs, dtype)
    out = torch.empty_like(q)
    tok = meta.query_start_loc[:-1]

    def run() -> None:
        decode_attention_triton(q, cache, meta.block_tables, meta.seq_lens, tok, out, d**-0.5, ctx)

    ms = _time_ms(run)
    nbytes = batch * ctx * 2 * hk * d * dtype.itemsize + 2 * q.numel() * dtype.itemsize
    row: dict[str, Any] = {
        "kernel": "decode_attention",
        "context": ctx,
        "batch": batch,
        "ms": round(ms, 4),
        "bytes": nbytes,
        "bytes_per_s": nbytes / (ms / 1e3),
    }
    if copy_bandwidth:
        row["fraction_of_copy_bandwidth"] = row["bytes_per_s"] / copy_bandwidth
    return row


def bench_prefill(
    seq_len: int,
    batch: int = 1,
    hq: int = 32,
    hk: int = 8,
    d: int = 128,
    bs: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    matmul_rate: float | None = None,
) -> dict[str, Any]:
    from kiln.kernels.attention import paged_attention

    q, cache, meta = _paged(batch, seq_len, seq_len, hq, hk, d, bs, dtype)
    ms = _time_ms(lambda: paged_attention(q, cache, meta, d**-0.5), reps=10)
    flops = batch * 4 * hq * d * seq_len * (seq_len + 1) // 2
    row: dict[str, Any] = {
        "kernel": "prefill_attention (causal, paged, whole prompt)",
        "seq_len": seq_len,
        "batch": batch,
        "ms": round(ms, 4),
        "flops": flops,
        "flops_per_s": flops / (ms / 1e3),
    }
    if matmul_rate:
        row["fraction_of_matmul_rate"] = row["flops_per_s"] / matmul_rate
    return row


def run_all(ceilings: dict[str, Any]) -> list[dict[str, Any]]:
    bw = ceilings["copy_bandwidth_bytes_per_s"]
    mm = ceilings["matmul_flops_per_s"].get("bfloat16")
    rows = []
    for ctx in (1024, 8192, 32768):
        for batch in (1, 16, 64, 256):
            if batch * ctx <= 2**21:  # at most 2M cached tokens (256 GiB-free sizes)
                rows.append(bench_decode(ctx, batch, copy_bandwidth=bw))
    for seq_len, batch in ((4096, 1), (4096, 4), (1024, 16)):
        rows.append(bench_prefill(seq_len, batch, matmul_rate=mm))
    return rows
