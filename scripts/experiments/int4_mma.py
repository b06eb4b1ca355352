"""Experiment (H200): the tensor-core few-row int4 kernel (``kiln.kernels.wq_mma``) against
the engine's int4 kernels (``wq_gemm.wq_linear_triton`` with its default configuration).

1. Correctness: every shape below (odd ones too) and M in 1, 3, 8 against
   ``wq_linear_ref`` (largest error under 1 % of the largest output; bfloat16 output).
2. Per Llama-3.1-8B projection, M = 1: a sweep of (R, num_warps, split), timed in a CUDA
   graph over rotated weight copies (weights from HBM); M = 8 for the best one.
3. The four projections of 32 layers in one CUDA graph, engine against the best configs.

Usage: ``PYTHONPATH=. python scripts/experiments/int4_mma.py OUT.json``."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
G = 128


def _check(res: dict) -> bool:
    from int4_row_stream import _weights

    from kiln.kernels import wq_gemm as wq
    from kiln.kernels.wq_mma import wq4_mma

    ok = True
    for n, k in ((6144, 4096), (4096, 14336), (1000, 384), (13, 256), (4104, 640)):
        w, s, z = _weights(n, k, 1)[0]
        for m in (1, 3, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = wq.wq_linear_ref(x, w, s, z).float()
            for r, nw, split, ch, pf in ((1, 1, 1, 1, False), (2, 2, 3, 2, True),
                                         (4, 1, 2, 1, True), (8, 4, 1, 2, False)):  # fmt: skip
                y = wq4_mma(x, w, s, z, r=r, num_warps=nw, split=split, ch=ch, pf=pf).float()
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                good = err < 1e-2
                ok &= good
                res["check"].append({"n": n, "k": k, "m": m, "r": r, "nw": nw, "split": split,
                                     "ch": ch, "pf": pf, "rel_err": err, "ok": good})  # fmt: skip
                if not good:
                    print("WRONG", n, k, m, r, nw, split, err, flush=True)
    b = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    w, s, z = _weights(1000, 384, 1)[0]
    x = torch.randn(2, 384, device="cuda", dtype=torch.bfloat16)
    ref = wq.wq_linear_ref(x, w, s, z, bias=b).float()
    err = ((wq4_mma(x, w, s, z, bias=b).float() - ref).abs().max() / ref.abs().max()).item()
    res["check"].append({"bias": True, "rel_err": err, "ok": err < 1e-2})
    ok &= err < 1e-2
    print("check", "ok" if ok else "FAILED", len(res["check"]), flush=True)
    return ok


def _run(x, wsz, c, out=None):
    from kiln.kernels.wq_mma import wq4_mma

    return wq4_mma(x, *wsz, r=c["r"], num_warps=c["nw"], split=c["split"], ch=c["ch"],
                   pf=c["pf"], out=out)  # fmt: skip


def _sweep(name: str, n: int, k: int) -> dict:
    from int4_row_stream import _weights

    from kiln.bench.gemv_bench import rotation_copies, time_per_call_ms
    from kiln.kernels import wq_gemm as wq

    ws = _weights(n, k, rotation_copies(n * k // 2))
    idx = {id(t[0]): t for t in ws}
    nbytes = n * k // 2 + n * (k // G) * 5
    row = {"shape": name, "n": n, "k": k, "bytes": nbytes}
    for m in (1, 8):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cfg = wq.wq_config(n, k, m, G)
        ms = time_per_call_ms(lambda p, c=cfg, x=x: wq.wq_linear_triton(x, *idx[id(p)], config=c),
                              [t[0] for t in ws], reps=10)  # fmt: skip
        row[f"engine_m{m}"] = {"us": ms * 1e3, "tb_s": nbytes / ms / 1e9, "config": cfg}
        print(name, "engine m", m, round(ms * 1e3, 2), flush=True)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    res = []
    cfgs = [{"r": r, "nw": nw, "split": sp, "ch": ch, "pf": pf} for r in (1, 2, 4)
            for nw in (1, 2, 4, 8) for sp in (1, 2, 4) for ch in (1, 2) for pf in (False, True)
            if 256 <= n // (16 * r) * sp * nw <= 16384 and k // 128 >= nw * ch * sp]  # fmt: skip
    for c in cfgs:
        try:
            ms = time_per_call_ms(lambda p, c=c: _run(x, idx[id(p)], c), [t[0] for t in ws],
                                  reps=10)  # fmt: skip
        except Exception as e:
            print(name, c, "ERR", type(e).__name__, str(e)[:200], flush=True)
            continue
        res.append({"us": ms * 1e3, "tb_s": nbytes / ms / 1e9, **c})
    res.sort(key=lambda d: d["us"])
    row["best"] = res[:6]
    b = res[0]
    x16 = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
    ms = time_per_call_ms(lambda p: _run(x16, idx[id(p)], b), [t[0] for t in ws], reps=10)
    row["mma_m8"] = {"us": ms * 1e3, "cfg": b}
    print(name, "mma", round(b["us"], 2), f"{b['tb_s']:.2f} TB/s", b, "m8", round(ms * 1e3, 2),
          flush=True)  # fmt: skip
    return row


def main() -> None:
    from int4_row_stream import _graph_ms, _weights

    from kiln.bench.gemv_bench import LLAMA_8B_SHAPES
    from kiln.kernels import wq_gemm as wq

    torch.manual_seed(0)
    res = {"check": [], "shapes": [], "chain": {}}
    out = sys.argv[1]
    if not _check(res):
        Path(out).write_text(json.dumps(res, indent=1))
        sys.exit(1)
    shapes = {k: v for k, v in LLAMA_8B_SHAPES.items() if k != "lm_head"}
    if "--with-head" in sys.argv:
        shapes["lm_head"] = LLAMA_8B_SHAPES["lm_head"]
    best = {}
    for name, (n, k) in shapes.items():
        row = _sweep(name, n, k)
        res["shapes"].append(row)
        best[name] = row["best"][0]
        Path(out).write_text(json.dumps(res, indent=1))
        torch.cuda.empty_cache()
    shapes.pop("lm_head", None)
    layers = [{nm: _weights(n, k, 1)[0] for nm, (n, k) in shapes.items()} for _ in range(32)]
    for m in (1, 8):
        xs = {nm: torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
              for nm, (n, k) in shapes.items()}  # fmt: skip

        def chain(mma: bool, xs=xs, m=m) -> None:
            for lw in layers:
                for nm, (n, k) in shapes.items():
                    if mma:
                        _run(xs[nm], lw[nm], best[nm])
                    else:
                        wq.wq_linear_triton(xs[nm], *lw[nm], config=wq.wq_config(n, k, m, G))

        for label, mma in (("engine", False), ("mma", True)):
            ms = _graph_ms(lambda f=mma: chain(f))
            res["chain"][f"{label}_m{m}"] = {"ms_32_layers": ms, "us_per_layer": ms * 1e3 / 32}
            print("chain m", m, label, round(ms, 4), "ms", flush=True)
    res["chain"]["configs"] = best
    Path(out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
