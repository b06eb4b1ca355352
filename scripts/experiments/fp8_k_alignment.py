"""Experiment (GPU): ``torch._scaled_mm`` (e4m3, row-wise scales, bfloat16 out) time at
Llama-3.1-8B's projections with K as is, K + 64 (32 outlier channels split in two) and
K + 128, at 1-2048 rows; and the per-token quantizer with and without 32 split channels.
(Run once, at commit 5971db0, when the quantizer still wrote the split columns with masked
stores over the whole row; ``outliers`` was then an (idx, slot) pair.)

Usage: ``PYTHONPATH=. python scripts/experiments/fp8_k_alignment.py OUT.json``."""

import json
import sys

import torch

from kiln.bench.kernels import graph_us
from kiln.kernels import quant_act as qa

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    rows = []
    f8 = torch.float8_e4m3fn
    for name, (n, k) in SHAPES.items():
        for m in (1, 16, 256, 1024, 2048):
            r = {"shape": name, "n": n, "k": k, "m": m}
            for extra in (0, 64, 128):
                kk = k + extra
                a = torch.randn(m, kk, device="cuda").to(f8)
                w = torch.randn(n, kk, device="cuda").to(f8)
                sa = torch.rand(m, 1, device="cuda")
                sb = torch.rand(1, n, device="cuda")
                r[f"us_k+{extra}"] = graph_us(
                    lambda a=a, w=w, sa=sa, sb=sb: torch._scaled_mm(
                        a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16
                    )
                )
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            o = torch.randperm(k, device="cuda")[:32].sort().values
            r["quant_us"] = graph_us(lambda x=x: qa.quantize_rows_triton(x, "fp8"))
            r["quant_split32_us"] = graph_us(
                lambda x=x, o=o: qa.quantize_rows_triton(x, "fp8", None, o)
            )
            print(r, flush=True)
            rows.append(r)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
