"""Experiment (H200): the tensor-core few-row int4 kernel at 9-16 rows, two token tiles on
the same weight fragments (``wq_mma._wq4_mma_kernel`` with NT 2; ``KILN_WQ_MMA16=1`` puts
it among the tuner's candidates there), against the engine's 16-row path (the Triton
tensor-core kernel, ``wq_config``'s default) at Llama-3.1-8B's projections.

1. Correctness: odd shapes and 9, 12, 16 rows against ``wq_linear_ref`` (within 1 % of
   the largest output), and at 9-16 rows the same as two 8-row calls on the halves.
2. Per projection at 16 rows, timed in a CUDA graph over rotated weight copies: the
   engine's path and a sweep of (R, warps, split, CH, PF); the best at 12 rows too.
3. The four projections of 32 layers in one CUDA graph at 16 rows, engine vs the best.

Usage: ``PYTHONPATH=. python scripts/experiments/int4_mma16.py OUT.json``."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
G = 128


def _run(x, wsz, c):
    from kiln.kernels.wq_mma import wq4_mma

    return wq4_mma(x, *wsz, r=c["r"], num_warps=c["nw"], split=c["split"], ch=c["ch"],
                   pf=c["pf"])  # fmt: skip


def _check(res: dict) -> bool:
    from int4_row_stream import _weights

    from kiln.kernels import wq_gemm as wq

    ok = True
    for n, k in ((6144, 4096), (4096, 14336), (1000, 384), (13, 256)):
        w, s, z = _weights(n, k, 1)[0]
        for m in (9, 12, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = wq.wq_linear_ref(x, w, s, z).float()
            for c in ({"r": 1, "nw": 1, "split": 1, "ch": 1, "pf": False},
                      {"r": 2, "nw": 4, "split": 3, "ch": 2, "pf": True},
                      {"r": 2, "nw": 2, "split": 1, "ch": 4, "pf": False}):  # fmt: skip
                y = _run(x, (w, s, z), c)
                halves = torch.cat([_run(x[:8], (w, s, z), c), _run(x[8:], (w, s, z), c)])
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                same = bool(torch.equal(y, halves))
                good = err < 1e-2 and same
                ok &= good
                res["check"].append({"n": n, "k": k, "m": m, **c, "rel_err": err,
                                     "same_as_halves": same})  # fmt: skip
                if not good:
                    print("WRONG", n, k, m, c, err, same, flush=True)
    return ok


def main() -> None:
    from int4_row_stream import _graph_ms, _weights

    from kiln.bench.gemv_bench import LLAMA_8B_SHAPES, rotation_copies, time_per_call_ms
    from kiln.kernels import wq_gemm as wq

    torch.manual_seed(0)
    res = {"note": __doc__.split("\n\n")[0], "check": [], "shapes": [], "chain": {}}
    out = Path(sys.argv[1])
    if not _check(res):
        out.write_text(json.dumps(res, indent=1))
        sys.exit(1)
    shapes = {k: v for k, v in LLAMA_8B_SHAPES.items() if k != "lm_head"}
    best = {}
    for name, (n, k) in shapes.items():
        ws = _weights(n, k, rotation_copies(n * k // 2))
        idx = {id(t[0]): t for t in ws}
        x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
        cfg = wq.wq_config(n, k, 16, G)
        packed = [t[0] for t in ws]
        eng = time_per_call_ms(
            lambda p, c=cfg, x=x, i=idx: wq.wq_linear_triton(x, *i[id(p)], config=c), packed, 10
        )
        rows = []
        for c in [{"r": r, "nw": nw, "split": sp, "ch": ch, "pf": pf}
                  for r in (1, 2) for nw in (2, 4, 8) for sp in (1, 2, 4) for ch in (1, 2)
                  for pf in (False, True) if k // 128 >= nw * ch * sp]:  # fmt: skip
            try:
                ms = time_per_call_ms(lambda p, c=c, x=x, i=idx: _run(x, i[id(p)], c), packed, 10)
            except Exception as e:
                print(name, c, "ERR", type(e).__name__, str(e)[:160], flush=True)
                continue
            rows.append({"us": ms * 1e3, **c})
        rows.sort(key=lambda r: r["us"])
        best[name] = rows[0]
        x12 = x[:12].contiguous()
        ms12 = time_per_call_ms(lambda p, x=x12, i=idx, c=rows[0]: _run(x, i[id(p)], c), packed, 10)
        res["shapes"].append(
            {
                "shape": name,
                "n": n,
                "k": k,
                "engine_m16_us": eng * 1e3,
                "engine_config": cfg,
                "best": rows[:6],
                "best_m12_us": ms12 * 1e3,
            }
        )
        print(name, "engine", round(eng * 1e3, 2), "mma16", round(rows[0]["us"], 2), rows[0],
              "m12", round(ms12 * 1e3, 2), flush=True)  # fmt: skip
        out.write_text(json.dumps(res, indent=1))
        del ws
        torch.cuda.empty_cache()
    layers = [{nm: _weights(n, k, 1)[0] for nm, (n, k) in shapes.items()} for _ in range(32)]
    xs = {nm: torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
          for nm, (n, k) in shapes.items()}  # fmt: skip

    def chain(mma: bool) -> None:
        for lw in layers:
            for nm, (n, k) in shapes.items():
                if mma:
                    _run(xs[nm], lw[nm], best[nm])
                else:
                    wq.wq_linear_triton(xs[nm], *lw[nm], config=wq.wq_config(n, k, 16, G))

    for label, mma in (("engine", False), ("mma16", True)):
        ms = _graph_ms(lambda f=mma: chain(f))
        res["chain"][f"{label}_m16"] = {"ms_32_layers": ms, "us_per_layer": ms * 1e3 / 32}
        print("chain m16", label, round(ms, 4), "ms", flush=True)
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
