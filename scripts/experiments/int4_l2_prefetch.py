"""Experiment (H200): the one-row int4 kernels with their words prefetched into L2.

Nsight Compute's stall sampling of the H200 picks (``results/2026-12-05-h200-int4-ncu-
2344972.json``) puts 32-45 % of every projection's warp stalls on one instruction: the
first use of the words a thread just loaded (long scoreboard). The programs load
together and then compute together, so DRAM idles while they compute; register
prefetch, a ``cp.async`` ring and a TMA ring (``int4_row_tma.py``) were all slower. Here
each thread issues ``prefetch.global.L2`` for its own words ``L2PF`` iterations ahead
(no register, no shared memory, no wait): the kernels' ``L2PF`` option
(``wq_gluon._wq4_rows_kernel``, ``wq_mma._main``). The outputs must equal those without
it bit for bit.

Per projection at one row (weights cycled past L2), the H200 build's pick at 6aa05cc with
L2PF 0-8, then the four projections of 32 layers in one CUDA graph with the best L2PF per
shape against none.

Usage: ``PYTHONPATH=. python scripts/experiments/int4_l2_prefetch.py OUT.json`` (GPU);
``... --compile`` compiles both kernels with and without it for sm_90 (CPU)."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from int4_row_stream import _graph_ms, _weights  # the experiments' helpers

G = 128
# the H200 build's one-row picks at 6aa05cc (results/2026-12-05-h200-tuning-int4h-6aa05cc.json)
GLUON = {"FMA": True, "WORDS": True, "GLUON": True, "num_warps": 2, "num_stages": 2}
PICKS = {
    "qkv": GLUON | {"BLOCK_N": 8, "BLOCK_K": 2048, "SPLIT_K": 1},
    "o": GLUON | {"BLOCK_N": 8, "BLOCK_K": 4096, "SPLIT_K": 1},
    "gate_up": {"MMA": True, "R": 2, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1, "CH": 2,
                "PF": True, "num_warps": 2},
    "down": {"MMA": True, "R": 1, "BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 2, "CH": 1,
             "PF": False, "num_warps": 8},
}  # fmt: skip
# also: the H100's Gluon picks for gate_up and down (the Gluon kernel with smaller tiles)
EXTRA = {
    "gate_up": GLUON | {"BLOCK_N": 8, "BLOCK_K": 2048, "SPLIT_K": 1},
    "down": GLUON | {"BLOCK_N": 4, "BLOCK_K": 2048, "SPLIT_K": 1},
}
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
DISTANCES = (0, 1, 2, 3, 4, 8)


def compile_only() -> None:
    sys.path.insert(0, ".")
    from kiln.kernels import wq_gluon, wq_mma
    from tests.sm90 import compile_sm90

    sig = {"x_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*u8",
           "b_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32"}  # fmt: skip
    for a in [
        "M",
        "N",
        "K",
        "stride_xm",
        "stride_wn",
        "stride_sn",
        "stride_om",
        "k_per_split",
        "magic",
        "MB",
    ]:
        sig[a] = "i32"
    div = ("x_ptr", "w_ptr", "s_ptr", "z_ptr", "b_ptr", "out_ptr", "part_ptr", "N", "K",
           "stride_xm", "stride_wn", "stride_sn", "stride_om", "k_per_split")  # fmt: skip
    for l2 in (0, 2):
        c = {"R": 2, "SPLIT_K": 1, "GROUP": G, "NW": 2, "HAS_BIAS": False, "CH": 2, "PF": True,
             "PDL": True, "NT": 1, "L2PF": l2}  # fmt: skip
        k = compile_sm90(wq_mma._wq4_mma_kernel, sig, c, 2, gluon=True, divisible=div)
        print("mma L2PF", l2, "regs", k["regs"], "stack", k["stack"], "prefetch",
              k["ptx"].count("prefetch.global.L2"))  # fmt: skip
    rsig = {a: t for a, t in sig.items() if a not in ("K", "MB")}
    rdiv = tuple(a for a in div if a != "K")
    for l2 in (0, 1, 2):
        c = {"BLOCK_N": 8, "BLOCK_K": 2048, "SPLIT_K": 1, "GROUP": G, "NW": 2,
             "HAS_BIAS": False, "PDL": True, "L2PF": l2}  # fmt: skip
        k = compile_sm90(wq_gluon._wq4_rows_kernel, rsig, c, 2, gluon=True, divisible=rdiv)
        print("rows L2PF", l2, "regs", k["regs"], "stack", k["stack"], "prefetch",
              k["ptx"].count("prefetch.global.L2"))  # fmt: skip


def _call(x, ws, cfg):
    from kiln.kernels import wq_gemm as wq

    return wq.wq_linear_triton(x, *ws, config=cfg, partials=cfg.get("SPLIT_K", 1) > 1)


def _out(y):
    return y.partials if hasattr(y, "partials") else y


def _sweep(name, n, k):
    from kiln.bench.gemv_bench import rotation_copies, time_per_call_ms

    ws = _weights(n, k, rotation_copies(n * k // 2))
    idx = {id(t[0]): t for t in ws}
    nbytes = n * k // 2 + n * (k // G) * 5
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    rows = []
    for label, base in (("pick", PICKS[name]), ("gluon", EXTRA.get(name))):
        if base is None:
            continue
        y0 = _out(_call(x, ws[0], base)).clone()
        for d in DISTANCES:
            cfg = base | ({"L2PF": d} if d else {})
            same = bool(torch.equal(_out(_call(x, ws[0], cfg)), y0))
            ms = time_per_call_ms(lambda p, c=cfg: _call(x, idx[id(p)], c), [t[0] for t in ws],
                                  reps=10)  # fmt: skip
            rows.append({"kernel": label, "L2PF": d, "us": ms * 1e3, "tb_s": nbytes / ms / 1e9,
                         "same_as_without": same, "config": cfg})  # fmt: skip
            print(name, label, "L2PF", d, round(ms * 1e3, 2), "us", "same", same, flush=True)
    return {"shape": name, "n": n, "k": k, "bytes": nbytes, "rows": rows}


def main() -> None:
    torch.manual_seed(0)
    res = {"note": __doc__.split("\n\n")[0], "shapes": [], "chain": {}}
    best = {}
    for name, (n, k) in SHAPES.items():
        row = _sweep(name, n, k)
        res["shapes"].append(row)
        ok = [r for r in row["rows"] if r["same_as_without"]]
        best[name] = min(ok, key=lambda r: r["us"])["config"]
        with open(sys.argv[1], "w") as f:
            json.dump(res, f, indent=1)
        torch.cuda.empty_cache()
    layers = [{nm: _weights(n, k, 1)[0] for nm, (n, k) in SHAPES.items()} for _ in range(32)]
    xs = {nm: torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
          for nm, (n, k) in SHAPES.items()}  # fmt: skip

    def chain(cfgs):
        for lw in layers:
            for nm in SHAPES:
                _call(xs[nm], lw[nm], cfgs[nm])

    for label, cfgs in (("picks", PICKS), ("best", best), ("picks", PICKS), ("best", best)):
        ms = _graph_ms(lambda c=cfgs: chain(c))
        res["chain"].setdefault(label, []).append(ms)
        print("chain", label, round(ms, 4), "ms", flush=True)
    res["chain"]["best_configs"] = best
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    compile_only() if "--compile" in sys.argv else main()
