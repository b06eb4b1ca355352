"""Dump registers, spills and the SASS opcode histogram of ``int4_row_words``'s kernel at a
few configurations (GPU). Usage: ``PYTHONPATH=. python scripts/experiments/int4_row_sass.py
OUTDIR``; writes OUTDIR/<label>.sass."""

import collections
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import int4_row_words as m
from triton.tools.disasm import get_sass

for label, (n, k, bn, bk, sp, nw, lo, var) in {
    "gate_up_w4b": (28672, 4096, 32, 512, 4, 4, False, "w4b"),
    "gate_up_w4r": (28672, 4096, 8, 4096, 1, 4, False, "w4r"),
}.items():
    w, s, z = m._weights(n, k, 1, "cuda")[0]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sp, "num_warps": nw}
    m.run_w4(x, w, s, z, cfg, lo, var)
    jit = {"w4": m._w4_kernel, "w4b": m._w4b_kernel, "w4r": m._w4r_kernel}[var]
    kern = list(jit.device_caches[0][0].values())[-1]
    sass = get_sass(kern.asm["cubin"])
    with open(os.path.join(sys.argv[1], label + ".sass"), "w") as f:
        f.write(sass)
    ops = collections.Counter()
    for ln in sass.splitlines():
        hit = re.match(r"\S+\t(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln)
        if hit:
            ops[hit.group(1)] += 1
    print(label, "regs", kern.n_regs, "spills", kern.n_spills, "instrs", sum(ops.values()))
    print("  ", ops.most_common(22))
