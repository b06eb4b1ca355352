"""Experiment (H200): where the one-row tensor-core int4 kernel loses to a plain stream of
the same bytes (2026-12-02: gate_up 23.96 us against 16.65, down 15.25 against 9.29).

For each Llama-3.1-8B projection at one row, a few ``wq_mma`` configurations (the
int4h build's picks and their neighbours), each with two levers on and off:

- ``cg``: the words loaded with ``.cg`` (past L1), so that the streamed words cannot push
  the scales' and zeros' lines out of L1 between the chunks that share them;
- ``T``: scales and zeros stored group-major ((groups, N), read through a transposed
  view), so that the eight rows of a warp's scale load share one 32-byte sector instead
  of touching eight.

- ``tiled`` (``GAP_SET=tiled``): the words stored so that each 128-code chunk of a
  16-row tile is 1 KB of contiguous memory (``wq_mma_ring.tile_words``), each warp's load
  512 contiguous bytes, instead of 64-byte runs of eight rows 2 KB and more apart;
- ``ST``: the words streamed by ``cp.async`` through a ring of ST slots in shared memory
  (one chunk a warp per step), so that ST - 1 steps' words are in flight without the
  registers a register prefetch holds (``RING`` configurations).

- ``px`` (``GAP_SET=px``): with the words' register prefetch, x's pairs, the scales and
  the zeros loaded one iteration ahead too (``wq_mma_ring._regs_px``), so that the
  arithmetic of an iteration does not wait on them; checked against the base output.

- ``diag`` (``GAP_SET=diag``): each configuration with its arithmetic removed (the words
  loaded and folded: "nomath") and with x, scales and zeros constant ("noload"): what
  the loads alone, and the arithmetic without its per-chunk loads, cost. ``GAP_DIAGS``
  picks others (2026-12-02, after those two): "nosum" (no sum(x) ``mma``), "noprmt" (x's
  pairs as loaded, no ``prmt``), "lean" (both) and "nosz" (x loaded, scales and zeros
  constant): what precomputed group sums of x, or x stored in the order the fragments
  take it, could save.

Every variant but the diagnostics is checked against the base configuration's output
first.
``GAP_LEVERS=0`` times the base configurations and the ring alone.

Usage: ``PYTHONPATH=. python scripts/experiments/int4_gap.py OUT.json``"""

import json
import os
import sys

import torch

CONFIGS = (  # (R, warps, split, CH, PF): int4h's picks and their neighbours
    (2, 2, 1, 2, True), (1, 8, 2, 1, False), (1, 4, 4, 1, False), (2, 4, 1, 2, False),
    (1, 8, 1, 2, True), (1, 4, 8, 1, False),
)  # fmt: skip
TILED_MORE = (  # (R, warps, split, CH, PF): more of the tuner's candidates
    (2, 2, 2, 2, False), (2, 4, 2, 2, False), (1, 8, 1, 2, False), (2, 1, 4, 4, False),
    (2, 4, 4, 4, False), (1, 2, 8, 1, False), (1, 8, 4, 1, False), (2, 2, 1, 2, False),
)  # fmt: skip
PX_MORE = (  # (R, warps, split, CH, PF): more configurations for the "px" lever
    (1, 4, 2, 1, True), (1, 4, 2, 2, True), (2, 4, 2, 1, True), (1, 8, 2, 2, True),
    (1, 4, 1, 2, True), (1, 2, 4, 2, True),
)  # fmt: skip
RING = tuple(  # (R, warps, split, ST)
    (r, nw, split, st) for r in (1, 2) for nw in (2, 4, 8) for split in (1, 2) for st in (3, 5)
    if r * nw <= 8
)  # fmt: skip


def main() -> None:
    from kiln.bench.gemv_bench import LLAMA_8B_SHAPES, rotation_copies, time_per_call_ms
    from kiln.bench.quant_bench import _wq_weights
    from scripts.experiments.wq_mma_ring import tile_words, wq4_mma

    res = {"note": __doc__.split("\n\n")[0], "shapes": []}
    for name, (n, k) in LLAMA_8B_SHAPES.items():
        if name == "lm_head":
            continue
        ws = _wq_weights(n, k, True, 128, rotation_copies(n * k // 2))
        gap_set = os.environ.get("GAP_SET", "levers,ring").split(",")
        if "tiled" in gap_set:  # words in tile order, layout as given
            tw = [(tile_words(p), s, z) for p, s, z in ws]
        else:  # scales and zeros group-major
            tw = [(p, s.t().contiguous().t(), z.t().contiguous().t()) for p, s, z in ws]
        idx = {id(t[0]): (t, u) for t, u in zip(ws, tw, strict=True)}
        packed = [t[0] for t in ws]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        rows = []
        levers = ((False, False), (False, True), (True, False), (True, True))
        if os.environ.get("GAP_LEVERS", "1") == "0" or "levers" not in gap_set:
            levers = ((False, False),)
        ref = wq4_mma(x, *ws[0], r=1, num_warps=4, split=1, ch=1)
        variants = [({"R": r, "warps": nw, "split": sp, "CH": ch, "PF": pf, "cg": cg, "T": tr},
                     {"r": r, "num_warps": nw, "split": sp, "ch": ch, "pf": pf,
                      "wcm": ".cg" if cg else ""}, tr)
                    for r, nw, sp, ch, pf in CONFIGS for cg, tr in levers]  # fmt: skip
        if "ring" in gap_set:
            variants += [({"R": r, "warps": nw, "split": sp, "ST": st},
                          {"r": r, "num_warps": nw, "split": sp, "st": st}, False)
                         for r, nw, sp, st in RING]  # fmt: skip
        diags = os.environ.get("GAP_DIAGS", "nomath,noload").split(",")
        if "diag" in gap_set:  # wrong results by design: timed, not checked
            variants += [({"R": r, "warps": nw, "split": sp, "CH": ch, "PF": pf, "diag": d},
                          {"r": r, "num_warps": nw, "split": sp, "ch": ch, "pf": pf,
                           "wcm": d}, False)
                         for r, nw, sp, ch, pf in CONFIGS
                         for d in diags]  # fmt: skip
        if "px" in gap_set:  # x, scales and zeros loaded an iteration ahead (checked)
            variants += [({"R": r, "warps": nw, "split": sp, "CH": ch, "PF": True, "px": True},
                          {"r": r, "num_warps": nw, "split": sp, "ch": ch, "pf": True,
                           "wcm": "px"}, False)
                         for r, nw, sp, ch, _ in CONFIGS + PX_MORE]  # fmt: skip
        if "tiled" in gap_set:  # tr: the tiled words (idx's second entry)
            variants += [({"R": r, "warps": nw, "split": sp, "CH": ch, "PF": pf, "tiled": True},
                          {"r": r, "num_warps": nw, "split": sp, "ch": ch, "pf": pf,
                           "tiled": True}, True)
                         for r, nw, sp, ch, pf in CONFIGS + TILED_MORE]  # fmt: skip
        for cfg, kw, tr in variants:

            def fn(p, x=x, kw=kw, tr=tr, idx=idx):
                t = idx[id(p)][1 if tr else 0]
                return wq4_mma(x, *t, **kw)

            row = dict(cfg)
            try:
                got = fn(ws[0][0])
                row["max_diff"] = (got.float() - ref.float()).abs().max().item()
            except Exception as e:  # a variant that does not compile
                row["error"] = repr(e)[:300]
            else:
                if "diag" in cfg:
                    row["us"] = time_per_call_ms(fn, packed, reps=7) * 1e3
                elif row["max_diff"] > 1e-2 * ref.float().abs().max().item():
                    row["error"] = "differs from the base configuration"
                else:
                    row["us"] = time_per_call_ms(fn, packed, reps=7) * 1e3
            rows.append(row)
            print(name, row, flush=True)
        ok = sorted((r for r in rows if "us" in r and "diag" not in r), key=lambda r: r["us"])
        res["shapes"].append({"shape": name, "n": n, "k": k, "best": ok[:5], "kernel": rows})
        print(name, "best", ok[:3], flush=True)
        del ws, tw, packed, idx
        torch.cuda.empty_cache()
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
