"""Experiment (GPU). (1024, 2816) takes the float32 emulation (K is no multiple of 512).
: is ``torch._scaled_mm`` with 128-block scales (the fp8 "block"
scheme's GEMM, ``kiln.quant.formats._block_matmul_cuda``) deterministic, and is a row's
output independent of the other rows (the padding rows of a CUDA graph's batch)? Asked
because ``test_quant_gpu[fp8-block]`` saw eager and graph decode of one engine diverge on
2 of 6 greedy continuations at d9c4d7f (H100, 2026-12-05) while its kernel tests passed.

Usage: ``PYTHONPATH=. python scripts/experiments/block_mm_determinism.py OUT.json``"""

import json
import sys

import torch

from kiln.kernels import quant_act as qa
from kiln.quant import formats as qf

G = qf.FP8_BLOCK


def main(path: str) -> None:
    torch.manual_seed(0)
    rows = []
    for n, k in ((1024, 1024), (1536, 1024), (5632, 1024), (1024, 2816), (6144, 4096),
                 (28672, 4096)):  # fmt: skip
        w = torch.randn(n, k, device="cuda") * 0.02
        wq, ws = qf.quantize_fp8_block_weight(w)
        for m in (1, 6, 8, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a = qa.quantize_rows_ref(x, "fp8", group=G)
            outs = [qf._block_matmul_cuda(a, wq, ws, None, torch.bfloat16) for _ in range(20)]
            same_runs = all(torch.equal(outs[0], o) for o in outs[1:])
            # the same rows inside a larger batch whose other rows are random
            big = torch.cat([x, torch.randn(2, k, device="cuda", dtype=torch.bfloat16) * 5])
            b = qa.quantize_rows_ref(big, "fp8", group=G)
            inside = qf._block_matmul_cuda(b, wq, ws, None, torch.bfloat16)[:m]
            ref = qf.act_matmul_ref(a, wq, ws, None, torch.float32)
            moved = (inside.float() - outs[0].float()).abs().max().item()
            err = ((outs[0].float() - ref).abs().max() / ref.abs().max()).item()
            rows.append(dict(n=n, k=k, m=m, deterministic=same_runs,
                             row_independent=torch.equal(inside, outs[0]),
                             max_diff_in_batch=moved, max_rel_err=err))  # fmt: skip
            print(rows[-1], flush=True)
    with open(path, "w") as f:
        json.dump({"name": "block-mm-determinism", "device": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
