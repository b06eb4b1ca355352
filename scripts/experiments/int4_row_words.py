"""Experiment (H200): a one-row int4 kernel on 32-bit words with fewer instructions per code
than the engine's ``_wq4_fma_kernel``, at Llama-3.1-8B's projections (group 128).

The engine's packing is unchanged (bytes, even k in the low nibble), read as int32 words:
word j of a row holds codes 8j..8j+7, code 8j+i in bits 4i..4i+3. Each byte is shifted
once to bits 15..22 (one shift per two codes); a ``lop3`` then puts one nibble under the
exponent of 128.0 (0x43000000): the low nibble gives the float32 ``128 + q/2`` and the high
one ``128 + 8q``, exactly. x's even columns are pre-scaled by 2 and its odd ones by 1/8
(exact), so every code costs one FMA: sum((128 + q/2) * 2x) = sum(q x) + 256 sum(x_even)
and likewise for odd k, and the bias terms and the zero point come off once per group from
x's group sums (computed once per tile for all rows). About 2.5 instructions per code
(the engine's kernel: about 4, plus strided bf16 loads of x). x is read as int32 pairs of
bfloat16 (one load per two columns; bfloat16 -> float32 is a shift or a mask).

Variants: ``w4`` (the above), ``w4ld`` (the same loads, a byte-sum instead of the
arithmetic: the access pattern's ceiling); references: bf16 ``F.linear`` and ``cur`` (the
engine's best tuner candidate). Usage (GPU): ``PYTHONPATH=. python
scripts/experiments/int4_row_words.py OUT.json``; ``TRITON_INTERPRET=1 ... --check`` runs
small shapes on the CPU against ``wq_linear_ref``."""

import json
import sys

import torch
import triton
import triton.language as tl

from kiln.kernels import wq_gemm as wq
from kiln.kernels.gemv import split_k_reduce
from kiln.quant import formats as qf

G = 128
_LO = tl.constexpr(0x00078000)  # bits 15..18: the low nibble of a byte shifted to bits 15..22
_HI = tl.constexpr(0x00780000)  # bits 19..22: its high nibble


@triton.jit
def _f(b, MASK: tl.constexpr):
    return ((b & MASK) | 0x43000000).to(tl.float32, bitcast=True)


@triton.jit
def _bf(u):  # int32 holding two bfloat16: (low column, high column) as float32
    return (u << 16).to(tl.float32, bitcast=True), (u & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _w4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, N, K, stride_wn, stride_sn,
               k_per_split, K_PER_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, GROUP: tl.constexpr,
               GS: tl.constexpr, LOAD_ONLY: tl.constexpr):  # fmt: skip
    """x: (K/2,) int32 (bfloat16 pairs); w: (N, K/8) int32 words; s float32, z uint8
    (N, K/GROUP). A K tile is NG chunks of GS codes (GW = GS/8 words) sharing a scale."""
    pid_k = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)
    GW: tl.constexpr = GS // 8
    NG: tl.constexpr = BLOCK_K // GS
    j2 = tl.arange(0, NG)[:, None] * GW + tl.arange(0, GW)[None, :]  # (NG, GW) words
    w3 = w_ptr + rows.to(tl.int64)[:, None, None] * stride_wn + j2[None, :, :]
    acc = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    for k in range(0, K_PER_SPLIT if K_PER_SPLIT > 0 else k_per_split, BLOCK_K):
        k0 = k_lo + k
        wd = tl.load(w3 + k0 // 8, eviction_policy="evict_first")  # (BLOCK_N, NG, GW)
        xp = x_ptr + k0 // 2 + 4 * j2  # pairs (8j, 8j+1), (8j+2, 8j+3), ...
        x0, x1 = _bf(tl.load(xp))
        x2, x3 = _bf(tl.load(xp + 1))
        x4, x5 = _bf(tl.load(xp + 2))
        x6, x7 = _bf(tl.load(xp + 3))
        sidx = rows[:, None] * stride_sn + ((k0 + tl.arange(0, NG) * GS) // GROUP)[None, :]
        sc = tl.load(s_ptr + sidx)
        zp = tl.load(z_ptr + sidx).to(tl.float32)
        xs = tl.sum((x0 + x1) + (x2 + x3) + (x4 + x5) + (x6 + x7), axis=1)  # (NG,)
        if LOAD_ONLY:
            a = tl.sum(wd, axis=2).to(tl.float32)
            acc += a + sc + zp + xs[None, :]
        else:
            xe = (x0 + x2) + (x4 + x6)
            xo = (x1 + x3) + (x5 + x7)
            bias = tl.sum(xe * 256.0 + xo * 16.0, axis=1)  # (NG,)
            b0 = wd << 15
            b1 = wd << 7
            b2 = wd >> 1
            b3 = wd >> 9
            t = _f(b0, _LO) * (x0 * 2.0)[None, :, :]
            t += _f(b0, _HI) * (x1 * 0.125)[None, :, :]
            t += _f(b1, _LO) * (x2 * 2.0)[None, :, :]
            t += _f(b1, _HI) * (x3 * 0.125)[None, :, :]
            t += _f(b2, _LO) * (x4 * 2.0)[None, :, :]
            t += _f(b2, _HI) * (x5 * 0.125)[None, :, :]
            t += _f(b3, _LO) * (x6 * 2.0)[None, :, :]
            t += _f(b3, _HI) * (x7 * 0.125)[None, :, :]
            a = tl.sum(t, axis=2)  # (BLOCK_N, NG): sum(q x) + bias
            acc += sc * (a - bias[None, :] - zp * xs[None, :])
    y = tl.sum(acc, axis=1)[:, None]
    wq._store_result(y, offs_n, tl.arange(0, 1), out_ptr, out_ptr, part_ptr, pid_k, 1, N, N,
                     SPLIT_K, False)  # fmt: skip


@triton.jit
def _w4b_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, N, K, stride_wn, stride_sn,
                k_per_split, magic, K_PER_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, GROUP: tl.constexpr,
                GS: tl.constexpr, LOAD_ONLY: tl.constexpr):  # fmt: skip
    """``_w4_kernel`` with (1) the exponent bits 0x43000000 passed as an argument, so that
    mask-and-or is one ``lop3`` (with both as immediates ptxas emitted two); (2) x not
    pre-scaled: per word the low nibbles' products (128 + q/2) x are summed apart from the
    high nibbles' (128 + 8q) x and joined as 16 lo + hi = 8 q x + 2048 x_even + 128 x_odd;
    (3) the word offsets hinted as multiples of 4 (16-byte loads)."""
    pid_k = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)
    GW: tl.constexpr = GS // 8
    NG: tl.constexpr = BLOCK_K // GS
    j2 = tl.arange(0, NG)[:, None] * GW + tl.arange(0, GW)[None, :]  # (NG, GW) words
    w3 = w_ptr + rows.to(tl.int64)[:, None, None] * stride_wn + j2[None, :, :]
    acc = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    for k in range(0, K_PER_SPLIT if K_PER_SPLIT > 0 else k_per_split, BLOCK_K):
        k0 = k_lo + k
        kw = tl.multiple_of(k0 // 8, 4)
        wd = tl.load(w3 + kw, eviction_policy="evict_first")  # (BLOCK_N, NG, GW)
        xp = x_ptr + tl.multiple_of(k0 // 2, 16) + 4 * j2
        x0, x1 = _bf(tl.load(xp))
        x2, x3 = _bf(tl.load(xp + 1))
        x4, x5 = _bf(tl.load(xp + 2))
        x6, x7 = _bf(tl.load(xp + 3))
        sidx = rows[:, None] * stride_sn + ((k0 + tl.arange(0, NG) * GS) // GROUP)[None, :]
        sc = tl.load(s_ptr + sidx)
        zp = tl.load(z_ptr + sidx).to(tl.float32)
        xe = (x0 + x2) + (x4 + x6)
        xo = (x1 + x3) + (x5 + x7)
        xs = tl.sum(xe + xo, axis=1)  # (NG,)
        if LOAD_ONLY:
            a = tl.sum(wd, axis=2).to(tl.float32)
            acc += a + sc + zp + xs[None, :]
        else:
            bias = tl.sum(xe * 2048.0 + xo * 128.0, axis=1)  # (NG,)
            b0 = wd << 15
            b1 = wd << 7
            b2 = wd >> 1
            b3 = wd >> 9
            lo = ((b0 & _LO) | magic).to(tl.float32, bitcast=True) * x0[None, :, :]
            lo += ((b1 & _LO) | magic).to(tl.float32, bitcast=True) * x2[None, :, :]
            lo += ((b2 & _LO) | magic).to(tl.float32, bitcast=True) * x4[None, :, :]
            lo += ((b3 & _LO) | magic).to(tl.float32, bitcast=True) * x6[None, :, :]
            hi = ((b0 & _HI) | magic).to(tl.float32, bitcast=True) * x1[None, :, :]
            hi += ((b1 & _HI) | magic).to(tl.float32, bitcast=True) * x3[None, :, :]
            hi += ((b2 & _HI) | magic).to(tl.float32, bitcast=True) * x5[None, :, :]
            hi += ((b3 & _HI) | magic).to(tl.float32, bitcast=True) * x7[None, :, :]
            a = tl.sum(lo * 16.0 + hi, axis=2)  # (BLOCK_N, NG): 8 sum(q x) + bias
            acc += sc * ((a - bias[None, :]) * 0.125 - zp * xs[None, :])
    y = tl.sum(acc, axis=1)[:, None]
    wq._store_result(y, offs_n, tl.arange(0, 1), out_ptr, out_ptr, part_ptr, pid_k, 1, N, N,
                     SPLIT_K, False)  # fmt: skip


@triton.jit
def _w4r_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, N, K, stride_wn, stride_sn,
                k_per_split, magic, K_PER_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, GROUP: tl.constexpr,
                LOAD_ONLY: tl.constexpr):  # fmt: skip
    """``_w4b_kernel``'s arithmetic on (BLOCK_N, C, 4) tiles of words, C = BLOCK_K / 32
    chunks of four words (one 16-byte load, all in one group): with C = 32 * num_warps the
    threads lie along C and every thread holds all BLOCK_N rows of its chunk, so its x
    values are loaded and unpacked once for BLOCK_N rows, and a chunk's sum, bias and
    zero-point correction stay in the thread (scale and zero loaded per row and chunk)."""
    pid_k = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)
    C: tl.constexpr = BLOCK_K // 32
    c = tl.arange(0, C)
    wc = c[:, None] * 4 + tl.arange(0, 4)[None, :]  # (C, 4) words of the tile
    w3 = w_ptr + rows.to(tl.int64)[:, None, None] * stride_wn + wc[None, :, :]
    acc = tl.zeros((BLOCK_N, C), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    for k in range(0, K_PER_SPLIT if K_PER_SPLIT > 0 else k_per_split, BLOCK_K):
        k0 = k_lo + k
        wd = tl.load(w3 + tl.multiple_of(k0 // 8, 4), eviction_policy="evict_first")
        xp = x_ptr + tl.multiple_of(k0 // 2, 16) + 4 * wc
        x0, x1 = _bf(tl.load(xp))
        x2, x3 = _bf(tl.load(xp + 1))
        x4, x5 = _bf(tl.load(xp + 2))
        x6, x7 = _bf(tl.load(xp + 3))
        xe = (x0 + x2) + (x4 + x6)
        xo = (x1 + x3) + (x5 + x7)
        xs = tl.sum(xe + xo, axis=1)  # (C,)
        sidx = rows[:, None] * stride_sn + ((k0 + c * 32) // GROUP)[None, :]  # (BLOCK_N, C)
        sc = tl.load(s_ptr + sidx)
        zp = tl.load(z_ptr + sidx).to(tl.float32)
        if LOAD_ONLY:
            acc += tl.sum(wd, axis=2).to(tl.float32) + sc + zp + xs[None, :]
        else:
            bias = tl.sum(xe * 2048.0 + xo * 128.0, axis=1)  # (C,)
            b0 = wd << 15
            b1 = wd << 7
            b2 = wd >> 1
            b3 = wd >> 9
            lo = ((b0 & _LO) | magic).to(tl.float32, bitcast=True) * x0[None, :, :]
            lo += ((b1 & _LO) | magic).to(tl.float32, bitcast=True) * x2[None, :, :]
            lo += ((b2 & _LO) | magic).to(tl.float32, bitcast=True) * x4[None, :, :]
            lo += ((b3 & _LO) | magic).to(tl.float32, bitcast=True) * x6[None, :, :]
            hi = ((b0 & _HI) | magic).to(tl.float32, bitcast=True) * x1[None, :, :]
            hi += ((b1 & _HI) | magic).to(tl.float32, bitcast=True) * x3[None, :, :]
            hi += ((b2 & _HI) | magic).to(tl.float32, bitcast=True) * x5[None, :, :]
            hi += ((b3 & _HI) | magic).to(tl.float32, bitcast=True) * x7[None, :, :]
            t = tl.sum(lo * 16.0 + hi, axis=2)  # (BLOCK_N, C): 8 sum(q x) + bias
            acc += sc * ((t - bias[None, :]) * 0.125 - zp * xs[None, :])
    y = tl.sum(acc, axis=1)[:, None]
    wq._store_result(y, offs_n, tl.arange(0, 1), out_ptr, out_ptr, part_ptr, pid_k, 1, N, N,
                     SPLIT_K, False)  # fmt: skip


def run_w4(x, w, s, z, cfg, load_only=False, variant="w4"):
    k = x.shape[1]
    n = w.shape[0]
    bn, bk, split = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    kps = k // split
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, 1, n, dtype=torch.float32, device=x.device) if split > 1 else out
    args = (x.view(torch.int32), w.view(torch.int32), s, z, out, part, n, k, w.shape[1] // 4,
            s.stride(0), kps)  # fmt: skip
    kw = dict(K_PER_SPLIT=kps if wq.INTERPRET else 0, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
              GROUP=G, LOAD_ONLY=load_only, num_warps=cfg["num_warps"], num_stages=2)  # fmt: skip
    grid = (triton.cdiv(n, bn), split)
    if variant == "w4r":
        _w4r_kernel[grid](*args, 0x43000000, **kw)
    elif variant == "w4b":
        _w4b_kernel[grid](*args, 0x43000000, GS=min(bk, G), **kw)
    else:
        _w4_kernel[grid](*args, GS=min(bk, G), **kw)
    if split > 1:
        split_k_reduce(part, out, None)
    return out


def _weights(n, k, copies, dev):
    out = []
    for _ in range(copies):
        u, s, z = qf.quantize_int4(torch.randn(n, k, device=dev) / k**0.5, G)
        out.append((qf.pack_int4(u), s.float().contiguous(), z))
    return out


def check() -> None:
    torch.manual_seed(0)
    for n, k, cfg in ((24, 1024, (8, 512, 2, 4)), (13, 512, (4, 256, 1, 2)),
                      (5, 4096, (4, 1024, 2, 1)),
                      (32, 2048, (16, 1024, 1, 4)), (8, 768, (8, 128, 3, 4))):  # fmt: skip
        bn, bk, sp, nw = cfg
        w, s, z = _weights(n, k, 1, "cpu")[0]
        x = torch.randn(1, k, dtype=torch.bfloat16) * 3
        ref = wq.wq_linear_ref(x, w, s, z).float()
        c = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sp, "num_warps": nw}
        for v in ("w4", "w4b", "w4r"):
            y = run_w4(x, w, s, z, c, variant=v).float()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            print(v, n, k, c, "max err / max |ref|", err)
            assert err < 1e-2, err


def main() -> None:
    from kiln.bench.gemv_bench import LLAMA_8B_SHAPES, rotation_copies, time_per_call_ms
    from kiln.bench.quant_bench import tune_weight_only

    torch.manual_seed(0)
    rows = []
    cfgs = [{"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sp, "num_warps": nw}
            for bn in (4, 8, 16, 32, 64) for bk in (512, 1024, 2048) for sp in (1, 2, 4, 7, 8)
            for nw in (4, 8) if 1024 <= bn * bk <= 32768]  # fmt: skip
    rcfgs = [{"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sp, "num_warps": max(1, bk // 1024 // d)}
             for bn in (2, 4, 8, 16) for bk in (1024, 2048, 4096) for sp in (1, 2, 4, 7, 8)
             for d in (1, 2)]  # fmt: skip
    for name, (n, k) in LLAMA_8B_SHAPES.items():
        if name == "lm_head":
            continue
        ws = _weights(n, k, rotation_copies(n * k // 2), "cuda")
        idx = {id(t[0]): t for t in ws}
        nbytes = n * k // 2 + n * (k // G) * 5
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = wq.wq_linear_ref(x, *ws[0]).float()
        bf = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
              for _ in range(rotation_copies(2 * n * k))]  # fmt: skip
        bf_ms = time_per_call_ms(lambda w: torch.nn.functional.linear(x, w), bf, reps=10)
        del bf
        cur = tune_weight_only(n, k, 1, G, reps=10)[0]
        row = {"shape": name, "n": n, "k": k, "bytes": nbytes, "bf16_ms": bf_ms,
               "cur": {"ms": cur["ms"], "config": cur["config"]}}  # fmt: skip
        print(name, "bf16", round(bf_ms, 4), "cur", round(cur["ms"], 4), "%.2f TB/s"
              % (nbytes / cur["ms"] / 1e9), cur["config"], flush=True)  # fmt: skip
        for label, lo, var in (("w4b", False, "w4b"), ("w4r", False, "w4r"),
                               ("w4rld", True, "w4r")):  # fmt: skip
            best, allr = None, []
            # the load-only variant at the arithmetic's six best configurations
            for cfg in [r["config"] for r in row["w4r"]["top"]] if lo else (
                    rcfgs if var == "w4r" else cfgs):  # fmt: skip
                if k % (cfg["BLOCK_K"] * cfg["SPLIT_K"]):
                    continue
                try:
                    y = run_w4(x, *ws[0], cfg, lo, var).float()
                    err = ((y - ref).abs().max() / ref.abs().max()).item()
                    if not lo and not err < 1e-2:
                        print(name, label, cfg, "WRONG", err, flush=True)
                        continue
                    ms = time_per_call_ms(lambda p, c=cfg: run_w4(x, *idx[id(p)], c, lo, var),
                                          [t[0] for t in ws], reps=10)  # fmt: skip
                except Exception as e:
                    print(name, label, cfg, "ERR", type(e).__name__, str(e)[:200], flush=True)
                    continue
                allr.append({"ms": ms, "config": cfg})
                if best is None or ms < best["ms"]:
                    best = {"ms": ms, "tb_s": nbytes / ms / 1e9, "config": cfg,
                            "max_err_rel_max": err}  # fmt: skip
            row[label] = {"best": best, "top": sorted(allr, key=lambda r: r["ms"])[:6]}
            if best:
                print(name, label, round(best["ms"], 4), f"{best['tb_s']:.2f} TB/s",
                      best["config"], flush=True)  # fmt: skip
        rows.append(row)
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    check() if "--check" in sys.argv else main()
