"""Experiment (H200): prefill attention over a bfloat16 cache and over an fp8 one (Llama-3.1-8B
heads), whole prompts of 8 x 2,048 tokens and 16 x 1,024 (correctness: the GPU tests
of ``test_kv_fp8``). Usage: ``PYTHONPATH=. python
scripts/experiments/prefill_fp8_bench.py OUT.json``."""

import functools
import json
import sys

import torch

from kiln.bench.kernels import _paged, median_cuda_ms
from kiln.kernels.attention import paged_attention

rows = []
hq, hk, d, bs = 32, 8, 128, 32
for batch, n in ((8, 2048), (16, 1024)):
    q, cache, meta = _paged(batch, n, n, hq, hk, d, bs, torch.bfloat16)
    flops = batch * 4 * hq * d * n * (n + 1) // 2
    bf16_ms = median_cuda_ms(functools.partial(paged_attention, q, cache, meta, d**-0.5), 10)
    scales = torch.tensor([0.05, 0.05], device="cuda")
    fp8 = (cache.float() / 0.05).to(torch.float8_e4m3fn)
    del cache
    fn = functools.partial(paged_attention, q, fp8, meta, d**-0.5, kv_scale=scales)
    fp8_ms = median_cuda_ms(fn, 10)
    out = fn().float()
    row = {"batch": batch, "tokens": n, "bf16_ms": bf16_ms, "fp8_ms": fp8_ms,
           "bf16_tflops": flops / bf16_ms / 1e9, "fp8_tflops": flops / fp8_ms / 1e9,
           "fp8_finite": bool(out.isfinite().all())}  # fmt: skip
    print(json.dumps(row), flush=True)
    rows.append(row)
    del fp8, q
with open(sys.argv[1], "w") as f:
    json.dump(rows, f, indent=1)
