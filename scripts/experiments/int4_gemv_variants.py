"""Experiment (H200): one-row int4 GEMV kernel variants against the engine's current
broadcast-multiply kernel, at Llama-3.1-8B's projections (group 128). Not an engine path.

- ``cur``: ``wq_linear_triton`` with each tuner candidate (kiln.bench.quant_bench);
- ``eo``: the stored layout (element 2j low nibble, 2j + 1 high), no nibble join: the low
  and high codes multiply x's even and odd columns, in 3D (rows, groups, bytes) tiles;
- ``half``: a repacked layout where each chunk of 2 * GSB codes keeps its first GSB codes
  in the low nibbles and the next GSB in the high ones, so x is read contiguously;
- ``*d``: the group scale applied once per group after a sum over its codes (deferred).

Every variant is checked against ``wq_linear_ref`` first. Usage (GPU):
``PYTHONPATH=. python scripts/experiments/int4_gemv_variants.py OUT.json``."""

import json
import sys

import torch
import triton
import triton.language as tl

from kiln.bench.gemv_bench import LLAMA_8B_SHAPES, time_per_call_ms
from kiln.bench.quant_bench import tune_weight_only
from kiln.kernels import wq_gemm as wq
from kiln.kernels.gemv import split_k_reduce
from kiln.quant import formats as qf

G = 128


@triton.jit
def _v_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, N, K, stride_wn, stride_sn,
              k_per_split, K_PER_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, NG: tl.constexpr,
              GSB: tl.constexpr,
              SPLIT_K: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr,
              DEFER: tl.constexpr):  # fmt: skip
    pid_k = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)
    r3 = rows[:, None, None]
    w_row = w_ptr + r3.to(tl.int64) * stride_wn
    g3 = tl.arange(0, NG)[None, :, None]
    j3 = tl.arange(0, GSB)[None, None, :]
    BK: tl.constexpr = NG * GSB * 2
    if DEFER:
        acc = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, NG, GSB), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    for k in range(0, K_PER_SPLIT if K_PER_SPLIT > 0 else k_per_split, BK):
        k0 = k_lo + k
        p = tl.load(w_row + (k0 // 2 + g3 * GSB + j3), eviction_policy="evict_first").to(tl.int32)
        c0 = k0 + g3 * (2 * GSB)
        if HALF:
            xl = tl.load(x_ptr + c0 + j3).to(tl.float32)
            xh = tl.load(x_ptr + c0 + GSB + j3).to(tl.float32)
        else:
            xl = tl.load(x_ptr + c0 + 2 * j3).to(tl.float32)
            xh = tl.load(x_ptr + c0 + 2 * j3 + 1).to(tl.float32)
        sidx = r3 * stride_sn + c0 // GROUP
        sc = tl.load(s_ptr + sidx)
        zm = tl.load(z_ptr + sidx).to(tl.float32) + 8388608.0
        lo = ((p & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zm
        hi = ((p >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - zm
        t = lo * xl + hi * xh
        if DEFER:
            acc += tl.sum(t, axis=2) * tl.sum(sc, axis=2)
        else:
            acc += t * sc
    y = tl.sum(acc, axis=1) if DEFER else tl.sum(tl.sum(acc, axis=2), axis=1)
    n_ok = offs_n < N
    if SPLIT_K == 1:
        tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.store(part_ptr + pid_k * N + offs_n, y, mask=n_ok)


def repack_half(u: torch.Tensor, gsb: int) -> torch.Tensor:
    """(N, K) codes -> (N, K/2) bytes, each chunk of 2*gsb codes: first gsb low, next high."""
    n, k = u.shape
    c = u.reshape(n, k // (2 * gsb), 2, gsb).to(torch.uint8)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def run_variant(x, w, s, z, cfg, half, defer):
    n, k = w.shape[0], x.shape[1]
    bn, bk, split, warps = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"], cfg["num_warps"]
    gsb = min(bk, G) // 2
    ng = bk // (2 * gsb)
    kps = k // split
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, 1, n, dtype=torch.float32, device=x.device) if split > 1 else out
    _v_kernel[(triton.cdiv(n, bn), split)](
        x, w, s, z, out, part, n, k, w.stride(0), s.stride(0), kps,
        K_PER_SPLIT=kps if wq.INTERPRET else 0, BLOCK_N=bn, NG=ng,
        GSB=gsb, SPLIT_K=split, GROUP=G, HALF=half, DEFER=defer, num_warps=warps,
        num_stages=cfg.get("num_stages", 2),
    )  # fmt: skip
    if split > 1:
        split_k_reduce(part, out, None)
    return out


def main() -> None:
    torch.manual_seed(0)
    rows = []
    cfgs = [{"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sp, "num_warps": nw}
            for bn in (8, 16, 32) for bk in (512, 1024) for nw in (4, 8)
            for sp in (1, 2, 4)]  # fmt: skip
    for name, (n, k) in LLAMA_8B_SHAPES.items():
        if name == "lm_head":
            continue
        copies = max(2, (512 << 20) // (n * k // 2))
        ws = []
        for _ in range(copies):
            wf = torch.randn(n, k, device="cuda") / k**0.5
            u, s, z = qf.quantize_int4(wf, G)
            ws.append((u, s.float().contiguous(), z))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = wq.wq_linear_ref(x, qf.pack_int4(ws[0][0]), ws[0][1], ws[0][2]).float()
        nbytes = n * k // 2 + 2 * n * (k // G) * 4
        bf = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            for _ in range(max(2, (512 << 20) // (2 * n * k)))
        ]
        bf_ms = time_per_call_ms(lambda w: torch.nn.functional.linear(x, w), bf, reps=10)
        row = {"shape": name, "n": n, "k": k, "bf16_ms": bf_ms, "variants": {}}
        cur = tune_weight_only(n, k, 1, G, reps=10)
        row["variants"]["cur"] = {"ms": cur[0]["ms"], "config": cur[0]["config"]}
        print(
            name,
            "bf16",
            round(bf_ms, 4),
            "cur",
            round(cur[0]["ms"], 4),
            cur[0]["config"],
            flush=True,
        )
        for vname, half, defer in (("eo", False, False), ("half", True, False),
                                   ("eod", False, True), ("halfd", True, True)):  # fmt: skip
            best = None
            packed = {}
            for cfg in cfgs:
                if k % (cfg["BLOCK_K"] * cfg["SPLIT_K"]):
                    continue
                gsb = min(cfg["BLOCK_K"], G) // 2
                key = gsb if half else 0
                if key not in packed:
                    packed[key] = [(repack_half(u, gsb) if half else qf.pack_int4(u), s, z)
                                   for u, s, z in ws]  # fmt: skip
                pw = packed[key]
                idx = {id(t[0]): t for t in pw}
                try:
                    y = run_variant(x, *pw[0], cfg, half, defer).float()
                    err = ((y - ref).abs() / (ref.abs() + 1e-2)).max().item()
                    if not err < 2e-2:
                        print(vname, cfg, "WRONG", err, flush=True)
                        continue
                    ms = time_per_call_ms(lambda p, c=cfg: run_variant(x, *idx[id(p)], c, half,
                                                                        defer),
                                          [t[0] for t in pw], reps=10)  # fmt: skip
                except Exception as e:
                    print(vname, cfg, "ERR", type(e).__name__, str(e)[:100], flush=True)
                    continue
                if best is None or ms < best["ms"]:
                    best = {"ms": ms, "config": cfg}
            row["variants"][vname] = best
            if best:
                print(name, vname, round(best["ms"], 4), "%.2f TB/s" % (nbytes / best["ms"] / 1e9),
                      best["config"], flush=True)  # fmt: skip
            del packed
        rows.append(row)
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
