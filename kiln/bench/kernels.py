"""``kiln bench kernels``: micro-benchmarks of the attention kernels against the device's
measured ceilings (GPU only).

- decode attention: one new token per sequence over ``ctx`` cached tokens; achieved
  bandwidth = bytes of K and V read (plus q and out) / kernel time, against the measured
  copy bandwidth;
- prefill attention: a whole causal prompt of ``L`` tokens per sequence; achieved rate =
  4 * Hq * D * L(L+1)/2 FLOPs per sequence / kernel time, against the measured bf16
  matmul rate.

Shapes default to Llama-3.1-8B's attention (32 query heads, 8 kv heads, head_dim 128,
bf16, 32-token blocks); block tables are random permutations, as in a busy cache. Torch's
causal SDPA (flash attention, contiguous tensors, no cache) is timed beside the prefill
kernel as the figure to hold it against."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kiln.kernels.attention import AttentionMetadata


def gpu_run_header(name: str) -> dict[str, Any]:
    """The head of a GPU benchmark's JSON: its name, the commit (``KILN_COMMIT``; the
    device's clone is not the sent tree), the date, the GPU and the versions."""
    import datetime
    import os

    import triton

    return {
        "name": name,
        "commit": os.environ.get("KILN_COMMIT", "unknown"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": torch.version.cuda,
        },
    }


def median_cuda_ms(fn: Callable[[], Any], reps: int = 20) -> float:
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


def graph_us(fn: Callable[[], Any], reps: int = 20, per_graph: int = 5) -> float:
    """Mean microseconds of one call, ``per_graph`` calls captured in a CUDA graph and the
    graph replayed ``reps`` times (launch gaps as in the engine's decode graphs)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / (reps * per_graph)


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
    kv_fp8: bool = False,
) -> dict[str, Any]:
    """Decode attention over a paged cache of ``dtype``, or of fp8 (e4m3, with scales)
    under ``dtype`` queries when ``kv_fp8``; bytes counted are the cache's and q/out's."""
    from kiln.kernels.decode_attention import decode_attention_triton

    q, cache, meta = _paged(batch, ctx, 1, hq, hk, d, bs, dtype)
    scales = None
    if kv_fp8:
        cache = cache.to(torch.float8_e4m3fn)
        scales = torch.ones(2, device=cache.device)
    out = torch.empty_like(q)
    tok = meta.query_start_loc[:-1]

    def run() -> None:
        decode_attention_triton(
            q, cache, meta.block_tables, meta.seq_lens, tok, out, d**-0.5, ctx, kv_scale=scales
        )

    ms = median_cuda_ms(run)
    nbytes = batch * ctx * 2 * hk * d * cache.element_size() + 2 * q.numel() * dtype.itemsize
    row: dict[str, Any] = {
        "kernel": "decode_attention_fp8kv" if kv_fp8 else "decode_attention",
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
    ms = median_cuda_ms(lambda: paged_attention(q, cache, meta, d**-0.5), reps=10)
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


def attention_flops(
    seq_len: int, prefix_len: int, num_heads: int, head_dim: int, window: int | None = None
) -> int:
    """Causal attention FLOPs of one sequence's ``seq_len`` new tokens after ``prefix_len``
    cached ones: 4 * Hq * D per (query, visible key) pair (QK^T and PV, 2 FLOPs a MAC)."""
    pairs = 0
    for p in range(prefix_len, prefix_len + seq_len):
        pairs += p + 1 if window is None else min(p + 1, window)
    return 4 * num_heads * head_dim * pairs


def _time_ms_loop(fn: Callable[[], Any], iters: int, warmup: int) -> float:
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

    ms = _time_ms_loop(run, iters, warmup)
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

    ms = _time_ms_loop(run, iters, warmup)
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


def run_all(ceilings: dict[str, Any]) -> list[dict[str, Any]]:
    bw = ceilings["copy_bandwidth_bytes_per_s"]
    mm = ceilings["matmul_flops_per_s"].get("bfloat16")
    rows = []
    for ctx in (1024, 8192, 32768):
        for batch in (1, 16, 64, 256):
            if batch * ctx <= 2**21:  # at most 2M cached tokens (256 GiB-free sizes)
                rows.append(bench_decode(ctx, batch, copy_bandwidth=bw))
                rows.append(bench_decode(ctx, batch, copy_bandwidth=bw, kv_fp8=True))
    for seq_len, batch in ((4096, 1), (4096, 4), (1024, 16)):
        row = bench_prefill(seq_len, batch, matmul_rate=mm)
        row["sdpa_flash_attention_flops_per_s"] = 1e12 * bench_sdpa_prefill(seq_len, batch)
        rows.append(row)
    cands = bench_prefill_candidates(seq_len=4096, num_seqs=1)
    rows.append(
        {
            "kernel": "prefill_attention candidates at 4096 x 1",
            "candidates": [{**c, "flops_per_s": 1e12 * t} for c, t in cands],
        }
    )
    return rows


def run_command(report_json: str | None) -> int:
    """``kiln bench kernels``: every case of ``run_all`` printed as JSON lines, and the
    report written to ``report_json`` when given (GPU only)."""
    import json

    from kiln.bench import ceilings
    from kiln.bench import report as rep
    from kiln.errors import ConfigError

    if not torch.cuda.is_available():
        raise ConfigError(
            "kiln bench kernels times the Triton kernels on a GPU and this machine has no CUDA "
            "device; run it on the GPU machine."
        )
    dev = torch.device("cuda")
    ceil = ceilings.get(dev)
    rows = run_all(ceil)
    report = {
        "name": "kernels",
        **rep.environment(dev),
        "settings": {"shapes": "Llama-3.1-8B attention: Hq 32, Hk 8, D 128, bf16, 32-token "
                               "blocks; decode also over an fp8 cache (decode_attention_fp8kv)",
                     "ceilings": ceil},
        "figures": {"kernels": rows},
    }  # fmt: skip
    if report_json:
        rep.write_json(report, report_json)
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k != "bytes"}))
    return 0
