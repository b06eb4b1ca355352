"""Experiment (H200): the one-row int4 word kernel (``kiln.kernels.wq_fma._wq4_words_kernel``)
written in Gluon, Triton's explicit-layout dialect, to get the register layout that plain
Triton would not produce (``int4_row_words.py``'s ``w4r``): a (BLOCK_N, C, 4) tile of words
whose layout gives every thread all BLOCK_N rows of one chunk of four words (one 16-byte
load per row), threads and warps along the chunks. So a thread loads and unpacks its x
values once for BLOCK_N rows, a chunk's sum, bias and zero-point correction stay in the
thread, and the only cross-thread reduction is the final one per program.

Usage: ``PYTHONPATH=. python scripts/experiments/int4_row_gluon.py OUT.json`` (GPU);
``... --compile`` compiles for sm_90 without a GPU and prints registers and the SASS
opcode counts."""

import collections
import json
import re
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

G = 128
_LO: gl.constexpr = gl.constexpr(0x00078000)
_HI: gl.constexpr = gl.constexpr(0x00780000)


@gluon.jit
def _nib(b, MASK: gl.constexpr, magic):
    return ((b & MASK) | magic).to(gl.float32, bitcast=True)


@gluon.jit
def _g4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, N, stride_wn, stride_sn,
               k_per_split, magic, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
               SPLIT_K: gl.constexpr, GROUP: gl.constexpr, NW: gl.constexpr):  # fmt: skip
    """x: (K/2,) int32 bfloat16 pairs; w: (N, K/8) int32 words; s float32, z uint8."""
    P: gl.constexpr = gl.BlockedLayout([BLOCK_N, 1, 4], [1, 32, 1], [1, NW, 1], [2, 1, 0])
    S2: gl.constexpr = gl.SliceLayout(2, P)  # (BLOCK_N, C)
    S0: gl.constexpr = gl.SliceLayout(0, P)  # (C, 4)
    C: gl.constexpr = BLOCK_K // 32
    pid_k = gl.program_id(1)
    rows1 = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, S2))
    rows1c = gl.minimum(rows1, N - 1)
    r2 = gl.expand_dims(rows1c, 1)  # (BLOCK_N, 1) S2
    r3 = gl.expand_dims(r2, 2)  # (BLOCK_N, 1, 1) P
    c0 = gl.arange(0, C, layout=gl.SliceLayout(1, S0))
    i0 = gl.arange(0, 4, layout=gl.SliceLayout(0, S0))
    wc = gl.expand_dims(c0, 1) * 4 + gl.expand_dims(i0, 0)  # (C, 4) S0: words of the tile
    w3 = w_ptr + r3.to(gl.int64) * stride_wn + gl.expand_dims(wc, 0)
    cg = gl.arange(0, C, layout=gl.SliceLayout(0, S2))  # (C,) chunks, for the scales
    acc = gl.zeros([BLOCK_N, C], gl.float32, S2)
    k_lo = pid_k * k_per_split
    for k in range(0, k_per_split, BLOCK_K):
        k0 = k_lo + k
        wd = gl.load(w3 + gl.multiple_of(k0 // 8, 4), eviction_policy="evict_first")
        xp = x_ptr + gl.multiple_of(k0 // 2, 16) + 4 * wc
        u0 = gl.load(xp)
        u1 = gl.load(xp + 1)
        u2 = gl.load(xp + 2)
        u3 = gl.load(xp + 3)
        x0 = gl.expand_dims((u0 << 16).to(gl.float32, bitcast=True), 0)
        x1 = gl.expand_dims((u0 & -65536).to(gl.float32, bitcast=True), 0)
        x2 = gl.expand_dims((u1 << 16).to(gl.float32, bitcast=True), 0)
        x3 = gl.expand_dims((u1 & -65536).to(gl.float32, bitcast=True), 0)
        x4 = gl.expand_dims((u2 << 16).to(gl.float32, bitcast=True), 0)
        x5 = gl.expand_dims((u2 & -65536).to(gl.float32, bitcast=True), 0)
        x6 = gl.expand_dims((u3 << 16).to(gl.float32, bitcast=True), 0)
        x7 = gl.expand_dims((u3 & -65536).to(gl.float32, bitcast=True), 0)
        xe = (x0 + x2) + (x4 + x6)  # (1, C, 4)
        xo = (x1 + x3) + (x5 + x7)
        xs = gl.sum(xe + xo, axis=2)  # (1, C) S2
        bias = gl.sum(xe * 128.0 + xo * 8.0, axis=2)
        # the high nibbles' x times 1/16 (exact), so both halves share one FMA chain:
        # sum((128 + q/2) x_even + (128 + 8q) x_odd / 16) = sum(q x) / 2 + bias
        x1 = x1 * 0.0625
        x3 = x3 * 0.0625
        x5 = x5 * 0.0625
        x7 = x7 * 0.0625
        sidx = r2 * stride_sn + gl.expand_dims((k0 + cg * 32) // GROUP, 0)  # (BLOCK_N, C)
        sc = gl.load(s_ptr + sidx)
        zp = gl.load(z_ptr + sidx).to(gl.float32)
        b0 = wd << 15
        b1 = wd << 7
        b2 = wd >> 1
        b3 = wd >> 9
        v = _nib(b0, _LO, magic) * x0
        v += _nib(b0, _HI, magic) * x1
        v += _nib(b1, _LO, magic) * x2
        v += _nib(b1, _HI, magic) * x3
        v += _nib(b2, _LO, magic) * x4
        v += _nib(b2, _HI, magic) * x5
        v += _nib(b3, _LO, magic) * x6
        v += _nib(b3, _HI, magic) * x7
        t = gl.sum(v, axis=2)  # (BLOCK_N, C) S2, within the thread
        acc += sc * ((t - bias) * 2.0 - zp * xs)
    y = gl.sum(acc, axis=1)  # (BLOCK_N,)
    n_ok = rows1 < N
    if SPLIT_K == 1:
        gl.store(out_ptr + rows1, y.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        gl.store(part_ptr + pid_k * N + rows1, y, mask=n_ok)


def run_g4(x, w, s, z, cfg):
    from kiln.kernels.gemv import split_k_reduce

    k = x.shape[1]
    n = w.shape[0]
    bn, bk, split, nw = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"], cfg["num_warps"]
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, 1, n, dtype=torch.float32, device=x.device) if split > 1 else out
    _g4_kernel[(triton.cdiv(n, bn), split)](
        x.view(torch.int32), w.view(torch.int32), s, z, out, part, n, w.shape[1] // 4,
        s.stride(0), k // split, 0x43000000, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, GROUP=G,
        NW=nw, num_warps=nw,
    )  # fmt: skip
    if split > 1:
        split_k_reduce(part, out, None)
    return out


CFGS = [{"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sp, "num_warps": nw}
        for bn in (2, 4, 8) for nw in (1, 2, 4, 8) for bk in (1024 * nw, 2048 * nw, 4096 * nw)
        for sp in (1, 2, 4, 7, 8)]  # fmt: skip


def compile_only() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.tools.disasm import get_sass

    sig = {"x_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*u8",
           "out_ptr": "*bf16", "part_ptr": "*fp32", "N": "i32", "stride_wn": "i32",
           "stride_sn": "i32", "k_per_split": "i32", "magic": "i32"}  # fmt: skip
    for bn, bk, nw in ((8, 4096, 4), (8, 8192, 4), (4, 2048, 2)):
        const = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1, "GROUP": G, "NW": nw}
        div = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 7, 8, 9, 10)}
        src = GluonASTSource(fn=_g4_kernel, signature=sig | {c: "constexpr" for c in const},
                             constexprs=const, attrs=div)  # fmt: skip
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw})
        sass = get_sass(ck.asm["cubin"])
        ops = collections.Counter()
        for ln in sass.splitlines():
            hit = re.match(r"\S+\t(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln)
            if hit:
                ops[hit.group(1)] += 1
        regs = re.search(r"\.maxnreg|REG:(\d+)", sass)
        print(bn, bk, nw, "instrs", sum(ops.values()), ops.most_common(14), regs)


def main() -> None:
    from kiln.bench.gemv_bench import LLAMA_8B_SHAPES, rotation_copies, time_per_call_ms
    from kiln.kernels import wq_gemm as wq
    from kiln.quant import formats as qf

    torch.manual_seed(0)
    rows = []
    for name, (n, k) in LLAMA_8B_SHAPES.items():
        if name == "lm_head":
            continue
        ws = []
        for _ in range(rotation_copies(n * k // 2)):
            u, s, z = qf.quantize_int4(torch.randn(n, k, device="cuda") / k**0.5, G)
            ws.append((qf.pack_int4(u), s.float().contiguous(), z))
        idx = {id(t[0]): t for t in ws}
        nbytes = n * k // 2 + n * (k // G) * 5
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = wq.wq_linear_ref(x, *ws[0]).float()
        eng = wq.wq_config(n, k, 1, G)
        eng_ms = time_per_call_ms(lambda p: wq.wq_linear_triton(x, *idx[id(p)], config=eng),
                                  [t[0] for t in ws], reps=10)  # fmt: skip
        row = {"shape": name, "n": n, "k": k, "bytes": nbytes,
               "engine_default": {"ms": eng_ms, "config": eng}}  # fmt: skip
        print(name, "engine default", round(eng_ms * 1e3, 1), eng, flush=True)
        best, allr = None, []
        for cfg in CFGS:
            if k % (cfg["BLOCK_K"] * cfg["SPLIT_K"]):
                continue
            try:
                y = run_g4(x, *ws[0], cfg).float()
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                if not err < 1e-2:
                    print(name, cfg, "WRONG", err, flush=True)
                    continue
                ms = time_per_call_ms(lambda p, c=cfg: run_g4(x, *idx[id(p)], c),
                                      [t[0] for t in ws], reps=10)  # fmt: skip
            except Exception as e:
                print(name, cfg, "ERR", type(e).__name__, str(e)[:300], flush=True)
                continue
            allr.append({"ms": ms, "config": cfg})
            if best is None or ms < best["ms"]:
                best = {"ms": ms, "tb_s": nbytes / ms / 1e9, "config": cfg, "err": err}
        row["g4"] = {"best": best, "top": sorted(allr, key=lambda r: r["ms"])[:6]}
        if best:
            print(name, "g4", round(best["ms"] * 1e3, 1), f"{best['tb_s']:.2f} TB/s",
                  best["config"], flush=True)  # fmt: skip
        rows.append(row)
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    compile_only() if "--compile" in sys.argv else main()
