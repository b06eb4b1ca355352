"""How much the float16-code int4 kernel pays for reading its group scales and zeros, and
whether packing rows g and g + 8's into one int32 (scales) and one int16 (zeros) takes
some of it back (``wq_f16_sz.py``: SZ 0 the engine's four loads a chunk and row group, 1
none (constants), 2 the packed two). One row of Llama-3.1-8B's projections; each case 32
calls on 32 different weight copies (L2-cold) in one CUDA graph, best of 3 replays of 5,
µs a call, split-K partials left unsummed. SZ 2 is checked bit for bit against SZ 0, and
SZ 0 against ``wq4_f16_ref``. Usage (repo root, GPU): python scripts/experiments/f16_sz.py
OUT.json [seconds]"""

from __future__ import annotations

import importlib.util
import json
import sys
import time

import torch

from kiln.bench.kernels import graph_us
from kiln.kernels import f16_prep, wq_f16
from kiln.kernels.wq_f16 import F16Act

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "o": (4096, 4096)}
CONFIGS = [(2, 2, 1, 1, 0), (1, 4, 1, 1, 0), (1, 4, 4, 1, 0), (1, 8, 2, 1, 0), (2, 4, 1, 2, 0),
           (2, 2, 1, 2, 2), (2, 2, 1, 1, 2), (1, 8, 2, 1, 2), (1, 8, 1, 2, 2)]  # fmt: skip
LAYERS = 32


def _variant():
    path = "scripts/experiments/wq_f16_sz.py"
    spec = importlib.util.spec_from_file_location("wq_f16_sz", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def timed(fn) -> float:
    return round(min(graph_us(fn, reps=5, per_graph=1) for _ in range(3)) / LAYERS, 3)


def shape_cases(v, name: str, n: int, k: int, deadline: float) -> list[dict]:
    dev = "cuda"
    ws = [wq_f16.tile_words(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev))
          for _ in range(LAYERS)]  # fmt: skip
    ss = [(torch.rand(n, k // 128, device=dev) * 0.01 + 0.001).half() for _ in range(LAYERS)]
    zs = [torch.randint(0, 16, (n, k // 128), dtype=torch.uint8, device=dev) for _ in range(LAYERS)]
    packed = [v.pack_sz(s, z) for s, z in zip(ss, zs, strict=True)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    a = F16Act(*f16_prep.prep_ref(x), x.dtype)
    ref = wq_f16.wq4_f16_ref(a, ws[0], ss[0], zs[0]).float()
    rows = []
    for c in CONFIGS:
        if time.time() > deadline:
            break
        cfg = wq_f16.f16_config(*c)
        y0 = v.run(a, ws[0], ss[0], zs[0], cfg, 0)
        y2 = v.run(a, ws[0], *packed[0], cfg, 2)
        row = {"shape": name, "cfg": list(c), "packed_equal": bool(torch.equal(y0, y2)),
               "err": float((y0.float() - ref).abs().max() / ref.abs().max())}  # fmt: skip
        for sz in (0, 1, 2):
            args = packed if sz == 2 else list(zip(ss, zs, strict=True))

            def calls(sz=sz, args=args, cfg=cfg) -> None:
                for i in range(LAYERS):
                    v.run(a, ws[i], *args[i], cfg, sz, finish=False)

            row[f"sz{sz}_us"] = timed(calls)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(path: str, seconds: float) -> None:
    torch.manual_seed(0)
    deadline = time.time() + seconds
    v = _variant()
    out = {"device": torch.cuda.get_device_name(), "layers": LAYERS, "cases": []}
    for name, (n, k) in SHAPES.items():
        out["cases"] += shape_cases(v, name, n, k, deadline)
        torch.cuda.empty_cache()
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 240.0)
