"""Experiment (H200): the one-row int4 Gluon kernel's arithmetic fed by TMA.

Nsight Compute on the H200 (``results/2026-12-05-h200-int4-ncu-2344972.json``) put every
one-row int4 projection at 12-25 % theoretical occupancy, limited by registers (128-255 a
thread), with under one eligible warp a scheduler and the largest stall on L1TEX
(global-load) scoreboards: each warp loads its words into registers, waits, computes. The
``cp.async`` ring tried on 2026-12-01 (``int4_row_pipe.py``) still issued a copy per 16
bytes per thread. Here one thread per program asks the TMA for a (BLOCK_N, 4 C) tile of
words and the (C / 16, 256) tile of x's pairs into a ring of ``STAGES`` shared-memory slots
(one mbarrier each), ``STAGES`` tiles ahead; the threads read a ready slot into registers
in the engine kernel's layout (``wq_gluon._wq4_rows_kernel``: every thread holds all
BLOCK_N rows of its chunk of 32 codes) and do its arithmetic. Scales and zeros stay global
loads, one tile ahead. The output should equal the engine kernel's with the same tiles bit
for bit.

Usage: ``PYTHONPATH=. python scripts/experiments/int4_row_tma.py OUT.json`` (GPU);
``... --compile`` compiles the candidates for sm_90 without a GPU (registers, spills)."""

import json
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from kiln.kernels.wq_gluon import _tile_sum

sys.path.insert(0, str(Path(__file__).parent))
from int4_row_stream import _graph_ms, _weights  # the experiments' helpers

G = 128
# the H200 build's one-row picks at 6aa05cc (results/2026-12-05-h200-tuning-int4h-6aa05cc.json)
ENGINE = {
    "qkv": {"BLOCK_N": 8, "BLOCK_K": 2048, "SPLIT_K": 1, "FMA": True, "WORDS": True,
            "GLUON": True, "num_warps": 2, "num_stages": 2},
    "o": {"BLOCK_N": 8, "BLOCK_K": 4096, "SPLIT_K": 1, "FMA": True, "WORDS": True,
          "GLUON": True, "num_warps": 2, "num_stages": 2},
    "gate_up": {"MMA": True, "R": 2, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1, "CH": 2,
                "PF": True, "num_warps": 2},
    "down": {"MMA": True, "R": 1, "BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 2, "CH": 1,
             "PF": False, "num_warps": 8},
}  # fmt: skip
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@gluon.jit
def _math(wd, sc, zp, xw, magic, C: gl.constexpr, S0: gl.constexpr):
    """``wq_gluon._step``'s arithmetic on words ``wd`` (BLOCK_N, C, 4), scales and zeros
    (BLOCK_N, C) and x's pairs ``xw`` (C, 4, 4) as read from shared memory."""
    a, b = gl.split(gl.reshape(xw, [C, 4, 2, 2]))
    v0, v2 = gl.split(a)
    v1, v3 = gl.split(b)
    u0 = gl.convert_layout(v0, S0)
    u1 = gl.convert_layout(v1, S0)
    u2 = gl.convert_layout(v2, S0)
    u3 = gl.convert_layout(v3, S0)
    return _tile_sum(wd, sc, zp, u0, u1, u2, u3, magic)


@gluon.jit
def _issue(w_desc, x_desc, bar, w_slot, x_slot, n0, c0, ok, NB: gl.constexpr):
    mbarrier.expect(bar, NB, pred=ok)
    tma.async_copy_global_to_shared(w_desc, [n0, c0 * 4], bar, w_slot, pred=ok)
    tma.async_copy_global_to_shared(x_desc, [c0 // 16, 0], bar, x_slot, pred=ok)


@gluon.jit
def _tma_rows_kernel(w_desc, x_desc, s_ptr, z_ptr, out_ptr, part_ptr, N, stride_sn, KT,
                     magic, BLOCK_N: gl.constexpr, C: gl.constexpr, STAGES: gl.constexpr,
                     NW: gl.constexpr, SPLIT_K: gl.constexpr, GROUP: gl.constexpr):  # fmt: skip
    """Grid (N / BLOCK_N, SPLIT_K); a program takes ``KT`` tiles of 32 C codes. w_desc:
    the words as (N, K / 8) int32, box (BLOCK_N, 4 C); x_desc: x's pairs as (K / 512,
    256) int32, box (C / 16, 256): boxes of 16-byte rows (a first version) ran at a
    quarter of the speed. Splits write float32 partials (SPLIT_K, 1, N)."""
    P: gl.constexpr = gl.BlockedLayout([BLOCK_N, 1, 4], [1, 32, 1], [1, NW, 1], [2, 1, 0])
    S2: gl.constexpr = gl.SliceLayout(2, P)
    S0: gl.constexpr = gl.SliceLayout(0, P)
    PX: gl.constexpr = gl.BlockedLayout([1, 4, 4], [32, 1, 1], [NW, 1, 1], [2, 1, 0])
    NB: gl.constexpr = (BLOCK_N * C * 4 + C * 16) * 4
    BK: gl.constexpr = C * 32
    n0 = gl.program_id(0) * BLOCK_N
    c_lo = gl.program_id(1) * KT * C
    W2: gl.constexpr = gl.BlockedLayout([BLOCK_N, 4], [1, 32], [1, NW], [1, 0])
    X2: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [NW, 1], [1, 0])
    w_s = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, C * 4], w_desc.layout)
    x_s = gl.allocate_shared_memory(gl.int32, [STAGES, C // 16, 256], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        _issue(w_desc, x_desc, bars.index(i), w_s.index(i), x_s.index(i), n0, c_lo + i * C,
               i < KT, NB)  # fmt: skip
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, S2))
    rs = gl.expand_dims(gl.minimum(offs_n, N - 1), 1) * stride_sn
    cg = gl.expand_dims(gl.arange(0, C, layout=gl.SliceLayout(0, S2)) * 32, 0)
    k_lo = c_lo * 32
    sc = gl.load(s_ptr + rs + (cg + k_lo) // GROUP)
    zp = gl.load(z_ptr + rs + (cg + k_lo) // GROUP)
    acc = gl.zeros([BLOCK_N, C], gl.float32, S2)
    for t in range(KT):
        st = t % STAGES
        kn = k_lo + gl.minimum(t + 1, KT - 1) * BK
        sc_n = gl.load(s_ptr + rs + (cg + kn) // GROUP)
        zp_n = gl.load(z_ptr + rs + (cg + kn) // GROUP)
        mbarrier.wait(bars.index(st), (t // STAGES) & 1)
        wd = gl.convert_layout(gl.reshape(w_s.index(st).load(W2), [BLOCK_N, C, 4]), P)
        xw = gl.convert_layout(gl.reshape(x_s.index(st).load(X2), [C, 4, 4]), PX)
        fence_async_shared()
        gl.thread_barrier()  # every thread has read slot st: refill it STAGES tiles ahead
        _issue(w_desc, x_desc, bars.index(st), w_s.index(st), x_s.index(st), n0,
               c_lo + (t + STAGES) * C, t + STAGES < KT, NB)  # fmt: skip
        acc += _math(wd, sc, zp, xw, magic, C, S0)
        sc = sc_n
        zp = zp_n
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    y = gl.sum(acc, axis=1)
    n_ok = offs_n < N
    if SPLIT_K == 1:
        gl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        gl.store(part_ptr + gl.program_id(1) * N + offs_n, y, mask=n_ok)


def _layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def descriptors(x, w, cfg):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    n, k = w.shape[0], x.shape[1]
    c, bn = cfg["C"], cfg["BLOCK_N"]
    w2 = w.view(torch.int32)
    x2 = x.view(torch.int32).view(k // 512, 256)
    return (TensorDescriptor(w2, [n, k // 8], [k // 8, 1], [bn, 4 * c], _layout()),
            TensorDescriptor(x2, [k // 512, 256], [256, 1], [c // 16, 256], _layout()))  # fmt: skip


def run_tma(x, w, s, z, cfg, out=None, part=None, descs=None):
    """One row: (1, N) bfloat16, or with SPLIT_K > 1 the float32 partials (SPLIT_K, 1, N)."""
    n, k = w.shape[0], x.shape[1]
    split = cfg["SPLIT_K"]
    tiles = k // (32 * cfg["C"])
    assert tiles % split == 0, (k, cfg)
    wd, xd = descs or descriptors(x, w, cfg)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device) if out is None else out
    if split > 1 and part is None:
        part = torch.empty(split, 1, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), split)
    _tma_rows_kernel[grid](wd, xd, s, z, out, part if split > 1 else out, n, s.stride(0),
                           tiles // split, 0x43000000, BLOCK_N=cfg["BLOCK_N"], C=cfg["C"],
                           STAGES=cfg["STAGES"], NW=cfg["num_warps"], SPLIT_K=split, GROUP=G,
                           num_warps=cfg["num_warps"])  # fmt: skip
    return part if split > 1 else out


def _cfgs(k):
    """8 or 4 rows a program (16 spill); 32 C codes a tile over 32 NW threads; splits of
    whole tiles; a ring of up to 4 tiles (2 as well where a program has 8 or more)."""
    out = []
    for bn in (8, 4):
        for nw, c in ((1, 32), (2, 64), (1, 64)):
            tiles = k // (32 * c)
            for split in (1, 2, 4):
                if tiles * 32 * c != k or tiles % split:
                    continue
                kt = tiles // split
                for stages in sorted({min(4, kt)} | ({2} if kt >= 8 else set())):
                    out.append({"BLOCK_N": bn, "C": c, "num_warps": nw, "STAGES": stages,
                                "SPLIT_K": split})  # fmt: skip
    return out


def compile_only() -> None:
    sys.path.insert(0, ".")
    from tests.sm90 import compile_sm90

    for cfg in [{"BLOCK_N": 8, "C": 64, "num_warps": 2, "STAGES": 4, "SPLIT_K": 1},
                {"BLOCK_N": 8, "C": 32, "num_warps": 1, "STAGES": 3, "SPLIT_K": 2}]:  # fmt: skip
        bn, c = cfg["BLOCK_N"], cfg["C"]
        lay = repr(_layout())
        sig = {"w_desc": f"tensordesc<i32[{bn}, {4 * c}],{lay}>",
               "x_desc": f"tensordesc<i32[{c // 16}, 256],{lay}>", "s_ptr": "*fp32",
               "z_ptr": "*u8", "out_ptr": "*bf16", "part_ptr": "*fp32", "N": "i32",
               "stride_sn": "i32", "KT": "i32", "magic": "i32"}  # fmt: skip
        const = {"BLOCK_N": bn, "C": c, "STAGES": cfg["STAGES"], "NW": cfg["num_warps"],
                 "SPLIT_K": cfg["SPLIT_K"], "GROUP": G}  # fmt: skip
        r = compile_sm90(_tma_rows_kernel, sig, const, cfg["num_warps"], gluon=True)
        ptx = r["ptx"]
        print(cfg, "regs", r["regs"], "stack", r["stack"],
              "tma", ptx.count("cp.async.bulk.tensor"), "ld.shared", ptx.count("ld.shared"),
              "st.shared", ptx.count("st.shared"), "bar.sync", ptx.count("bar.sync"))  # fmt: skip


def _engine(x, ws, cfg):
    from kiln.kernels import wq_gemm as wq

    return wq.wq_linear_triton(x, *ws, config=cfg, partials=cfg.get("SPLIT_K", 1) > 1)


def _sweep(name, n, k, budget_cfgs=None):
    from kiln.bench.gemv_bench import rotation_copies, time_per_call_ms
    from kiln.kernels import wq_gemm as wq

    ws = _weights(n, k, rotation_copies(n * k // 2))
    idx = {id(t[0]): t for t in ws}
    nbytes = n * k // 2 + n * (k // G) * 5
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ref = wq.wq_linear_ref(x, *ws[0]).float()
    eng = ENGINE[name]
    eng_ms = time_per_call_ms(lambda p: _engine(x, idx[id(p)], eng), [t[0] for t in ws], reps=10)
    row = {"shape": name, "n": n, "k": k, "bytes": nbytes,
           "engine": {"us": eng_ms * 1e3, "config": eng}}  # fmt: skip
    print(name, "engine", round(eng_ms * 1e3, 2), flush=True)
    # the engine's Gluon kernel with the same tiles, for a bit-for-bit check
    allr = []
    for cfg in budget_cfgs or _cfgs(k):
        try:
            descs = {id(t[0]): descriptors(x, t[0], cfg) for t in ws}
            y = run_tma(x, *ws[0], cfg, descs=descs[id(ws[0][0])])
            yf = y.float().sum(0) if cfg["SPLIT_K"] > 1 else y.float()
            err = ((yf - ref).abs().max() / ref.abs().max()).item()
            same = None
            if cfg["SPLIT_K"] == 1:
                g = wq.wq_linear_triton(x, *ws[0], config={
                    "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": 32 * cfg["C"], "SPLIT_K": 1,
                    "FMA": True, "WORDS": True, "GLUON": True, "num_warps": cfg["num_warps"],
                    "num_stages": 2})  # fmt: skip
                same = bool(torch.equal(g, y))
            if not err < 2e-2:
                print(name, cfg, "WRONG", err, flush=True)
                continue
            part = torch.empty(cfg["SPLIT_K"], 1, n, dtype=torch.float32, device="cuda")
            out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
            ms = time_per_call_ms(
                lambda p, c=cfg, o=out, q=part, d=descs: run_tma(
                    x, *idx[id(p)], c, out=o, part=q, descs=d[id(p)]
                ),
                [t[0] for t in ws],
                reps=10,
            )
        except Exception as e:  # a candidate that fails is reported, not fatal
            print(name, cfg, "ERR", type(e).__name__, str(e)[:300], flush=True)
            continue
        allr.append({"us": ms * 1e3, "tb_s": nbytes / ms / 1e9, "same_as_gluon": same,
                     "rel_err": err, "config": cfg})  # fmt: skip
    allr.sort(key=lambda r: r["us"])
    row["tma_top"] = allr[:8]
    row["tma_count"] = len(allr)
    if allr:
        print(name, "tma best", round(allr[0]["us"], 2), f"{allr[0]['tb_s']:.2f} TB/s",
              allr[0]["config"], "same", allr[0]["same_as_gluon"], flush=True)  # fmt: skip
    return row, ws, x


def main() -> None:
    torch.manual_seed(0)
    res = {"note": __doc__.split("\n\n")[0], "shapes": [], "chain": {}}
    best = {}
    for name, (n, k) in SHAPES.items():
        row, ws, _ = _sweep(name, n, k)
        res["shapes"].append(row)
        best[name] = row["tma_top"][0]["config"] if row["tma_top"] else None
        with open(sys.argv[1], "w") as f:
            json.dump(res, f, indent=1)
        del ws
        torch.cuda.empty_cache()
    # the four projections of 32 layers in a row, one CUDA graph: engine picks vs the best
    layers = [{nm: _weights(n, k, 1)[0] for nm, (n, k) in SHAPES.items()} for _ in range(32)]
    xs = {nm: torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
          for nm, (n, k) in SHAPES.items()}  # fmt: skip
    outs = {nm: torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
            for nm, (n, k) in SHAPES.items()}  # fmt: skip
    parts = {nm: torch.empty(4, 1, n, device="cuda") for nm, (n, k) in SHAPES.items()}
    descs = [{nm: descriptors(xs[nm], lw[nm][0], best[nm]) for nm in SHAPES if best[nm]}
             for lw in layers]  # fmt: skip

    def chain(mode):
        for i, lw in enumerate(layers):
            for nm in SHAPES:
                if mode == "tma" and best[nm]:
                    c = best[nm]
                    run_tma(xs[nm], *lw[nm], c, out=outs[nm], part=parts[nm][: c["SPLIT_K"]],
                            descs=descs[i][nm])  # fmt: skip
                else:
                    _engine(xs[nm], lw[nm], ENGINE[nm])

    for label in ("engine", "tma", "engine"):
        ms = _graph_ms(lambda m=label: chain(m))
        res["chain"].setdefault(label, []).append(
            {"ms_32_layers": ms, "us_per_layer": ms * 1e3 / 32}
        )
        print("chain", label, round(ms, 4), "ms", flush=True)
    res["chain"]["configs"] = best
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    compile_only() if "--compile" in sys.argv else main()
