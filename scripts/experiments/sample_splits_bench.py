"""Experiment (GPU): the sampling kernel's time at small batches over Llama-3's vocabulary,
one program per row (splits=1, the kernel before 2026-12-01) against the vocabulary cut
across programs (``sample_splits``), greedy and temperature rows. CUDA-graph replays.

Usage: ``PYTHONPATH=. python scripts/experiments/sample_splits_bench.py OUT.json``."""

import json
import sys

import torch
import triton

from kiln.bench.kernels import graph_us
from kiln.kernels.sampling import sample_splits, sample_triton

VOCAB = 128256


def main() -> None:
    rows = []
    for n in (1, 4, 16, 64, 256):
        x = torch.randn(n, VOCAB, device="cuda")
        thr = torch.full((n,), float("-inf"), device="cuda")
        keys = torch.randint(0, 2**31, (n, 3), device="cuda")
        for kind, inv in (("greedy", 0.0), ("temperature", 1.25)):
            it = torch.full((n,), inv, device="cuda")
            one = graph_us(
                lambda x=x, it=it, thr=thr, keys=keys: sample_triton(x, it, thr, keys, 1), 50, 10
            )
            sp = sample_splits(n, VOCAB)
            best = graph_us(
                lambda x=x, it=it, thr=thr, keys=keys: sample_triton(x, it, thr, keys), 50, 10
            )
            same = torch.equal(sample_triton(x, it, thr, keys, 1), sample_triton(x, it, thr, keys))
            r = {"rows": n, "kind": kind, "splits": sp, "us_one_program": one, "us_split": best,
                 "same_tokens": same}  # fmt: skip
            print(r, flush=True)
            rows.append(r)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "vocab": VOCAB, "rows": rows}  # fmt: skip
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
