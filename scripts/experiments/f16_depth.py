"""Experiment (GPU): the float16-code int4 kernel (``kiln.kernels.wq_f16``) alone at one
row of Llama-3.1-8B's projections, with its words through shared memory (``DEPTH``
iterations in flight, all issued before the PDL wait) against its register paths, µs a
call (CUDA graph over enough weight copies to come from memory, median of 5 replays).
Each result is checked against the kernel's reference first.

Usage: ``PYTHONPATH=. python scripts/experiments/f16_depth.py OUT.json``"""

import json
import sys
from pathlib import Path

import torch

from kiln.bench.gemv_bench import time_per_call_ms
from kiln.bench.quant_bench import weight_only_copies
from kiln.kernels import f16_prep, wq_f16

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # fmt: skip
BASES = ((2, 2, 1, 2, True), (1, 8, 2, 1, False), (1, 4, 1, 1, False), (2, 1, 1, 2, False),
         (1, 4, 2, 1, False), (2, 2, 2, 2, False))  # fmt: skip


def main(out: str) -> None:
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    res = {"device": torch.cuda.get_device_name(), "us": {}}
    for name, (n, k) in SHAPES.items():
        ws = weight_only_copies(n, k, 128)
        tiled = [(wq_f16.tile_words(p), s, z) for p, s, z, *_ in ws]
        xk = torch.randn(1, k, device="cuda", dtype=torch.bfloat16) if k != 4096 else x
        act = wq_f16.F16Act(*f16_prep.prep_ref(xk), xk.dtype)
        ref = wq_f16.wq4_f16_ref(act, *tiled[0]).float()
        by = {id(t[0]): t for t in tiled}
        for r, nw, split, ch, pf in BASES:
            for depth in (0, 2, 4):
                cfg = wq_f16.f16_config(r, nw, split, ch, pf and not depth, depth)
                y = wq_f16.wq4_f16(act, *tiled[0], cfg).float()
                err = float((y - ref).abs().max() / ref.abs().max())
                assert err < 2**-7, (name, cfg, err)
                fn = lambda w, c=cfg, b=by: wq_f16.wq4_f16(act, *b[id(w)], c)  # noqa: E731
                us = 1e3 * time_per_call_ms(fn, [t[0] for t in tiled], reps=5)
                key = f"{name} R{r} w{nw} s{split} ch{ch}{' pf' if pf else ''} d{depth}"
                res["us"][key] = round(us, 2)
                print(key, res["us"][key], flush=True)
        del ws, tiled, by
    Path(out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
