"""Experiment (H200): why decode attention over an fp8 cache reads its bytes at half the
rate of a bfloat16 cache. Variants of the engine's first kernel (``_decode_partial``,
runtime splits, no window) over an fp8 cache, against the engine kernel itself:

- ``kt``: K loaded already transposed, as a (D, NB * BS) tile, so that no ``tl.trans``
  stands between the load and the dot (Triton can move an upcast past the layout change
  into the dot's operand, and then pipeline the load, only in some arrangements);
- ``f16`` / ``bf16``: the dtype the fp8 tiles are converted to (q and p follow);
- ``raw``: no conversion at all, K and V multiplied as fp8 bytes reinterpreted as int8
  and widened (wrong numbers; the cost of the loads and the softmax alone).

Every variant but ``raw`` is checked against ``paged_attention_ref``. Usage (GPU):
``PYTHONPATH=. python scripts/experiments/fp8kv_decode_variants.py OUT.json``."""

import functools
import json
import sys

import torch
import triton
import triton.language as tl

from kiln.bench.kernels import _paged, median_cuda_ms
from kiln.kernels.attention import paged_attention_ref
from kiln.kernels.decode_attention import _decode_reduce, decode_attention_triton


@triton.jit
def _partial_v(q_ptr, kv_ptr, bt_ptr, lens_ptr, acc_ptr, ml_ptr, ks_ptr, stride_qt, stride_qh,
               stride_kind, stride_kb, stride_kt, stride_kh, stride_bt, scale, G: tl.constexpr,
               G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, NB: tl.constexpr,
               NUM_SPLITS: tl.constexpr, KT: tl.constexpr, F16: tl.constexpr,
               RAW: tl.constexpr):  # fmt: skip
    s, h, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(lens_ptr + s)
    n_blocks = (ctx + BS - 1) // BS
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    t = tl.arange(0, NB * BS)
    heads = h * G + g
    q = tl.load(q_ptr + s * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=(g < G)[:, None], other=0.0)  # fmt: skip
    dt = tl.float16 if F16 else tl.bfloat16
    q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(dt)
    scale = scale * tl.load(ks_ptr)
    m_i = tl.full([G_PAD], -1e30, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    n_chunks = (n_blocks + NB - 1) // NB
    per_split = tl.cdiv(n_chunks, NUM_SPLITS)
    c_lo = sp * per_split
    for i in range(0, tl.minimum(per_split, n_chunks - c_lo)):
        c = c_lo + i
        b = c * NB + t // BS
        active = b < n_blocks
        blk = tl.load(bt_ptr + s * stride_bt + b, mask=active, other=0).to(tl.int64)
        row = blk * stride_kb + (t % BS) * stride_kt + h * stride_kh  # (NB * BS,)
        v = tl.load(kv_ptr + stride_kind + row[:, None] + d[None, :], mask=active[:, None],
                    other=0.0)  # fmt: skip
        if KT:
            kt = tl.load(kv_ptr + row[None, :] + d[:, None], mask=active[None, :], other=0.0)
        else:
            kt = tl.trans(tl.load(kv_ptr + row[:, None] + d[None, :], mask=active[:, None],
                                  other=0.0))  # fmt: skip
        if RAW:
            kt = kt.to(tl.int8, bitcast=True).to(dt)
            v = v.to(tl.int8, bitcast=True).to(dt)
        else:
            kt = kt.to(dt)
            v = v.to(dt)
        scores = tl.dot(q, kt) * scale
        pos = c * (NB * BS) + t
        scores = tl.where((pos < ctx)[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dt), v)
        m_i = m_new
    acc = acc * tl.load(ks_ptr + 1)
    r = (s * (tl.num_programs(1) * G) + heads) * NUM_SPLITS + sp
    tl.store(acc_ptr + r[:, None] * D + d[None, :], acc, mask=(g < G)[:, None])
    tl.store(ml_ptr + r * 2, m_i, mask=g < G)
    tl.store(ml_ptr + r * 2 + 1, l_i, mask=g < G)


def run_variant(q, cache, scales, meta, out, nb, warps, kt, f16, raw, target=528):
    _, _, bs, hk, d = cache.shape
    b, hq = meta.seq_lens.shape[0], q.shape[1]
    splits = triton.next_power_of_2(max(1, target // (b * hk)))
    acc = torch.empty(b * hq * splits, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(b * hq * splits, 2, dtype=torch.float32, device=q.device)
    bt = meta.block_tables
    _partial_v[(b, hk, splits)](
        q, cache, bt, meta.seq_lens, acc, ml, scales, q.stride(0), q.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), bt.stride(0),
        d**-0.5, G=hq // hk, G_PAD=max(16, triton.next_power_of_2(hq // hk)), D=d, BS=bs,
        NB=nb, NUM_SPLITS=splits, KT=kt, F16=f16, RAW=raw, num_warps=warps,
    )  # fmt: skip
    _decode_reduce[(b, hq)](acc, ml, meta.query_start_loc[:-1], out, out.stride(0),
                            out.stride(1), hq, D=d, NUM_SPLITS=splits,
                            SPLITS_PAD=triton.next_power_of_2(splits))  # fmt: skip


def main() -> None:
    torch.manual_seed(0)
    hq, hk, d, bs = 32, 8, 128, 32
    rows = []
    variants = {f"{'kt' if kt else 'tr'}_{'f16' if f16 else 'bf16'}{'_raw' if raw else ''}":
                (kt, f16, raw) for kt in (False, True) for f16 in (True, False)
                for raw in (False, True) if not (raw and not f16)}  # fmt: skip
    for ctx, batch in ((1024, 256), (1536, 880), (8192, 64)):
        q, cache, meta = _paged(batch, ctx, 1, hq, hk, d, bs, torch.bfloat16)
        scales = torch.tensor([0.05, 0.05], device="cuda")
        fp8 = (cache.float() / 0.05).to(torch.float8_e4m3fn)
        del cache
        deq = fp8.float() * 0.05
        ref = paged_attention_ref(q.float(), deq, meta, d**-0.5)
        del deq
        nbytes = batch * ctx * 2 * hk * d
        out = torch.empty_like(q)
        row = {"context": ctx, "batch": batch}
        for nb, warps in ((1, 4), (2, 4), (4, 4), (4, 8)):
            eng = functools.partial(
                decode_attention_triton, q, fp8, meta.block_tables, meta.seq_lens,
                meta.query_start_loc[:-1], out, d**-0.5, ctx, num_warps=warps, kv_scale=scales,
                blocks_per_step=nb,
            )  # fmt: skip
            ms = median_cuda_ms(eng)
            row[f"engine_nb{nb}_w{warps}"] = {"ms": ms, "tb_s": nbytes / ms / 1e9}
            for name, (kt, f16, raw) in variants.items():
                fn = functools.partial(run_variant, q, fp8, scales, meta, out, nb, warps, kt,
                                       f16, raw)  # fmt: skip
                try:
                    fn()
                    err = (out.float() - ref).abs().max().item()
                    if not raw and not err < 5e-2 * max(1.0, ref.abs().max().item()):
                        print(ctx, batch, name, nb, warps, "WRONG", err, flush=True)
                        continue
                    ms = median_cuda_ms(fn)
                except Exception as e:  # a variant that fails to compile is a result
                    row[f"{name}_nb{nb}_w{warps}"] = {"error": f"{type(e).__name__}: {e}"[:200]}
                    continue
                row[f"{name}_nb{nb}_w{warps}"] = {"ms": ms, "tb_s": nbytes / ms / 1e9}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del fp8
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
