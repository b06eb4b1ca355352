# ruff: noqa: B023 (the closures are timed within the loop iteration that makes them)
"""fp8 "block" against the per-token fp8 path on a GPU: ``torch._scaled_mm`` with 1x128 /
128x128 block scales against row-wise scales at Llama-3.1-8B's projection shapes, from
decode to prefill row counts, each product checked against the float32 emulation first;
and the activation quantizers with one scale per 128 channels against one per token
(alone, fused into RMSNorm at 4,096 and into SiLU-mul at 14,336). Usage:
``python -m kiln.bench.block_bench out.json``."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from kiln.bench.gemv_bench import LLAMA_8B_SHAPES
from kiln.bench.kernels import gpu_run_header, median_cuda_ms
from kiln.kernels import quant_act as qa
from kiln.quant import formats as qf

DEV = "cuda"
ROWS = (1, 16, 128, 1024, 2048, 8192)
G = qf.FP8_BLOCK


def _tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2 * m * n * k / ms / 1e9


def _check(a: qa.QuantAct, wq: torch.Tensor, ws: torch.Tensor) -> float:
    """The largest error of the GPU product against the float32 emulation, relative to
    the emulation's largest magnitude."""
    got = qf.act_matmul_cuda(a, wq, ws, None, torch.bfloat16).float()
    want = qf.act_matmul_ref(a, wq, ws, None, torch.float32)
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def bench_block_gemm(rows: tuple[int, ...] = ROWS) -> list[dict[str, Any]]:
    out = []
    for name, (n, k) in LLAMA_8B_SHAPES.items():
        if name == "lm_head":
            continue
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k**0.5
        w_row, s_row = qf.quantize_fp8_weight(w)
        w_blk, s_blk = qf.quantize_fp8_block_weight(w)
        for m in rows:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            a_row = qa.quantize_rows_triton(x, "fp8")
            a_blk = qa.quantize_rows_triton(x, "fp8", group=G)
            row: dict[str, Any] = {"shape": name, "m": m, "n": n, "k": k}
            row["rowwise_ms"] = median_cuda_ms(
                lambda: torch._scaled_mm(
                    a_row.q, w_row.t(), a_row.scale, s_row.reshape(1, -1), out_dtype=torch.bfloat16
                )
            )
            try:
                row["block_max_rel_err"] = _check(a_blk, w_blk, s_blk)
                row["block_ms"] = median_cuda_ms(
                    lambda: torch._scaled_mm(
                        a_blk.q, w_blk.t(), a_blk.scale, s_blk.t(), out_dtype=torch.bfloat16
                    )
                )
            except RuntimeError as e:  # a recipe this torch / cuBLAS does not take: say so
                row["block_error"] = str(e)[:300]
            else:
                row["rowwise_tflops"] = _tflops(m, n, k, row["rowwise_ms"])
                row["block_tflops"] = _tflops(m, n, k, row["block_ms"])
                row["block_over_rowwise"] = row["block_ms"] / row["rowwise_ms"]
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def bench_group_quant(rows: tuple[int, ...] = ROWS) -> list[dict[str, Any]]:
    out = []
    for m in rows:
        x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
        r, w = torch.randn_like(x), torch.rand(4096, device=DEV, dtype=torch.bfloat16) + 0.5
        h = torch.randn(m, 2 * 14336, device=DEV, dtype=torch.bfloat16)
        for group in (None, G):
            out.append(
                {
                    "m": m,
                    "group": group,
                    "quant_4096_ms": median_cuda_ms(
                        lambda: qa.quantize_rows_triton(x, "fp8", group=group)
                    ),
                    "rmsnorm_quant_4096_ms": median_cuda_ms(
                        lambda: qa.rms_norm_quant_triton(x, w, 1e-5, r, "fp8", group=group)
                    ),
                    "silu_mul_quant_14336_ms": median_cuda_ms(
                        lambda: qa.silu_and_mul_quant_triton(h, "fp8", group=group)
                    ),
                }
            )
            print(json.dumps(out[-1]), flush=True)
    return out


def main(argv: list[str]) -> int:
    out = gpu_run_header("fp8-block-kernels")
    out["gemm"] = bench_block_gemm()
    out["act_quant"] = bench_group_quant()
    with open(argv[0], "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
