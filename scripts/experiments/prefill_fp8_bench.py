"""Experiment (H200): prefill attention over a bfloat16 cache and over an fp8 one (Llama-3.1-8B
heads), whole prompts of 8 x 2,048 tokens, 16 x 1,024 and 64 x 128, at every candidate
launch configuration (``prefill_config_candidates``; the engine tunes among them at build),
reporting each and the best per cache (correctness: the GPU tests of ``test_kv_fp8``).
Usage: ``PYTHONPATH=. python scripts/experiments/prefill_fp8_bench.py OUT.json``."""

import functools
import json
import sys

import torch

from kiln.bench.kernels import _paged, median_cuda_ms
from kiln.kernels.prefill_attention import prefill_attention_triton, prefill_config_candidates

rows = []
hq, hk, d, bs = 32, 8, 128, 32
for batch, n in ((8, 2048), (16, 1024), (64, 128)):
    q, cache, meta = _paged(batch, n, n, hq, hk, d, bs, torch.bfloat16)
    flops = batch * 4 * hq * d * n * (n + 1) // 2
    scales = torch.tensor([0.05, 0.05], device="cuda")
    fp8 = (cache.float() / 0.05).to(torch.float8_e4m3fn)
    out = torch.empty_like(q)
    row = {"batch": batch, "tokens": n}
    for name, kv, s in (("bf16", cache, None), ("fp8", fp8, scales)):
        for cfg in prefill_config_candidates(d, torch.bfloat16):
            fn = functools.partial(prefill_attention_triton, q, kv, meta.block_tables,
                                   meta.seq_lens, meta.query_start_loc, out, d**-0.5, n,
                                   kv_scale=s, **cfg)  # fmt: skip
            key = (
                f"{name}_{cfg['BLOCK_M']}x{cfg['BLOCK_N']}_w{cfg['num_warps']}_s{cfg['num_stages']}"
            )
            ms = median_cuda_ms(fn, 10)
            row[key] = {"ms": ms, "tflops": flops / ms / 1e9,
                        "finite": bool(out.isfinite().all())}  # fmt: skip
        best = max((v["tflops"], k) for k, v in row.items() if k.startswith(name + "_"))
        row[f"best_{name}"] = best
    print(json.dumps({k: row[k] for k in ("batch", "tokens", "best_bf16", "best_fp8")}), flush=True)
    rows.append(row)
    del fp8, q, cache
with open(sys.argv[1], "w") as f:
    json.dump(rows, f, indent=1)
