"""Experiment (H200): the tensor-core int4 kernel (``kiln.kernels.wq_mma``) with its scales
and zeros loaded an iteration ahead with the words (``PS``, beside the words' register
prefetch ``PF``), against the same configuration without.

Why: with scales and zeros held constant ("nosz", 2026-12-02, int4_gap.py) the one-row
kernel ran 2.6 us faster on gate_up (23.36 -> 20.78), 1.0 on down, 0.6 on qkv and 0.4 on o:
their loads are issued inside the iteration that needs them, so each chunk waits a memory
round trip. ``PS`` costs six registers at R 2 (128 -> 134 with PDL, sm_90).

For each Llama-3.1-8B projection and row count, every ``PF`` configuration of the tuner's
list and a few more, with and without ``PS``: the outputs must be identical (the same
arithmetic), then both are timed (weights cycled past L2, CUDA graph replays).

Usage: ``PYTHONPATH=. python scripts/experiments/int4_ps.py OUT.json [ROWS]`` (ROWS: 1,4,8)"""

import json
import sys

import torch

CONFIGS = (  # (R, warps, split, CH) with PF: the tuner's two and int4_gap.py's px set
    (1, 8, 1, 2), (2, 2, 1, 2), (1, 4, 2, 1), (1, 4, 2, 2), (2, 4, 2, 1), (1, 8, 2, 2),
    (1, 4, 1, 2), (1, 2, 4, 2), (2, 4, 1, 2), (1, 8, 2, 1), (1, 4, 4, 1), (2, 2, 2, 2),
)  # fmt: skip


def main() -> None:
    from kiln.bench.gemv_bench import LLAMA_8B_SHAPES, rotation_copies, time_per_call_ms
    from kiln.bench.quant_bench import _wq_weights
    from kiln.kernels.wq_mma import wq4_mma

    rows_list = [int(r) for r in (sys.argv[2] if len(sys.argv) > 2 else "1").split(",")]
    res = {"note": __doc__.split("\n\n")[0], "shapes": []}
    for name, (n, k) in LLAMA_8B_SHAPES.items():
        if name == "lm_head":
            continue
        ws = _wq_weights(n, k, True, 128, rotation_copies(n * k // 2))
        ws = [(p, s.float().contiguous(), z) for p, s, z in ws]
        packed = [t[0] for t in ws]
        idx = {id(t[0]): t for t in ws}
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = []
            for r, nw, sp, ch in CONFIGS:
                row = {"R": r, "warps": nw, "split": sp, "CH": ch}
                for ps in (False, True):
                    kw = {"r": r, "num_warps": nw, "split": sp, "ch": ch, "pf": True, "ps": ps}

                    def fn(p, x=x, kw=kw, idx=idx):
                        return wq4_mma(x, *idx[id(p)], **kw)

                    got = fn(packed[0])
                    if not ps:
                        base = got
                    else:
                        row["max_diff"] = (got.float() - base.float()).abs().max().item()
                    row["ps_us" if ps else "us"] = time_per_call_ms(fn, packed, reps=9) * 1e3
                out.append(row)
                print(name, m, row, flush=True)
            best = min(out, key=lambda r: r["us"])
            best_ps = min(out, key=lambda r: r["ps_us"])
            res["shapes"].append({"shape": name, "n": n, "k": k, "rows": m, "kernel": out,
                                  "best": best, "best_ps": best_ps})  # fmt: skip
            print(name, m, "best", best["us"], "best with PS", best_ps["ps_us"], flush=True)
        del ws, packed, idx
        torch.cuda.empty_cache()
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
