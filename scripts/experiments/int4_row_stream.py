"""Experiment (H200): the one-row int4 Gluon kernel (``kiln.kernels.wq_gluon``) made
persistent, with the next tile's weights loaded before the current tile's arithmetic.

The engine's kernel runs one tile per program step: a program loads its words, waits, does
the arithmetic, then loads again, and since all programs of a projection start together
they stay in step, so the memory system idles while they compute (the arithmetic of
gate_up alone is ~9 us of issue against its ~14 us of bytes; the kernel takes 27 us, its
loads alone 21). Here a grid of at most ``PROGRAMS`` programs walks the (column tile,
K tile) steps of its tiles in order, the words of step s + 1 in flight while step s is
computed (register double buffer); the arithmetic is the engine kernel's, so outputs
match it bit for bit. ``MODE`` 1 replaces the arithmetic by an integer sum (the loads'
ceiling of the same structure).

Also timed: a CUDA graph of the four projections of 32 layers in a row (the decode step's
projections), engine kernel against the best streaming configuration per shape.

Usage: ``PYTHONPATH=. python scripts/experiments/int4_row_stream.py OUT.json`` (GPU);
``... --compile`` compiles for sm_90 without a GPU and prints registers and instruction
counts."""

import json
import re
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kiln.kernels.wq_fma import _NIB_HI as _HI
from kiln.kernels.wq_fma import _NIB_LO as _LO
from kiln.kernels.wq_gluon import _nib

G = 128


@gluon.jit
def _tile_words(w_ptr, t, kt, rn, wc3, N, stride_wn, BLOCK_N: gl.constexpr,
                BLOCK_K: gl.constexpr):  # fmt: skip
    rows = gl.minimum(t * BLOCK_N + rn, N - 1)
    r3 = gl.expand_dims(gl.expand_dims(rows, 1), 2).to(gl.int64)
    return gl.load(w_ptr + r3 * stride_wn + kt * (BLOCK_K // 8) + wc3,
                   eviction_policy="evict_first")  # fmt: skip


@gluon.jit
def _stream_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, N, n_kt, stride_wn, stride_sn,
                   magic, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP: gl.constexpr,
                   NW: gl.constexpr, MODE: gl.constexpr, PREFETCH: gl.constexpr):  # fmt: skip
    """x: (K/2,) int32 bfloat16 pairs; w: (N, K/8) int32 words; s float32, z uint8;
    n_kt = K / BLOCK_K. Program p takes column tiles p, p + P, ... (P programs)."""
    P: gl.constexpr = gl.BlockedLayout([BLOCK_N, 1, 4], [1, 32, 1], [1, NW, 1], [2, 1, 0])
    S2: gl.constexpr = gl.SliceLayout(2, P)
    S0: gl.constexpr = gl.SliceLayout(0, P)
    C: gl.constexpr = BLOCK_K // 32
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_tiles = gl.cdiv(N, BLOCK_N)
    steps = (n_tiles - pid + nprog - 1) // nprog * n_kt
    rn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, S2))
    c0 = gl.arange(0, C, layout=gl.SliceLayout(1, S0))
    wc = gl.expand_dims(c0, 1) * 4 + gl.expand_dims(gl.arange(0, 4, gl.SliceLayout(0, S0)), 0)
    wc3 = gl.expand_dims(wc, 0)
    cg = gl.arange(0, C, layout=gl.SliceLayout(0, S2))
    acc = gl.zeros([BLOCK_N, C], gl.float32, S2)
    wd = _tile_words(w_ptr, pid, 0, rn, wc3, N, stride_wn, BLOCK_N, BLOCK_K)
    for s in range(steps):
        t = pid + (s // n_kt) * nprog
        kt = s % n_kt
        if PREFETCH:
            s1 = gl.minimum(s + 1, steps - 1)
            wn = _tile_words(w_ptr, pid + (s1 // n_kt) * nprog, s1 % n_kt, rn, wc3, N,
                             stride_wn, BLOCK_N, BLOCK_K)  # fmt: skip
        else:
            wd = _tile_words(w_ptr, t, kt, rn, wc3, N, stride_wn, BLOCK_N, BLOCK_K)
        r2 = gl.expand_dims(gl.minimum(t * BLOCK_N + rn, N - 1), 1)
        k0 = kt * BLOCK_K
        if MODE == 1:
            acc += gl.sum(wd, axis=2).to(gl.float32)
        else:
            xp = x_ptr + gl.multiple_of(k0 // 2, 16) + 4 * wc
            u0, u1, u2, u3 = gl.load(xp), gl.load(xp + 1), gl.load(xp + 2), gl.load(xp + 3)
            x0 = gl.expand_dims((u0 << 16).to(gl.float32, bitcast=True), 0)
            x1 = gl.expand_dims((u0 & -65536).to(gl.float32, bitcast=True), 0)
            x2 = gl.expand_dims((u1 << 16).to(gl.float32, bitcast=True), 0)
            x3 = gl.expand_dims((u1 & -65536).to(gl.float32, bitcast=True), 0)
            x4 = gl.expand_dims((u2 << 16).to(gl.float32, bitcast=True), 0)
            x5 = gl.expand_dims((u2 & -65536).to(gl.float32, bitcast=True), 0)
            x6 = gl.expand_dims((u3 << 16).to(gl.float32, bitcast=True), 0)
            x7 = gl.expand_dims((u3 & -65536).to(gl.float32, bitcast=True), 0)
            xe = (x0 + x2) + (x4 + x6)
            xo = (x1 + x3) + (x5 + x7)
            xs = gl.sum(xe + xo, axis=2)
            bias = gl.sum(xe * 128.0 + xo * 8.0, axis=2)
            sidx = r2 * stride_sn + gl.expand_dims((k0 + cg * 32) // GROUP, 0)
            sc = gl.load(s_ptr + sidx)
            zp = gl.load(z_ptr + sidx).to(gl.float32)
            b0, b1, b2, b3 = wd << 15, wd << 7, wd >> 1, wd >> 9
            v = _nib(b0, _LO, magic) * x0
            v += _nib(b0, _HI, magic) * (x1 * 0.0625)
            v += _nib(b1, _LO, magic) * x2
            v += _nib(b1, _HI, magic) * (x3 * 0.0625)
            v += _nib(b2, _LO, magic) * x4
            v += _nib(b2, _HI, magic) * (x5 * 0.0625)
            v += _nib(b3, _LO, magic) * x6
            v += _nib(b3, _HI, magic) * (x7 * 0.0625)
            acc += sc * ((gl.sum(v, axis=2) - bias) * 2.0 - zp * xs)
        if kt == n_kt - 1:
            offs = t * BLOCK_N + rn
            y = gl.sum(acc, axis=1)
            gl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=offs < N)
            acc = gl.zeros([BLOCK_N, C], gl.float32, S2)
        if PREFETCH:
            wd = wn


def run_stream(x, w, s, z, cfg, out=None):
    k = x.shape[1]
    n = w.shape[0]
    bn, bk, nw = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]
    out = torch.empty(1, n, dtype=x.dtype, device=x.device) if out is None else out
    grid = min(triton.cdiv(n, bn), cfg["PROGRAMS"])
    _stream_kernel[(grid,)](
        x.view(torch.int32), w.view(torch.int32), s, z, out, n, k // bk, w.shape[1] // 4,
        s.stride(0), 0x43000000, BLOCK_N=bn, BLOCK_K=bk, GROUP=G, NW=nw,
        MODE=cfg.get("MODE", 0), PREFETCH=cfg.get("PREFETCH", True), num_warps=nw,
    )  # fmt: skip
    return out


def _cfgs(k):
    out = []
    for bn in (4, 8):
        for nw in (1, 2, 4):
            for bk in (1024 * nw, 2048 * nw):
                if k % bk:
                    continue
                for per_sm in (4, 8, 16, 32):
                    if per_sm * nw > 64:
                        continue
                    for pf in (True, False):
                        out.append({"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw,
                                    "PROGRAMS": per_sm * 132, "PREFETCH": pf})  # fmt: skip
    return out


def compile_only() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.tools.disasm import get_sass

    sig = {"x_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*u8",
           "out_ptr": "*bf16", "N": "i32", "n_kt": "i32", "stride_wn": "i32",
           "stride_sn": "i32", "magic": "i32"}  # fmt: skip
    for bn, bk, nw, mode, pf in ((8, 1024, 1, 0, True), (8, 2048, 2, 0, True),
                                 (4, 2048, 1, 0, True), (8, 1024, 1, 0, False),
                                 (8, 1024, 1, 1, True)):  # fmt: skip
        const = {"BLOCK_N": bn, "BLOCK_K": bk, "GROUP": G, "NW": nw, "MODE": mode,
                 "PREFETCH": pf}  # fmt: skip
        div = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 7, 8)}
        src = GluonASTSource(fn=_stream_kernel, signature=sig | {c: "constexpr" for c in const},
                             constexprs=const, attrs=div)  # fmt: skip
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw})
        sass = get_sass(ck.asm["cubin"])
        n_ins = len(re.findall(r"^\S+\t[A-Z]", sass, re.M))
        stl = len(re.findall(r"\bSTL", sass))
        ldg = len(re.findall(r"\bLDG", sass))
        print(const, "sass instructions", n_ins, "local stores", stl, "global loads", ldg)


def _weights(n, k, copies):
    from kiln.quant import formats as qf

    out = []
    for _ in range(copies):
        u, s, z = qf.quantize_int4(torch.randn(n, k, device="cuda") / k**0.5, G)
        out.append((qf.pack_int4(u), s.float().contiguous(), z))
    return out


def _graph_ms(fn, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _sweep(name, n, k):
    from kiln.bench.gemv_bench import rotation_copies, time_per_call_ms
    from kiln.kernels import wq_gemm as wq

    ws = _weights(n, k, rotation_copies(n * k // 2))
    idx = {id(t[0]): t for t in ws}
    nbytes = n * k // 2 + n * (k // G) * 5
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    eng_cfg = wq.wq_config(n, k, 1, G)
    eng_y = wq.wq_linear_triton(x, *ws[0], config=eng_cfg)
    eng_ms = time_per_call_ms(lambda p: wq.wq_linear_triton(x, *idx[id(p)], config=eng_cfg),
                              [t[0] for t in ws], reps=10)  # fmt: skip
    row = {"shape": name, "n": n, "k": k, "bytes": nbytes,
           "engine": {"us": eng_ms * 1e3, "config": eng_cfg}}  # fmt: skip
    print(name, "engine", round(eng_ms * 1e3, 2), flush=True)
    allr = []
    loads = [c | {"MODE": 1} for c in _cfgs(k) if c["PREFETCH"] and c["BLOCK_N"] == 8]
    for cfg in _cfgs(k) + loads:
        try:
            y = run_stream(x, *ws[0], cfg)
            same = bool(torch.equal(y, eng_y))
            if cfg.get("MODE", 0) == 0 and not same:
                err = ((y.float() - eng_y.float()).abs().max()).item()
                print(name, cfg, "DIFFERS", err, flush=True)
            ms = time_per_call_ms(lambda p, c=cfg: run_stream(x, *idx[id(p)], c),
                                  [t[0] for t in ws], reps=10)  # fmt: skip
        except Exception as e:
            print(name, cfg, "ERR", type(e).__name__, str(e)[:300], flush=True)
            continue
        allr.append({"us": ms * 1e3, "tb_s": nbytes / ms / 1e9, "same": same, "config": cfg})
    for mode, pf in ((0, True), (0, False), (1, True)):
        sel = [r for r in allr if r["config"].get("MODE", 0) == mode
               and r["config"]["PREFETCH"] == pf]  # fmt: skip
        top = sorted(sel, key=lambda r: r["us"])[:4]
        row[f"mode{mode}_prefetch{int(pf)}"] = top
        if top:
            print(name, f"mode {mode} prefetch {pf}", round(top[0]["us"], 2),
                  f"{top[0]['tb_s']:.2f} TB/s", top[0]["config"], flush=True)  # fmt: skip
    return row


def main() -> None:
    from kiln.bench.gemv_bench import LLAMA_8B_SHAPES
    from kiln.kernels import wq_gemm as wq

    torch.manual_seed(0)
    res = {"shapes": [], "chain": {}}
    best_by = {}
    shapes = {k: v for k, v in LLAMA_8B_SHAPES.items() if k != "lm_head"}
    for name, (n, k) in shapes.items():
        row = _sweep(name, n, k)
        best_by[name] = row["mode0_prefetch1"][0]["config"] if row["mode0_prefetch1"] else None
        res["shapes"].append(row)
        with open(sys.argv[1], "w") as f:
            json.dump(res, f, indent=1)
        torch.cuda.empty_cache()
    # the projections of 32 layers in a row, one CUDA graph
    layers = [{nm: _weights(n, k, 1)[0] for nm, (n, k) in shapes.items()} for _ in range(32)]
    xs = {nm: torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
          for nm, (n, k) in shapes.items()}  # fmt: skip
    outs = {nm: torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
            for nm, (n, k) in shapes.items()}  # fmt: skip

    def chain(stream: bool):
        for lw in layers:
            for nm, (n, k) in shapes.items():
                if stream and best_by[nm]:
                    run_stream(xs[nm], *lw[nm], best_by[nm], out=outs[nm])
                else:
                    wq.wq_linear_triton(xs[nm], *lw[nm], config=wq.wq_config(n, k, 1, G))

    for label, st in (("engine", False), ("stream", True)):
        ms = _graph_ms(lambda st=st: chain(st))
        res["chain"][label] = {"ms_32_layers": ms, "us_per_layer": ms * 1e3 / 32}
        print("chain", label, round(ms, 4), "ms", flush=True)
    res["chain"]["configs"] = best_by
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    compile_only() if "--compile" in sys.argv else main()
