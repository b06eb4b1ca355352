"""Experiment (H200): decode attention at batch 1 and a short context (the 128/128 latency
run's steps) for every candidate configuration the build's tuner times, called as the
engine's CUDA graphs call it (``max_seq_len`` the engine's limit, 4,096), 32 calls (one per
layer) in one graph. Llama-3.1-8B's heads (32 query, 8 kv, 128 wide), bf16 cache.

Why: three builds of the int4 engine picked three configurations and their batch-1 TPOT
spread from 2.06 to 2.50 ms; the tuner's cases have no batch-1 short context.

Also at more sequences (``BATCHES``, e.g. ``1,16,32``: each sequence its own blocks), where
the launcher takes the main configuration (above ``small_batch``'s 8 sequences), which the
tuner still times by single calls: one build at 16 sequences ran 3.78 ms a step with
528 / 4 / 1 there, another 4.51 with 1,056 / 4 / 2.

Also (2026-12-06) at other engine limits (``LIMITS=4096,512``: fewer idle split programs at
the same context) and for chosen configurations only (``CONFIGS=528/4/1,1056/4/1``: target
programs / warps / blocks a step).

Usage: ``PYTHONPATH=. [BATCHES=1] [LIMITS=4096] [CONFIGS=...] python
scripts/experiments/decode_b1_configs.py OUT.json``."""

import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    from int4_row_stream import _graph_ms

    from kiln.kernels.decode_attention import decode_attention_triton
    from kiln.kernels.tuning import set_tuning

    hq, hk, d, bs = 32, 8, 128, 32
    res = {"note": __doc__.split("\n\n")[0], "device": torch.cuda.get_device_name(),
           "rows": []}  # fmt: skip
    limits = [int(v) for v in os.environ.get("LIMITS", "4096").split(",")]
    configs = list(itertools.product((264, 528, 1056), (4, 8), (1, 2, 4)))
    if os.environ.get("CONFIGS"):
        configs = [tuple(int(x) for x in c.split("/")) for c in os.environ["CONFIGS"].split(",")]
    for b, ctx in itertools.product(
        [int(v) for v in os.environ.get("BATCHES", "1").split(",")], (200, 1000)
    ):
        nb = -(-ctx // bs)
        kv = torch.randn(2, nb * b * 32, bs, hk, d, device="cuda", dtype=torch.bfloat16)
        tables = torch.randperm(nb * b * 32, device="cuda", dtype=torch.int32).view(32, b, nb)
        lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
        tok = torch.arange(b, device="cuda", dtype=torch.int64)
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        for (tp, w, n), limit in itertools.product(configs, limits):
            cfg = {"target_programs": tp, "num_warps": w, "blocks_per_step": n}
            set_tuning({"decode_attention": cfg})

            def layers(a=(q, kv, tables, lens, tok, out), lim=limit) -> None:
                for i in range(32):
                    decode_attention_triton(a[0], a[1], a[2][i], a[3], a[4], a[5], d**-0.5, lim)

            ms = _graph_ms(layers)
            res["rows"].append({"batch": b, "ctx": ctx, **cfg, "limit": limit,
                                "us_per_call": ms * 1e3 / 32})  # fmt: skip
            print(b, ctx, tp, w, n, limit, round(ms * 1e3 / 32, 2), flush=True)
            Path(sys.argv[1]).write_text(json.dumps(res, indent=1))
    set_tuning(None)


if __name__ == "__main__":
    main()
