# ruff: noqa: E501, SIM115 (an experiment: closures timed within their iteration)
"""Experiment (H200): an int4 tensor-core kernel for 1-16 rows whose codes become bfloat16
through packed PTX (``prmt`` + ``lop3``: two codes per 32-bit register, 128 + q), with the
zero point applied as a correction ``(128 + zero) * sum(x)`` after the dot, against the
engine's kernels (every tuner candidate, ``kiln.bench.quant_bench.tune_weight_only``) and
bf16 cuBLAS at Llama-3.1-8B's projections (group 128). Not an engine path.

Every configuration is checked against ``wq_linear_ref`` first. Usage (GPU):
``PYTHONPATH=. python scripts/experiments/int4_tc_asm.py OUT.json``."""

import json
import sys

import torch
import triton
import triton.language as tl

from kiln.bench.gemv_bench import LLAMA_8B_SHAPES, time_per_call_ms
from kiln.bench.quant_bench import tune_weight_only
from kiln.kernels import wq_gemm as wq
from kiln.kernels.gemv import _store_result, split_k_reduce
from kiln.quant import formats as qf

G = 128


@triton.jit
def _codes_bf16(p):
    """uint8 bytes -> (low, high) bfloat16 128 + nibble, four bytes per asm call."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t0, t1, zz;
        mov.b32 zz, 0;
        prmt.b32 t0, $4, zz, 0x4140;
        prmt.b32 t1, $4, zz, 0x4342;
        lop3.b32 $0, t0, 0x000F000F, 0x43004300, 0xEA;
        lop3.b32 $1, t1, 0x000F000F, 0x43004300, 0xEA;
        shr.u32 t0, t0, 4;
        shr.u32 t1, t1, 4;
        lop3.b32 $2, t0, 0x000F000F, 0x43004300, 0xEA;
        lop3.b32 $3, t1, 0x000F000F, 0x43004300, 0xEA;
        }""",
        constraints="=r,=r,=r,=r,r",
        args=[p],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _tc4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, M, N, K, stride_xm, stride_wn,
                stride_sn, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    pid_k = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    rows = tl.minimum(offs_n, N - 1)
    w_row = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    HB: tl.constexpr = BLOCK_K // 2
    oh = tl.arange(0, HB)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    for k in range(0, k_per_split, BLOCK_K):
        k0 = k_lo + k
        ke = k0 + 2 * oh
        p = tl.load(w_row + (k0 // 2 + oh)[None, :], eviction_policy="evict_first")
        xe = tl.load(x_ptr + offs_m[:, None] * stride_xm + ke[None, :], mask=m_ok[:, None],
                     other=0.0)  # fmt: skip
        xo = tl.load(x_ptr + offs_m[:, None] * stride_xm + ke[None, :] + 1, mask=m_ok[:, None],
                     other=0.0)  # fmt: skip
        g = k0 // GROUP
        sc = tl.load(s_ptr + rows * stride_sn + g)
        zp = tl.load(z_ptr + rows * stride_sn + g).to(tl.float32) + 128.0
        a_lo, a_hi = _codes_bf16(p)
        t = tl.dot(a_lo, tl.trans(xe))
        t = tl.dot(a_hi, tl.trans(xo), t)
        xs = tl.sum(xe.to(tl.float32), axis=1) + tl.sum(xo.to(tl.float32), axis=1)
        acc += sc[:, None] * (t - zp[:, None] * xs[None, :])
    _store_result(acc, offs_n, offs_m, out_ptr, out_ptr, part_ptr, pid_k, M, N, N, SPLIT_K,
                  False)  # fmt: skip


@triton.jit
def _w32_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, N, K, stride_wn, stride_sn,
                k_per_split, K_PER_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, GROUP: tl.constexpr,
                GS: tl.constexpr):  # fmt: skip
    """One row, 32-bit words of 8 codes (code j at bits 4j): codes 0-4 become float32
    2**23 + q * 16**j by masking in place (no shift), 5-7 the same after one shift by 12;
    x's column j is pre-scaled by 16**-j; the zero point is a per-chunk correction."""
    pid_k = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r3 = tl.minimum(offs_n, N - 1)[:, None, None]
    w3 = w_ptr + r3.to(tl.int64) * stride_wn
    GSW: tl.constexpr = GS // 8
    NG: tl.constexpr = BLOCK_K // GS
    g = tl.arange(0, NG)
    i3 = (g[:, None] * GSW + tl.arange(0, GSW)[None, :])[None, :, :]
    acc = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    for k in range(0, K_PER_SPLIT if K_PER_SPLIT > 0 else k_per_split, BLOCK_K):
        k0 = k_lo + k
        wd = tl.load(w3 + (k0 // 8 + i3), eviction_policy="evict_first")
        wh = wd >> 12
        xb = x_ptr + k0 + 8 * i3
        sidx = r3 * stride_sn + ((k0 + g * GS) // GROUP)[None, :, None]
        sc = tl.load(s_ptr + sidx)
        zp = tl.load(z_ptr + sidx).to(tl.float32)
        t = tl.zeros((BLOCK_N, NG, GSW), dtype=tl.float32)
        xs = tl.zeros((1, NG, GSW), dtype=tl.float32)
        for j in tl.static_range(8):
            xj = tl.load(xb + j).to(tl.float32)
            xs += xj
            if j < 5:
                v = ((wd & (0xF << (4 * j))) | 0x4B000000).to(tl.float32, bitcast=True)
                t += (v - 8388608.0) * (xj * (1.0 / (16 ** j)))
            else:
                v = ((wh & (0xF << (4 * (j - 3)))) | 0x4B000000).to(tl.float32, bitcast=True)
                t += (v - 8388608.0) * (xj * (1.0 / (16 ** (j - 3))))
        acc += (tl.sum(t, axis=2) - tl.sum(zp, axis=2) * tl.sum(xs, axis=2)) * tl.sum(sc, axis=2)
    y = tl.sum(acc, axis=1)[:, None]
    _store_result(y, offs_n, tl.arange(0, 1), out_ptr, out_ptr, part_ptr, pid_k, 1, N, N,
                  SPLIT_K, False)  # fmt: skip


def run_w32(x, w, s, z, cfg):
    k = x.shape[1]
    n = w.shape[0]
    wi = w.view(torch.int32)
    bn, bk, split = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    kps = k // split
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, 1, n, dtype=torch.float32, device=x.device) if split > 1 else out
    _w32_kernel[(triton.cdiv(n, bn), split)](
        x, wi, s, z, out, part, n, k, wi.stride(0), s.stride(0), kps,
        K_PER_SPLIT=kps if wq.INTERPRET else 0, BLOCK_N=bn, BLOCK_K=bk,
        SPLIT_K=split, GROUP=G, GS=min(bk, G), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )  # fmt: skip
    if split > 1:
        split_k_reduce(part, out, None)
    return out


def sweep(label, runner, cfgs, x, ws, idx, ref, k, nbytes, name, m):
    best = None
    for cfg in cfgs:
        if k % (cfg["BLOCK_K"] * cfg["SPLIT_K"]):
            continue
        try:
            y = runner(x, *ws[0], cfg).float()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            if not err < 1e-2:
                print(label, cfg, "WRONG", err, flush=True)
                continue
            ms = time_per_call_ms(lambda p, c=cfg: runner(x, *idx[id(p)], c),
                                  [t[0] for t in ws], reps=10)  # fmt: skip
        except Exception as e:
            print(label, cfg, "ERR", type(e).__name__, str(e)[:300], flush=True)
            continue
        if best is None or ms < best["ms"]:
            best = {"ms": ms, "config": cfg, "max_err_rel_max": err}
    if best:
        print(name, m, label, round(best["ms"], 4), "%.2f TB/s" % (nbytes / best["ms"] / 1e9),
              best["config"], flush=True)  # fmt: skip
    return best


def run_tc4(x, w, s, z, cfg):
    m, k = x.shape
    n = w.shape[0]
    bn, bk, split = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    kps = k // split
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    _tc4_kernel[(triton.cdiv(n, bn), split)](
        x, w, s, z, out, part, m, n, k, x.stride(0), w.stride(0), s.stride(0), kps,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
        GROUP=G, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if split > 1:
        split_k_reduce(part, out, None)
    return out


def main() -> None:
    torch.manual_seed(0)
    rows = []
    cfgs = [{"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sp, "num_warps": nw, "num_stages": st}
            for bn in (64, 128) for bk in (128,) for sp in (4, 8, 16) for nw in (4, 8)
            for st in (2, 3, 4)]  # fmt: skip
    w32_cfgs = [{"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sp, "num_warps": nw, "num_stages": 2}
                for bn in (8, 16, 32) for bk in (512, 1024) for sp in (1, 2, 4, 8)
                for nw in (4, 8)]  # fmt: skip
    for name, (n, k) in LLAMA_8B_SHAPES.items():
        if name == "lm_head":
            continue
        copies = max(2, (512 << 20) // (n * k // 2))
        ws = []
        for _ in range(copies):
            wf = torch.randn(n, k, device="cuda") / k**0.5
            u, s, z = qf.quantize_int4(wf, G)
            ws.append((qf.pack_int4(u), s.float().contiguous(), z))
        idx = {id(t[0]): t for t in ws}
        nbytes = n * k // 2 + 2 * n * (k // G) * 4
        bf = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
              for _ in range(max(2, (512 << 20) // (2 * n * k)))]  # fmt: skip
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = wq.wq_linear_ref(x, *ws[0]).float()
            bf_ms = time_per_call_ms(lambda w: torch.nn.functional.linear(x, w), bf, reps=10)
            cur = tune_weight_only(n, k, m, G, reps=10)
            row = {"shape": name, "n": n, "k": k, "m": m, "bf16_ms": bf_ms,
                   "cur": {"ms": cur[0]["ms"], "config": cur[0]["config"]}, "tc4": None}  # fmt: skip
            print(name, m, "bf16", round(bf_ms, 4), "cur", round(cur[0]["ms"], 4),
                  cur[0]["config"], flush=True)  # fmt: skip
            row["tc4"] = sweep("tc4", run_tc4, cfgs, x, ws, idx, ref, k, nbytes, name, m)
            if m == 1:
                row["w32"] = sweep("w32", run_w32, w32_cfgs, x, ws, idx, ref, k, nbytes, name, m)
            rows.append(row)
            json.dump(rows, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
