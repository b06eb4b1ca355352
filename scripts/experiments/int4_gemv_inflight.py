"""Experiment (H200): is the one-row int4 kernel bound by its ALU work or by too few bytes in
flight? Variants of the engine's ``_wq4_fma_kernel`` (EVEN_K, no smoothing) at
Llama-3.1-8B's projections (group 128), each swept over tiles, splits, warps and stages:

- ``cur``: the engine kernel's arithmetic, the loop as written (synchronous loads unless
  Triton's pipeliner moves them; the compiled TTGIR is checked for async copies);
- ``rs``: the same loop as ``tl.range(..., num_stages=S)``: with the loop's own stage
  count Triton pipelines loads that feed no dot, so the weight tiles arrive by
  asynchronous copies S - 1 tiles ahead (a hand-made register prefetch, measured before,
  was slower than ``cur``: more registers, fewer programs);
- ``ld`` / ``rsld``: the same loads with almost no arithmetic (a byte sum), without and
  with the pipelining: the memory ceiling of the access pattern.

With ``INFLIGHT_BIG=1``: ``cur`` and ``ld`` only, with K tiles of 2,048 or 4,096 codes
(a program issues its whole slice of K in one or two loads).

Every variant except the load-only ones is checked against ``wq_linear_ref`` first. Usage
(GPU): ``PYTHONPATH=. python scripts/experiments/int4_gemv_inflight.py OUT.json``."""

import json
import os
import sys

import torch
import triton
import triton.language as tl

from kiln.bench.gemv_bench import LLAMA_8B_SHAPES, rotation_copies, time_per_call_ms
from kiln.bench.quant_bench import _wq_weights
from kiln.kernels import wq_gemm as wq
from kiln.kernels.gemv import split_k_reduce

G = 128


@triton.jit
def _tile(w3, x_row, s_ptr, z_ptr, k0, r3, stride_sn, byte3, g, GS: tl.constexpr,
          GROUP: tl.constexpr):  # fmt: skip
    ke = k0 + 2 * byte3
    sidx = r3 * stride_sn + ((k0 + g * GS) // GROUP)[None, :, None]
    p = tl.load(w3 + (k0 // 2 + byte3), eviction_policy="evict_first")
    return (
        p,
        tl.load(x_row + ke),
        tl.load(x_row + ke + 1),
        tl.load(s_ptr + sidx),
        tl.load(z_ptr + sidx),
    )


@triton.jit
def _math(p, xe, xo, sc, zp, LOAD_ONLY: tl.constexpr):
    if LOAD_ONLY:
        q = p.to(tl.int32)
        return (
            tl.sum(q, axis=2).to(tl.float32)
            + tl.sum(sc, axis=2)
            + tl.sum(zp.to(tl.float32), axis=2)
            + tl.sum(xe.to(tl.float32) + xo.to(tl.float32), axis=2)
        )
    q = p.to(tl.int32)
    zm = zp.to(tl.float32) + 8388608.0
    lo = ((q & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zm
    hi = ((q >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - zm
    t = lo * xe.to(tl.float32) + hi * xo.to(tl.float32)
    return tl.sum(t, axis=2) * tl.sum(sc, axis=2)


@triton.jit
def _v_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, N, K, stride_wn, stride_sn,
              k_per_split, K_PER_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, GROUP: tl.constexpr,
              GS: tl.constexpr, PF: tl.constexpr, LOAD_ONLY: tl.constexpr,
              STAGES: tl.constexpr):  # fmt: skip
    pid_k = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r3 = tl.minimum(offs_n, N - 1)[:, None, None]
    w3 = w_ptr + r3.to(tl.int64) * stride_wn
    GSB: tl.constexpr = GS // 2
    NG: tl.constexpr = BLOCK_K // GS
    g = tl.arange(0, NG)
    byte3 = (g[:, None] * GSB + tl.arange(0, GSB)[None, :])[None, :, :]
    acc = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    if PF:  # Triton's pipeliner: asynchronous copies of the weight tiles, STAGES deep
        for k in tl.range(0, K_PER_SPLIT if K_PER_SPLIT > 0 else k_per_split, BLOCK_K,
                          num_stages=STAGES):  # fmt: skip
            p, xe, xo, sc, zp = _tile(w3, x_ptr, s_ptr, z_ptr, k_lo + k, r3, stride_sn, byte3,
                                      g, GS, GROUP)  # fmt: skip
            acc += _math(p, xe, xo, sc, zp, LOAD_ONLY)
    else:
        for k in range(0, K_PER_SPLIT if K_PER_SPLIT > 0 else k_per_split, BLOCK_K):
            p, xe, xo, sc, zp = _tile(w3, x_ptr, s_ptr, z_ptr, k_lo + k, r3, stride_sn, byte3,
                                      g, GS, GROUP)  # fmt: skip
            acc += _math(p, xe, xo, sc, zp, LOAD_ONLY)
    y = tl.sum(acc, axis=1)[:, None]
    wq._store_result(y, offs_n, tl.arange(0, 1), out_ptr, out_ptr, part_ptr, pid_k, 1, N, N,
                     SPLIT_K, False)  # fmt: skip


def run(x, w, s, z, cfg, pf, load_only, info=None):
    k = x.shape[1]
    n = w.shape[0]
    bn, bk, split = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    kps = k // split
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, 1, n, dtype=torch.float32, device=x.device) if split > 1 else out
    h = _v_kernel[(triton.cdiv(n, bn), split)](
        x, w, s, z, out, part, n, k, w.stride(0), s.stride(0), kps,
        K_PER_SPLIT=kps if wq.INTERPRET else 0, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
        GROUP=G, GS=min(bk, G), PF=pf, LOAD_ONLY=load_only, STAGES=cfg["num_stages"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if info is not None and h is not None and not wq.INTERPRET:
        ttgir = h.asm.get("ttgir", "")
        info["async_copy"] = "async_copy" in ttgir or "async_tma" in ttgir
        info["regs"] = getattr(h, "n_regs", None)
        info["spills"] = getattr(h, "n_spills", None)
    if split > 1:
        split_k_reduce(part, out, None)
    return out


VARIANTS = {"cur": (False, False), "rs": (True, False), "ld": (False, True), "rsld": (True, True)}


def main() -> None:
    torch.manual_seed(0)
    rows = []
    cfgs = [{"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sp, "num_warps": nw, "num_stages": st}
            for bn in (16, 32, 64) for bk in (256, 512, 1024) for sp in (1, 2, 4) for nw in (4,)
            for st in (2, 3, 4)]  # fmt: skip
    variants = VARIANTS
    if os.environ.get("INFLIGHT_BIG"):  # one or two K tiles per program: all bytes at once
        cfgs = [{"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sp, "num_warps": nw, "num_stages": 2}
                for bn in (8, 16) for bk in (2048, 4096) for sp in (1, 2)
                for nw in (4, 8)]  # fmt: skip
        variants = {v: VARIANTS[v] for v in ("cur", "ld")}
    for name, (n, k) in LLAMA_8B_SHAPES.items():
        if name == "lm_head":
            continue
        ws = [(p, s.float().contiguous(), z)
              for p, s, z in _wq_weights(n, k, True, G, rotation_copies(n * k // 2))]  # fmt: skip
        idx = {id(t[0]): t for t in ws}
        nbytes = n * k // 2 + n * (k // G) * 5  # codes, float32 scales, uint8 zeros
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = wq.wq_linear_ref(x, *ws[0]).float()
        row = {"shape": name, "n": n, "k": k, "bytes": nbytes}
        for label, (pf, lo) in variants.items():
            best, by_stages = None, {}
            for cfg in cfgs:
                if not pf and cfg["num_stages"] != 2:  # a plain loop ignores the stages
                    continue
                if k % (cfg["BLOCK_K"] * cfg["SPLIT_K"]) or k // cfg["SPLIT_K"] < cfg["BLOCK_K"]:
                    continue
                info: dict = {}
                try:
                    y = run(x, *ws[0], cfg, pf, lo, info).float()
                    err = ((y - ref).abs().max() / ref.abs().max()).item()
                    if not lo and not err < 1e-2:
                        print(name, label, cfg, "WRONG", err, flush=True)
                        continue
                    ms = time_per_call_ms(
                        lambda p, c=cfg, x=x, idx=idx, pf=pf, lo=lo: run(x, *idx[id(p)], c, pf, lo),
                        [t[0] for t in ws], reps=10,
                    )  # fmt: skip
                except Exception as e:  # a config that fails to compile
                    print(name, label, cfg, "ERR", type(e).__name__, str(e)[:200], flush=True)
                    continue
                st = cfg["num_stages"]
                if st not in by_stages or ms < by_stages[st]["ms"]:
                    by_stages[st] = {"ms": ms, "config": cfg, **info}
                if best is None or ms < best["ms"]:
                    best = {"ms": ms, "tb_s": nbytes / ms / 1e9, "config": cfg, **info}
            row[label] = {"best": best, "best_by_stages": by_stages}
            if best:
                print(name, label, round(best["ms"], 4), f"{best['tb_s']:.2f} TB/s",
                      best["config"], {s: round(v["ms"], 4) for s, v in by_stages.items()},
                      "async" if best.get("async_copy") else "sync", best.get("regs"),
                      flush=True)  # fmt: skip
        rows.append(row)
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
