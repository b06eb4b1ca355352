"""Experiment (H200): the token-blocked q rotary kernel (``kiln.kernels.rotary_q``) alone, at
Llama-3.1-8B's heads, over tokens per program and heads per program, with and without the
Hadamard product; the GB/s count q read once and written once. Checked against
``rotary_write_kv_ref``'s q first. Usage: ``PYTHONPATH=. python
scripts/experiments/rotary_q_sweep.py OUT.json``."""

import json
import sys

import torch

from kiln.bench.kernels import median_cuda_ms
from kiln.kernels.rotary import hadamard_signs, rotary_write_kv_ref
from kiln.kernels.rotary_q import rotary_q_triton
from kiln.layers.rotary import RotaryEmbedding

hq, hk, d = 32, 8, 128
cs = RotaryEmbedding(d, 16384, 500000.0, None).cos_sin(torch.device("cuda"))
signs = hadamard_signs(d, "cuda", torch.bfloat16)
rows = []
for t in (816, 2048, 8192, 16384):
    qkv = torch.randn(t, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(t, device="cuda")
    cache = torch.zeros(2, t // 16 + 1, 16, hk, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(t, device="cuda")
    q = torch.empty(t, hq, d, device="cuda", dtype=torch.bfloat16)
    row = {"tokens": t}
    for name, sg in (("plain", None), ("rotated", signs)):
        ref = rotary_write_kv_ref(qkv, pos, cs, cache, slots, hq, hk, d, None, sg)
        best = None
        for bt in (16, 32, 64):
            for heads in (2, 4, 8, 16, 32):
                rotary_q_triton(qkv, pos, cs, q, sg, bt, heads)
                err = float((q.float() - ref.float()).abs().max() / ref.float().abs().max())
                ms = median_cuda_ms(lambda bt=bt, h=heads, sg=sg: rotary_q_triton(
                    qkv, pos, cs, q, sg, bt, h))  # fmt: skip
                key = f"{name}_bt{bt}_h{heads}"
                row[key] = {"ms": ms, "gb_s": 2 * q.numel() * 2 / ms / 1e6, "err": err}
                if best is None or ms < best[0]:
                    best = (ms, key)
        row[f"best_{name}"] = best
    print(json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)}), flush=True)
    rows.append(row)
with open(sys.argv[1], "w") as f:
    json.dump(rows, f, indent=1)
