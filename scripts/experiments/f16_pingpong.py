"""The float16-code int4 kernel's register double buffer (PF) before and after the ping-pong
loop (two iterations a trip, each one's words loaded during the other's arithmetic: no
register copies at the back edge, which made every trip wait for the loads it had just
issued), and the kernel's other configurations, at one row of Llama-3.1-8B's projections.
Each case: 32 calls on 32 different weight copies (L2-cold) in one CUDA graph, best of 3
replays of 5, µs a call. The variants are at d848001 (removed in the commit after it), with
the copy of this script that ran: "before" 7ac592c's kernel (wq_f16_before.py), "pingpong"
the two-iteration trip without the warp fences that keep ptxas from sinking each group of
loads to the end of its half (wq_f16_pp.py), "top" with a fence after the first group only
(wq_f16_top.py), "after" with both (wq_f16_fenced.py); to rerun, restore them under
scripts/experiments. Measured on an H100 (results/2026-12-06-h100-f16-pingpong.json); not
adopted. Usage (repo root, GPU): python scripts/experiments/f16_pingpong.py OUT.json
"""

from __future__ import annotations

import importlib.util
import json
import sys

import torch

from kiln.bench.kernels import graph_us
from kiln.kernels import f16_prep, wq_f16
from kiln.kernels.wq_f16 import F16Act

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "o": (4096, 4096)}
PF = [(2, 2, 1, 2, True), (1, 8, 1, 2, True), (2, 4, 1, 2, True), (2, 2, 2, 2, True),
      (1, 4, 2, 2, True), (2, 2, 1, 1, True), (1, 4, 1, 1, True), (1, 8, 2, 1, True)]  # fmt: skip
# the tuner's usual one-row winners on the H100 and the H200 (its list: _F16_CANDIDATES)
PLAIN = [(1, 4, 4, 1, False), (1, 8, 2, 1, False), (2, 4, 1, 2, False), (2, 2, 1, 1, False),
         (2, 2, 2, 2, False), (1, 4, 1, 1, False), (2, 1, 4, 2, False)]  # fmt: skip
LAYERS = 32


def _module(name: str):
    path = f"scripts/experiments/{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def timed(fn) -> float:
    """µs a layer: ``fn`` (all 32 layers) in a CUDA graph, best of 3 × 5 replays."""
    return round(min(graph_us(fn, reps=5, per_graph=1) for _ in range(3)) / LAYERS, 3)


def shape_cases(olds: dict, name: str, n: int, k: int) -> list[dict]:
    dev = "cuda"
    ws = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev) for _ in range(LAYERS)]
    ss = [(torch.rand(n, k // 128, device=dev) * 0.01 + 0.001).half() for _ in range(LAYERS)]
    zs = [torch.randint(0, 16, (n, k // 128), dtype=torch.uint8, device=dev) for _ in range(LAYERS)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    a = F16Act(*f16_prep.prep_ref(x), x.dtype)
    ref = wq_f16.wq4_f16_ref(a, ws[0], ss[0].float(), zs[0]).float()
    rows = []
    for c in PF + PLAIN:
        cfg = wq_f16.f16_config(*c)
        row = {"shape": name, "cfg": list(c)}
        mods = tuple(olds.items()) if c[4] else (("after", wq_f16),)
        for tag, mod in mods:
            y = mod.wq4_f16(a, ws[0], ss[0], zs[0], cfg).float()
            row[tag + "_err"] = float((y - ref).abs().max() / ref.abs().max())

            def calls(mod=mod, cfg=cfg) -> None:
                for i in range(LAYERS):
                    mod.wq4_f16(a, ws[i], ss[i], zs[i], cfg)

            row[tag + "_us"] = timed(calls)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(path: str) -> None:
    torch.manual_seed(0)
    olds = {
        "before": _module("wq_f16_before"),
        "pingpong": _module("wq_f16_pp"),
        "top": _module("wq_f16_top"),
        "after": _module("wq_f16_fenced"),
    }
    out = {"device": torch.cuda.get_device_name(), "layers": LAYERS, "cases": []}
    for name, (n, k) in SHAPES.items():
        out["cases"] += shape_cases(olds, name, n, k)
        torch.cuda.empty_cache()
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
