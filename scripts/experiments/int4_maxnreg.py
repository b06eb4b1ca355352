"""Experiment (H200): the one-row tensor-core int4 kernel (``kiln.kernels.wq_mma``) with
ptxas's register cap (``maxnreg``), so that more programs fit an SM.

The eighteenth session's offline compile for sm_90 found down's one-row pick (R 1,
8 warps, split 2, CH 1) at 66 registers, 3 programs an SM and 1.29 waves; capped at 64 it
compiles without spills to 4 programs and 0.97 waves. Here, for each Llama-3.1-8B
projection at one row, the int4h build's picks and configurations of the same occupancy
by other shapes, the 8-warp one-chunk ones uncapped and at 64 (``CAPS``): registers and
spills of the compiled kernel, the largest difference from the uncapped output (expected
0: a cap changes the schedule, not the arithmetic), and the time per call in a CUDA graph
over weight copies cycled past L2 (``gemv_bench.time_per_call_ms``). Then the four
projections of 32 layers in one graph with each shape's fastest uncapped configuration
against its fastest overall.

Usage: ``PYTHONPATH=. python scripts/experiments/int4_maxnreg.py OUT.json``"""

import json
import sys
from pathlib import Path

import torch

CONFIGS = (  # (R, warps, split, CH, PF): the picks, the same occupancy by other shapes
    (2, 2, 1, 2, True), (1, 8, 2, 1, False), (1, 8, 1, 1, False), (1, 8, 4, 1, False),
    (1, 4, 4, 1, False), (1, 4, 2, 1, False), (1, 4, 8, 1, False), (2, 4, 1, 2, False),
)  # fmt: skip
CAPS = (None, 64)
"""Offline (sm_90, 2026-12-04): every capped configuration below 64 registers spills, and
so do the two-chunk and prefetching ones at 64 (R 2, CH 2, PF at 64: 336 stack bytes);
R 1, 8 warps, CH 1 goes from 66 registers (3 programs an SM) to 64 without spilling (4)."""


class _Recorder:
    """Stands in for the kernel object: launches with ptxas's register cap ``cap`` (Triton's
    ``maxnreg`` option) where set, and records the compiled kernel of each launch."""

    def __init__(self, kernel):
        self.kernel, self.last, self.cap = kernel, None, None

    def __getitem__(self, grid):
        def launch(*a, **kw):
            self.last = self.kernel[grid](*a, **kw, **({"maxnreg": self.cap} if self.cap else {}))
            return self.last

        return launch


def main() -> None:
    from kiln.bench.gemv_bench import LLAMA_8B_SHAPES, rotation_copies, time_per_call_ms
    from kiln.bench.quant_bench import _wq_weights
    from kiln.kernels import wq_mma

    rec = _Recorder(wq_mma._wq4_mma_kernel)
    wq_mma._wq4_mma_kernel = rec
    torch.manual_seed(0)
    res = {"note": __doc__.split("\n\n")[0], "shapes": [], "chain": {}}
    shapes = {k: v for k, v in LLAMA_8B_SHAPES.items() if k != "lm_head"}
    best = {}
    for name, (n, k) in shapes.items():
        ws = _wq_weights(n, k, True, 128, rotation_copies(n * k // 2))
        ws = [(p, s.float().contiguous(), z) for p, s, z in ws]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        idx = {id(t[0]): t for t in ws}
        rows = []
        for r, nw, sp, ch, pf in CONFIGS:
            base = None
            for cap in CAPS:
                if cap is not None and (nw != 8 or ch != 1 or pf):
                    continue  # the cap spills (CH 2, PF) or does not bind (64 already)
                kw = {"r": r, "num_warps": nw, "split": sp, "ch": ch, "pf": pf}
                rec.cap = cap
                row = {"R": r, "warps": nw, "split": sp, "CH": ch, "PF": pf, "maxnreg": cap}
                try:
                    got = wq_mma.wq4_mma(x, *ws[0], **kw)
                    torch.cuda.synchronize()
                except Exception as e:  # a configuration that does not compile
                    row["error"] = repr(e)[:300]
                    rows.append(row)
                    print(name, row, flush=True)
                    continue
                ck = rec.last
                row["regs"] = getattr(ck, "n_regs", None)
                row["spills"] = getattr(ck, "n_spills", None)
                if base is None:
                    base = got
                row["max_diff"] = (got.float() - base.float()).abs().max().item()

                def fn(p, kw=kw, x=x, idx=idx, cap=cap):
                    rec.cap = cap
                    return wq_mma.wq4_mma(x, *idx[id(p)], **kw)

                row["us"] = time_per_call_ms(fn, [t[0] for t in ws], reps=7) * 1e3
                rows.append(row)
                print(name, row, flush=True)
        ok = sorted((r for r in rows if "us" in r and r["max_diff"] == 0), key=lambda r: r["us"])
        unc = [r for r in ok if r["maxnreg"] is None]
        best[name] = {"uncapped": unc[0], "any": ok[0]}
        res["shapes"].append({"shape": name, "n": n, "k": k, "best": ok[:6], "rows": rows})
        print(name, "best uncapped", unc[0], "best", ok[0], flush=True)
        Path(sys.argv[1]).write_text(json.dumps(res, indent=1))
        del ws, idx
        torch.cuda.empty_cache()
    _chain(res, shapes, best, rec)
    res["chain"]["configs"] = best
    Path(sys.argv[1]).write_text(json.dumps(res, indent=1))


def _chain(res: dict, shapes: dict, best: dict, rec: _Recorder) -> None:
    """The four projections of 32 layers in one CUDA graph, uncapped picks against the best."""
    from int4_row_stream import _graph_ms, _weights

    from kiln.kernels import wq_mma

    layers = [{nm: _weights(n, k, 1)[0] for nm, (n, k) in shapes.items()} for _ in range(32)]
    xs = {nm: torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
          for nm, (n, k) in shapes.items()}  # fmt: skip

    def kw(c):
        return {"r": c["R"], "num_warps": c["warps"], "split": c["split"], "ch": c["CH"],
                "pf": c["PF"]}  # fmt: skip

    def chain(which: str) -> None:
        for lw in layers:
            for nm in shapes:
                rec.cap = best[nm][which]["maxnreg"]
                wq_mma.wq4_mma(xs[nm], *lw[nm], **kw(best[nm][which]))

    for rnd in range(2):  # twice, interleaved, for the spread
        for which in ("uncapped", "any"):
            ms = _graph_ms(lambda w=which: chain(w))
            res["chain"].setdefault(which, []).append(ms)
            print("chain", rnd, which, round(ms, 4), "ms", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
