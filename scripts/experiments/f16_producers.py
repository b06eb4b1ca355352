"""The float16-code path's producers (kiln/kernels/f16_prep.py) against the kernels they
replace, at one row of Llama-3.1-8B (RMSNorm with the residual add over 4,096; SiLU·mul of
2 × 14,336), over the values a program takes and its warps: µs a call, 32 calls in one
CUDA graph (PDL as in the engine), 10 replays, best of three. GPU only.

    python scripts/experiments/f16_producers.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch

from kiln.kernels import f16_prep
from kiln.kernels.activation import silu_and_mul_triton
from kiln.kernels.rmsnorm import rms_norm_triton


def us(fn) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(32):
            fn()
    best = float("inf")
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        for _ in range(10):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / 320 * 1e3)
    return round(best, 3)


def main(path: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(1, 28672, device="cuda", dtype=torch.bfloat16)
    out: dict = {
        "device": torch.cuda.get_device_name(),
        "rms_norm_us": us(lambda: rms_norm_triton(x, w, 1e-5, r)),
        "silu_mul_us": us(lambda: silu_and_mul_triton(gu)),
        "rms_norm_prep_us": {},
        "silu_mul_prep_us": {},
    }
    for size in (128, 256, 512, 1024, 2048):
        for warps in (1, 2, 4, 8):
            key = f"{size}/{warps}"
            out["rms_norm_prep_us"][key] = us(
                lambda s=size, n=warps: f16_prep.rms_norm_prep_triton(x, w, 1e-5, r, s, n)
            )
            out["silu_mul_prep_us"][key] = us(
                lambda s=size, n=warps: f16_prep.silu_mul_prep_triton(gu, s, n)
            )
    for name in ("rms_norm_prep_us", "silu_mul_prep_us"):
        best = min(out[name].items(), key=lambda kv: kv[1])
        print(name, "best", best, "default", out[name]["1024/4"])
    print("rms_norm", out["rms_norm_us"], "silu_mul", out["silu_mul_us"])
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
