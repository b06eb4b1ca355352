"""Experiment (H200): int4-awq projections at 16-128 rows (decode steps of 16-128
sequences). The tensor-core int4 kernel now takes up to 128 rows (four or eight token
tiles on each weight fragment, blocks of rows in adjacent programs); before, past 16 rows
the tl.dot dequantizing kernel ran, and an int4 engine took 14.1 ms a step at 32
sequences against 3.8 at 16.

For each Llama-3.1-8B projection and row count: the tuner's three fastest candidates
(``tune_weight_only``: each checked against the float32 reference first), the previous
fallback (``wq_default_config(..., mma=False)``), the weight dequantized then cuBLAS, and
bf16 cuBLAS; weights rotated through copies larger than L2.

Usage: ``PYTHONPATH=. python scripts/experiments/int4_many_rows.py OUT.json``"""

import json
import os
import sys

import torch
import torch.nn.functional as F

from kiln.bench.gemv_bench import LLAMA_8B_SHAPES, rotation_copies, time_per_call_ms
from kiln.bench.quant_bench import _wq_weights, tune_weight_only
from kiln.kernels import wq_gemm as wq


def main() -> None:
    ms = [int(v) for v in os.environ.get("ROWS", "16,32,48,64,96,128").split(",")]
    res = {"note": __doc__.split("\n\n")[0], "rows": []}
    totals: dict = {}
    for name, (n, k) in LLAMA_8B_SHAPES.items():
        if name == "lm_head":
            continue
        ws = _wq_weights(n, k, True, 128, rotation_copies(n * k // 2))
        idx = {id(t[0]): t for t in ws}
        packed = [t[0] for t in ws]
        bf = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            old = wq.wq_default_config(n, k, m, 128, mma=False)

            def run_old(p: torch.Tensor, x: torch.Tensor = x, c: dict = old, idx: dict = idx):
                _, s, z = idx[id(p)]
                return wq.wq_linear_triton(x, p, s, z, None, None, c)

            def deq(p: torch.Tensor, x: torch.Tensor = x, idx: dict = idx, k: int = k):
                _, s, z = idx[id(p)]
                return F.linear(x, wq.dequantize_triton(p, s, z, k, x.dtype))

            top = tune_weight_only(n, k, m, 128)
            errors = [r for r in top if "error" in r]
            row = {
                "shape": name, "m": m, "n": n, "k": k,
                "top3": [{**r["config"], "ms": r["ms"]} for r in top[:3] if "ms" in r],
                "failed": len(errors), "first_error": errors[0] if errors else None,
                "old_fallback_ms": time_per_call_ms(run_old, packed, reps=5),
                "dequant_cublas_ms": time_per_call_ms(deq, packed, reps=5),
                "bf16_ms": time_per_call_ms(lambda w, x=x: F.linear(x, w), bf, reps=10),
            }  # fmt: skip
            best = row["top3"][0]["ms"] if row["top3"] else float("nan")
            t = totals.setdefault(m, {"best": 0.0, "old": 0.0, "dq": 0.0, "bf16": 0.0})
            t["best"] += best
            t["old"] += row["old_fallback_ms"]
            t["dq"] += row["dequant_cublas_ms"]
            t["bf16"] += row["bf16_ms"]
            res["rows"].append(row)
            print(name, m, f"best {best:.4f} ({row['top3'][0] if row['top3'] else None})",
                  f"old {row['old_fallback_ms']:.4f} dq {row['dequant_cublas_ms']:.4f}",
                  f"bf16 {row['bf16_ms']:.4f} failed {len(errors)}", flush=True)  # fmt: skip
        del ws, bf
        torch.cuda.empty_cache()
    res["layer_ms"] = {str(m): v for m, v in totals.items()}
    for m, v in totals.items():
        print("layer", m, {a: round(b, 4) for a, b in v.items()}, flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
