"""Micro-benchmark of the skinny matmul (kiln/kernels/gemv.py) against ``F.linear`` on a GPU:
the rate at which each reads the weight matrix, in bytes/s, at decode-sized batches.

Each measurement runs a CUDA graph of calls over distinct copies of the weight, together
larger than the L2 cache (so every call reads its weight from memory, as a decode step's
layers do), and divides the replay time by the number of calls: no launch gaps, no L2
hits. ``python -m kiln.bench.gemv_bench`` prints Llama-3.1-8B's projections at 1, 4 and 16
rows; ``--tune`` also times every tuner candidate and prints the fastest per shape."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kiln.kernels.gemv import skinny_config, skinny_config_candidates, skinny_matmul_triton

# Llama-3.1-8B: qkv, o, gate_up, down, lm_head as (N, K)
LLAMA_8B_SHAPES: dict[str, tuple[int, int]] = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
_ROTATE_BYTES = 512 << 20  # weights cycled per graph, well past an H200's 60 MiB L2
_MAX_COPIES = 256


def rotation_copies(nbytes: int, rotate_bytes: int = _ROTATE_BYTES) -> int:
    """How many copies of a weight of ``nbytes`` a timing graph cycles through: enough to
    pass ``rotate_bytes`` (so that the weight comes from memory, not L2, as in a real
    decode step), at least 2 and at most 256. The cap matters for small models only: a
    weight of a few KiB would otherwise make a graph of tens of thousands of launches (the
    build-time tuning of ``dummy:tiny`` on a GPU ran for minutes); such weights are
    L2-resident in a real step too."""
    return min(_MAX_COPIES, max(2, -(-rotate_bytes // max(1, nbytes))))


def _weights(n: int, k: int, dtype: torch.dtype) -> list[torch.Tensor]:
    copies = rotation_copies(n * k * dtype.itemsize)
    return [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(copies)]


def time_per_call_ms(
    fn: Callable[[torch.Tensor], Any], weights: list[torch.Tensor], reps: int = 20
) -> float:
    """Median over ``reps`` replays of a CUDA graph calling ``fn`` once per weight, divided
    by the number of weights."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights:  # compile and warm up outside the capture
            fn(w)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / len(weights))
    del graph
    return sorted(times)[len(times) // 2]


def bench_skinny(
    n: int,
    k: int,
    m: int,
    dtype: torch.dtype = torch.bfloat16,
    config: dict[str, Any] | None = None,
    copy_bandwidth: float | None = None,
) -> dict[str, Any]:
    """Time the skinny kernel (``config``, else the active one) and ``F.linear`` for x of
    shape (m, k) and w of shape (n, k); rates are bytes of w read per second."""
    weights = _weights(n, k, dtype)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = config or skinny_config(n, k, m, sms)
    err = (skinny_matmul_triton(x, weights[0], None, cfg).float() - F.linear(x, weights[0])).abs()
    t_ms = time_per_call_ms(lambda w: skinny_matmul_triton(x, w, None, cfg), weights)
    f_ms = time_per_call_ms(lambda w: F.linear(x, w), weights)
    nbytes = n * k * dtype.itemsize
    row: dict[str, Any] = {
        "n": n,
        "k": k,
        "m": m,
        "dtype": str(dtype).removeprefix("torch."),
        "config": cfg,
        "triton_ms": round(t_ms, 5),
        "torch_ms": round(f_ms, 5),
        "triton_bytes_per_s": nbytes / (t_ms / 1e3),
        "torch_bytes_per_s": nbytes / (f_ms / 1e3),
        "speedup": f_ms / t_ms,
        "max_abs_diff_vs_torch": float(err.max()),
    }
    if copy_bandwidth:
        row["triton_fraction_of_copy"] = row["triton_bytes_per_s"] / copy_bandwidth
        row["torch_fraction_of_copy"] = row["torch_bytes_per_s"] / copy_bandwidth
    return row


def cublas_ms(n: int, k: int, m: int, dtype: torch.dtype = torch.bfloat16, reps: int = 10) -> float:
    """``F.linear`` (cuBLAS) timed like the candidates of ``tune_skinny``."""
    weights = _weights(n, k, dtype)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    return time_per_call_ms(lambda w: torch.nn.functional.linear(x, w), weights, reps)


def tune_skinny(
    n: int,
    k: int,
    m: int,
    dtype: torch.dtype = torch.bfloat16,
    reps: int = 10,
    max_candidates: int | None = None,
    timed: bool = True,
) -> list[dict[str, Any]]:
    """Every candidate of ``skinny_config_candidates`` timed at (m, n, k), fastest first;
    candidates that fail (e.g. too much shared memory) come last with their error.
    ``timed`` False: each candidate is called once on one uninitialized weight, in order
    (``kiln.runtime.kernel_record.precompile``'s dry run)."""
    weights = _weights(n, k, dtype) if timed else [torch.empty(n, k, device="cuda", dtype=dtype)]
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for cfg in skinny_config_candidates(n, k, m, sms)[:max_candidates]:
        try:
            if not timed:
                skinny_matmul_triton(x, weights[0], None, cfg)
                rows.append({"config": cfg})
                continue
            ms = time_per_call_ms(
                lambda w, c=cfg: skinny_matmul_triton(x, w, None, c), weights, reps
            )
        except Exception as e:  # a failing candidate is a result, not an error
            rows.append({"config": cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        rows.append({"config": cfg, "ms": ms, "bytes_per_s": n * k * dtype.itemsize / (ms / 1e3)})
    return rows if not timed else sorted(rows, key=lambda r: r.get("ms", float("inf")))


def fp8_weight_copies(n: int, k: int) -> list[torch.Tensor]:
    """The random e4m3 weights ``tune_fp8_skinny`` times, rotated past L2: make them once
    per shape for all its row counts."""
    return [
        (torch.randn(n, k, device="cuda") * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
        for _ in range(rotation_copies(n * k))
    ]


def tune_fp8_skinny(
    n: int,
    k: int,
    m: int,
    reps: int = 10,
    weights: list[torch.Tensor] | None = None,
    timed: bool = True,
) -> tuple[list[dict[str, Any]], float]:
    """The fp8 skinny kernel's candidates (``kiln.kernels.fp8_gemv``) and the tensor-core
    kernel's (``kiln.kernels.fp8_mma``) at (m, n, k) on random e4m3 weights rotated past L2
    (``weights``, else new ``fp8_weight_copies``), fastest first (each checked against the
    reference first; failures last with their error), and ``torch._scaled_mm``'s time for
    the same call. ``timed`` False: each candidate is only called once on ``weights[0]``
    (an uninitialized weight if none are given), unchecked, in order, and no time is taken
    (0.0; ``kiln.runtime.kernel_record.precompile``'s dry run)."""
    from kiln.kernels.fp8_gemv import (
        FP8_SKINNY_MAX_M,
        fp8_skinny_candidates,
        fp8_skinny_ref,
        fp8_skinny_triton,
    )
    from kiln.kernels.fp8_mma import MAX_M, fp8_mma_candidates

    e4m3 = torch.float8_e4m3fn
    if weights is None:  # a dry run calls on one uninitialized weight
        weights = (
            fp8_weight_copies(n, k) if timed else [torch.empty(n, k, device="cuda", dtype=e4m3)]
        )
    sw = torch.rand(n, device="cuda") * 0.01 + 1e-3
    xq = (torch.randn(m, k, device="cuda") * 60).clamp(-448, 448).to(e4m3)
    sx = torch.rand(m, 1, device="cuda") * 0.01 + 1e-3
    rows: list[dict[str, Any]] = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    mma = fp8_mma_candidates(n, k) if m <= MAX_M else []
    skinny = fp8_skinny_candidates(n, k, m, sms) if m <= FP8_SKINNY_MAX_M else []
    if not timed:
        for cfg in skinny + mma:
            try:
                fp8_skinny_triton(xq, sx, weights[0], sw, None, torch.bfloat16, cfg)
            except Exception as e:  # the timed run records it
                rows.append({"config": cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                continue
            rows.append({"config": cfg})
        return rows, 0.0
    ref = fp8_skinny_ref(xq, sx, weights[0], sw, None, torch.bfloat16).float()
    for cfg in skinny + mma:

        def run(w: torch.Tensor, c: dict[str, Any] = cfg) -> torch.Tensor:
            return fp8_skinny_triton(xq, sx, w, sw, None, torch.bfloat16, c)

        try:  # a candidate must match the reference before it is timed
            err = float((run(weights[0]).float() - ref).abs().max() / ref.abs().max())
            if not err <= 2**-6:
                raise ValueError(f"wrong result: max error {err:.2e} of the largest output")
            ms = time_per_call_ms(run, weights, reps)
        except Exception as e:  # a failing candidate is a result, not an error
            rows.append({"config": cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        rows.append({"config": cfg, "ms": ms})
    swt = sw.reshape(1, -1)
    mm_ms = time_per_call_ms(
        lambda w: torch._scaled_mm(xq, w.t(), scale_a=sx, scale_b=swt, out_dtype=torch.bfloat16),
        weights,
        reps,
    )
    return sorted(rows, key=lambda r: r.get("ms", float("inf"))), mm_ms


def run_all(
    shapes: dict[str, tuple[int, int]] | None = None,
    ms: tuple[int, ...] = (1, 4, 16),
    copy_bandwidth: float | None = None,
) -> list[dict[str, Any]]:
    rows = []
    for name, (n, k) in (shapes or LLAMA_8B_SHAPES).items():
        for m in ms:
            rows.append({"name": name, **bench_skinny(n, k, m, copy_bandwidth=copy_bandwidth)})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tune", action="store_true", help="also time every tuner candidate")
    p.add_argument("--copy-bandwidth", type=float, default=None, help="bytes/s, for fractions")
    a = p.parse_args(argv)
    gb = 1e9
    print(f"{'shape':>8} {'m':>3} {'triton GB/s':>12} {'torch GB/s':>11} {'speedup':>8}  config")
    for r in run_all(copy_bandwidth=a.copy_bandwidth):
        print(
            f"{r['name']:>8} {r['m']:>3} {r['triton_bytes_per_s'] / gb:12.0f} "
            f"{r['torch_bytes_per_s'] / gb:11.0f} {r['speedup']:8.3f}  {json.dumps(r['config'])}"
        )
    if a.tune:
        for name, (n, k) in LLAMA_8B_SHAPES.items():
            for m in (1, 4, 16):
                best = tune_skinny(n, k, m)
                for r in best[:3]:
                    rate = r.get("bytes_per_s", 0) / gb
                    print(f"tune {name:>8} m={m:<3} {rate:7.0f} GB/s  {json.dumps(r['config'])}")


if __name__ == "__main__":
    main()
