"""Experiment (H200): decode attention over an fp8 cache whose V half is stored transposed
per (block, kv head), i.e. each block's V for one head is a contiguous (D, BS) tile, so
that the PV dot's fp8 operand is contiguous along its reduction (the tokens), as K already
is along D for the QK dot. ``fp8kv_decode_variants2.py`` found that with the engine's
layout Triton reads the V operand from shared memory one byte at a time.

Variants (runtime splits, no window; all read the same bytes):

- ``cvt``: the engine's arithmetic over the engine's layout (K and V -> float16);
- ``vt``: V transposed, K and V -> float16, float16 dots;
- ``vt8``: V transposed, both dots in fp8 (q quantized per program to e4m3, p scaled by
  448 and rounded to e4m3), the arithmetic of TensorRT-LLM's fp8 attention;
- ``vt_pv8``: V transposed, QK as ``vt``, PV in fp8.

Each reports its max error against ``paged_attention_ref`` over the dequantized cache.
Usage (GPU): ``PYTHONPATH=. python scripts/experiments/fp8kv_decode_vt.py OUT.json``."""

import functools
import json
import sys

import torch
import triton
import triton.language as tl

from kiln.bench.kernels import _paged, median_cuda_ms
from kiln.kernels.attention import paged_attention_ref
from kiln.kernels.decode_attention import _decode_reduce


@triton.jit
def _vt_partial(q_ptr, kv_ptr, bt_ptr, lens_ptr, acc_ptr, ml_ptr, ks_ptr, stride_qt, stride_qh,
                stride_kind, stride_kb, stride_kt, stride_kh, stride_bt, scale,
                G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                NB: tl.constexpr, NUM_SPLITS: tl.constexpr, MODE: tl.constexpr,
                STAGES: tl.constexpr):  # fmt: skip
    """MODE 0: engine layout, float16 dots; 1: V transposed, float16 dots; 2: V transposed,
    fp8 dots; 3: V transposed, float16 QK and fp8 PV."""
    s, h, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(lens_ptr + s)
    n_blocks = (ctx + BS - 1) // BS
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = h * G + g
    q = tl.load(q_ptr + s * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=(g < G)[:, None], other=0.0).to(tl.float32)  # fmt: skip
    scale = scale * tl.load(ks_ptr)
    vs = tl.load(ks_ptr + 1)
    if MODE == 2:
        qs = tl.maximum(tl.max(tl.abs(q)), 1e-12) / 448.0
        scale = scale * qs
        q = (q / qs).to(tl.float8e4nv)
    else:
        q = tl.clamp(q, -65504.0, 65504.0).to(tl.float16)
    m_i = tl.full([G_PAD], -1e30, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    bt_row = bt_ptr + s * stride_bt
    n_chunks = (n_blocks + NB - 1) // NB
    per_split = tl.cdiv(n_chunks, NUM_SPLITS)
    c_lo = sp * per_split
    t = tl.arange(0, NB * BS)
    for i in tl.range(0, tl.minimum(per_split, n_chunks - c_lo), num_stages=STAGES):
        c = c_lo + i
        b = c * NB + t // BS
        active = b < n_blocks
        blk = tl.load(bt_row + b, mask=active, other=0).to(tl.int64)
        offs = blk[:, None] * stride_kb + (t % BS)[:, None] * stride_kt + h * stride_kh
        k = tl.load(kv_ptr + offs + d[None, :], mask=active[:, None], other=0.0)
        if MODE == 0:
            v = tl.load(kv_ptr + stride_kind + offs + d[None, :], mask=active[:, None],
                        other=0.0).to(tl.float16)  # fmt: skip
        else:  # (D, NB*BS): block b's head h at b * stride_kb + h * D * BS, then d * BS + t
            vt_offs = blk[None, :] * stride_kb + h * (D * BS) + d[:, None] * BS + (t % BS)[None, :]
            vt = tl.load(kv_ptr + stride_kind + vt_offs, mask=active[None, :], other=0.0)
        if MODE == 2:
            scores = tl.dot(q, tl.trans(k)) * scale
        else:
            scores = tl.dot(q, tl.trans(k.to(tl.float16))) * scale
        pos = c * (NB * BS) + t
        scores = tl.where((pos < ctx)[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MODE == 0:
            pv = tl.dot(p.to(tl.float16), v)
        elif MODE == 1:
            pv = tl.dot(p.to(tl.float16), tl.trans(vt.to(tl.float16)))
        else:
            pv = tl.dot((p * 448.0).to(tl.float8e4nv), tl.trans(vt)) * (1.0 / 448.0)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    acc = acc * vs
    r = (s * (tl.num_programs(1) * G) + heads) * NUM_SPLITS + sp
    tl.store(acc_ptr + r[:, None] * D + d[None, :], acc, mask=(g < G)[:, None])
    tl.store(ml_ptr + r * 2, m_i, mask=g < G)
    tl.store(ml_ptr + r * 2 + 1, l_i, mask=g < G)


def run_variant(q, cache, scales, meta, out, nb, mode, stages, warps, target=264):
    _, _, bs, hk, d = cache.shape
    b, hq = meta.seq_lens.shape[0], q.shape[1]
    splits = triton.next_power_of_2(max(1, target // (b * hk)))
    acc = torch.empty(b * hq * splits, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(b * hq * splits, 2, dtype=torch.float32, device=q.device)
    bt = meta.block_tables
    _vt_partial[(b, hk, splits)](
        q, cache, bt, meta.seq_lens, acc, ml, scales, q.stride(0), q.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), bt.stride(0),
        d**-0.5, G=hq // hk, G_PAD=max(16, triton.next_power_of_2(hq // hk)), D=d, BS=bs,
        NB=nb, NUM_SPLITS=splits, MODE=mode, STAGES=stages, num_warps=warps,
    )  # fmt: skip
    _decode_reduce[(b, hq)](acc, ml, meta.query_start_loc[:-1], out, out.stride(0),
                            out.stride(1), hq, D=d, NUM_SPLITS=splits,
                            SPLITS_PAD=triton.next_power_of_2(splits))  # fmt: skip


VARIANTS = {"cvt": 0, "vt": 1, "vt8": 2, "vt_pv8": 3}


def main() -> None:
    torch.manual_seed(0)
    hq, hk, d, bs = 32, 8, 128, 32
    rows = []
    for ctx, batch in ((1536, 880), (1024, 256), (8192, 64), (2100, 512)):
        q, cache, meta = _paged(batch, ctx, 1, hq, hk, d, bs, torch.bfloat16)
        scales = torch.tensor([0.05, 0.05], device="cuda")
        fp8 = (cache.float() / 0.05).to(torch.float8_e4m3fn)
        del cache
        ref = paged_attention_ref(q.float(), fp8.float() * 0.05, meta, d**-0.5)
        vt = fp8.clone()  # V half rewritten as (blocks, Hk, D, BS) inside each block
        vt[1] = fp8[1].permute(0, 2, 3, 1).contiguous().view(fp8[1].shape)
        out = torch.empty_like(q)
        nbytes = batch * ctx * 2 * hk * d
        row = {"context": ctx, "batch": batch}
        for nb in (2, 4):
            for warps in (4, 8):
                for stages in (1, 2):
                    for name, mode in VARIANTS.items():
                        src = fp8 if mode == 0 else vt
                        fn = functools.partial(run_variant, q, src, scales, meta, out, nb, mode,
                                               stages, warps)  # fmt: skip
                        out.fill_(float("nan"))
                        try:
                            fn()
                            res = {"max_err": (out.float() - ref).abs().max().item()}
                            res["ms"] = median_cuda_ms(fn)
                            res["tb_s"] = nbytes / res["ms"] / 1e9
                        except Exception as e:  # a variant that fails to compile is a result
                            res = {"error": f"{type(e).__name__}: {e}"[-400:]}
                        row[f"{name}_nb{nb}_w{warps}_s{stages}"] = res
        best = {}
        for name in VARIANTS:
            cands = [
                (v["tb_s"], k)
                for k, v in row.items()
                if k.startswith(name + "_nb") and isinstance(v, dict) and "tb_s" in v
            ]
            best[name] = max(cands) if cands else None
        row["best"] = best
        print(json.dumps({"context": ctx, "batch": batch, "best": best}), flush=True)
        rows.append(row)
        del fp8, vt
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
