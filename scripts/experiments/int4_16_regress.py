"""Experiment (H200): the 16-row int4 projections with the kernel of d8e97bb (token tiles
generalised) against the same configuration in the kernel of 780f028 (NT 2 by hand), and
the int4 lm_head (128256 x 4096, untuned in builds) at 1 / 8 / 16 / 32 rows: the new
untuned default, the old one (tl.dot past 8 rows), and the tuner's best.

Usage: ``git show 780f028:kiln/kernels/wq_mma.py > scripts/experiments/wq_mma_780f028.py``
(the old kernel, not kept in the tree), then
``PYTHONPATH=. python scripts/experiments/int4_16_regress.py OUT.json``"""

import json
import sys
from pathlib import Path

import torch

from kiln.bench.gemv_bench import rotation_copies, time_per_call_ms
from kiln.bench.quant_bench import _wq_weights, tune_weight_only
from kiln.kernels import wq_gemm as wq
from kiln.kernels import wq_mma

sys.path.insert(0, str(Path(__file__).parent))
import wq_mma_780f028 as old

PICKS = {  # the d8e97bb build's 16-row picks: R, warps, split, CH
    (4096, 4096): (2, 2, 4, 2), (4096, 14336): (2, 2, 4, 2), (6144, 4096): (2, 1, 4, 4),
    (28672, 4096): (2, 1, 4, 2),
}  # fmt: skip


def main() -> None:
    res = {"note": __doc__.split("\n\n")[0], "rows": []}
    for (n, k), (r, w, split, ch) in PICKS.items():
        ws = _wq_weights(n, k, True, 128, rotation_copies(n * k // 2))
        idx = {id(t[0]): t for t in ws}
        x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
        kw = dict(r=r, num_warps=w, split=split, ch=ch)
        out = {}
        for name, mod in (("new", wq_mma), ("old", old), ("new2", wq_mma), ("old2", old)):

            def run(p, mod=mod, idx=idx, x=x, kw=kw):
                _, s, z = idx[id(p)]
                return mod.wq4_mma(x, p, s, z, **kw)

            out[name] = time_per_call_ms(run, [t[0] for t in ws], reps=20)
        same = torch.equal(run(ws[0][0]), wq_mma.wq4_mma(x, ws[0][0], ws[0][1], ws[0][2], **kw))
        res["rows"].append({"n": n, "k": k, "m": 16, **kw, **out, "same_bits": same})
        print(n, k, {a: round(b * 1e3, 2) for a, b in out.items()}, same, flush=True)
        del ws
    n, k = 128256, 4096
    ws = _wq_weights(n, k, True, 128, rotation_copies(n * k // 2))
    idx = {id(t[0]): t for t in ws}
    for m in (1, 8, 16, 32):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row = {"n": n, "k": k, "m": m}
        for name, cfg in (
            ("new_default", wq.wq_default_config(n, k, m, 128)),
            ("old_default", wq.wq_default_config(n, k, m, 128, mma=m <= 8)),
        ):

            def run(p, cfg=cfg, idx=idx, x=x):
                _, s, z = idx[id(p)]
                return wq.wq_linear_triton(x, p, s, z, None, None, cfg)

            row[name] = time_per_call_ms(run, [t[0] for t in ws], reps=10)
            row[name + "_cfg"] = cfg
        top = tune_weight_only(n, k, m, 128, reps=3)
        row["tuned_top3"] = [{**t["config"], "ms": t["ms"]} for t in top[:3] if "ms" in t]
        res["rows"].append(row)
        print("head", m, round(row["new_default"] * 1e3, 2), round(row["old_default"] * 1e3, 2),
              row["tuned_top3"][:1], flush=True)  # fmt: skip
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
