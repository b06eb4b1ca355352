"""Experiment (H200): decode attention over an fp8 cache at the large batches of the
1000/1000 throughput run, timed in whichever tree ``PYTHONPATH`` names (this one, or
f03a598's in old_f03a598/), for the tier's warps and blocks-a-step candidates at one
split (the launcher's count at these batches). The 2026-12-04 step traces at 882
sequences of ~1,050 tokens put ``_decode_partial`` at 673.6 us a layer here against
537.5 in f03a598's tree.

The 2026-12-04 figures were timed with 3 warm-up calls and the median of 15; the script
now uses ``kiln.bench.kernels.median_cuda_ms`` (2 warm-ups, 15), in both trees.

Usage: ``PYTHONPATH=<tree> python scripts/experiments/decode_ab_trees.py OUT.json``."""

import json
import sys

import torch

from kiln.bench.kernels import median_cuda_ms
from kiln.kernels.decode_attention import decode_attention_triton

CASES = ((896, 1100), (896, 1500), (800, 2176), (512, 256))
CONFIGS = [(w, n) for w in (4, 8) for n in (1, 2, 4)]


def main() -> None:
    torch.manual_seed(0)
    hq, hk, d, bs, dev = 32, 8, 128, 32, "cuda"
    rows = []
    for batch, ctx in CASES:
        nb = -(-ctx // bs)
        kv = torch.randn(2, batch * nb, bs, hk, d, device=dev).to(torch.float8_e4m3fn)
        scales = torch.ones(2, device=dev)
        tables = torch.randperm(batch * nb, device=dev, dtype=torch.int32).view(batch, nb)
        lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
        tok = torch.arange(batch, device=dev)
        q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        args = (q, kv, tables, lens, tok, out, d**-0.5, 4096, None)
        for w, n in CONFIGS:
            kw = {"num_splits": 1, "num_warps": w, "kv_scale": scales, "blocks_per_step": n}
            ms = median_cuda_ms(lambda a=args, kw=kw: decode_attention_triton(*a, **kw), 15)
            gbs = 2 * batch * ctx * hk * d / ms / 1e6
            rows.append({"batch": batch, "ctx": ctx, "num_warps": w, "blocks_per_step": n,
                         "us": round(ms * 1e3, 1), "cache_GB_s": round(gbs)})  # fmt: skip
            print(f"{batch:5d} x {ctx:5d} w{w} n{n}: {ms * 1e3:8.1f} us {gbs:7.0f} GB/s")
        del kv, args
    with open(sys.argv[1], "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
