"""Prefill attention of whole prompts over an fp8 cache against over their own K/V as
computed (``fresh_kv``): Llama-3.1-8B heads (32 q, 8 kv, D 128), N prompts of L tokens in
one step, each launch configuration of ``PREFILL_CONFIGS``; TFLOP/s of the causal work.
Usage: python scripts/experiments/prefill_fresh_bench.py OUT.json [N L]"""

import json
import sys

import torch
import triton

from kiln.kernels.attention import KV_FP8, AttentionMetadata
from kiln.kernels.prefill_attention import PREFILL_CONFIGS, prefill_attention_triton

out_path = sys.argv[1]
n, ln = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (8, 2048)
hq, hk, d, bs = 32, 8, 128, 32
t = n * ln
dev = torch.device("cuda")
torch.manual_seed(0)
blocks = n * ln // bs
cache = (torch.randn(2, blocks + 1, bs, hk, d, device=dev) * 20).clamp(-448, 448).to(KV_FP8)
scales = torch.tensor([0.05, 0.05], device=dev)
tables = torch.arange(blocks, dtype=torch.int32, device=dev).view(n, ln // bs)
starts = [i * ln for i in range(n + 1)]
meta = AttentionMetadata(
    query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
    seq_lens=torch.full((n,), ln, dtype=torch.int32, device=dev),
    block_tables=tables, slot_mapping=torch.zeros(t, dtype=torch.int64, device=dev),
    query_start_loc_cpu=starts, seq_lens_cpu=[ln] * n,
)
q = torch.randn(t, hq, d, device=dev, dtype=torch.bfloat16)
qkv = torch.randn(t, (hq + 2 * hk) * d, device=dev, dtype=torch.bfloat16)
kf = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
vf = qkv[:, (hq + hk) * d :].view(t, hk, d)
o = torch.empty_like(q)
flops = 4 * n * hq * d * (ln * (ln + 1) / 2)
res = {"n": n, "len": ln, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
       "triton": triton.__version__, "configs": []}
for cfg in PREFILL_CONFIGS:
    row = dict(cfg)
    for name, fresh in (("cache", None), ("fresh", (kf, vf))):
        def call():
            prefill_attention_triton(q, cache, tables, meta.seq_lens, meta.query_start_loc, o,
                                     d**-0.5, ln, None, None, kv_scale=scales, fresh_kv=fresh,
                                     **cfg)
        try:
            ms = triton.testing.do_bench(call, warmup=10, rep=50)
            row[name + "_ms"] = round(ms, 4)
            row[name + "_tflops"] = round(flops / ms / 1e9, 1)
        except Exception as e:  # a config that does not compile: say so
            row[name + "_error"] = str(e)[:200]
    print(row, flush=True)
    res["configs"].append(row)
with open(out_path, "w") as f:
    json.dump(res, f, indent=1)
