"""Experiment (H200), after ``fp8kv_decode_variants.py`` found that neither the K layout nor
the conversion dtype moves decode attention over an fp8 cache past ~2.5 TB/s (bfloat16
caches reach 3.3-4.1). What does, if anything? Variants of ``_decode_partial`` (runtime
splits, no window), each timed over the same fp8 cache as the engine kernel:

- ``cvt``: the engine's arithmetic (fp8 -> float16 by ``cvt``), loop as ``range``;
- ``cvt_s{S}``: the same loop as ``tl.range(num_stages=S)`` (loads pipelined explicitly);
- ``noconv``: the cache's bytes read as float16 pairs (a (NB*BS, D/2) tile; wrong numbers):
  the same bytes and access pattern with no conversion at all, an upper bound;
- ``asm``: fp8 -> float16 by integer bit moves (``prmt``/shift/mask on four bytes at a
  time, inline PTX), whose results are 2^-8 times the values; the factor joins the scales;
- ``qk8``: the QK dot in fp8 (q quantized per program to e4m3), PV as ``cvt``;
- ``all8``: both dots in fp8 (p scaled by 448 and rounded to e4m3 as well);
- ``words_s{S}``: the cache read as int32 words, each turned into four float16 values by
  bit moves (as ``asm``), each dot split into four over D / 4 (dimensions 4 w + j), so that
  no byte-wise shared-memory read stands between the load and the dots.

Compiled for sm_90 (with the 16-divisibility the launcher gives the strides), ``cvt`` reads
the fp8 tile from shared memory one byte at a time (128 ``ld.shared.b8`` per thread per
step at NB = 4): Triton moves the conversion past the layout change into the dot operand.

Every variant but ``noconv`` reports its max error against ``paged_attention_ref``.
Usage (GPU): ``PYTHONPATH=. python scripts/experiments/fp8kv_decode_variants2.py OUT.json``."""

import functools
import json
import sys

import torch
import triton
import triton.language as tl

from kiln.bench.kernels import _paged, median_cuda_ms
from kiln.kernels.attention import paged_attention_ref
from kiln.kernels.decode_attention import _decode_reduce, decode_attention_triton


def _bit_moves(src: str) -> str:
    """PTX: the four e4m3 bytes of register ``src`` as 2^-8-scaled float16 pairs in t0
    (bytes 0, 1) and t1 (bytes 2, 3)."""
    return f"""{{
.reg .b32 t<4>;
prmt.b32 t0, {src}, 0, 0x1404;
prmt.b32 t1, {src}, 0, 0x3424;
shr.b32 t2, t0, 1;
shr.b32 t3, t1, 1;
and.b32 t2, t2, 0x3F803F80;
and.b32 t3, t3, 0x3F803F80;
and.b32 t0, t0, 0x80008000;
and.b32 t1, t1, 0x80008000;
or.b32 t0, t0, t2;
or.b32 t1, t1, t3;
"""


_ASM = tl.constexpr(_bit_moves("$2") + "mov.b32 $0, t0;\nmov.b32 $1, t1;\n}")


@triton.jit
def _to_f16(x, MODE: tl.constexpr):
    if MODE == 2:  # 2^-8 x: e4m3 bits moved into float16's (sign, exponent, mantissa)
        return tl.inline_asm_elementwise(_ASM, "=r,=r,r", [x.to(tl.uint8, bitcast=True)],
                                         dtype=tl.float16, is_pure=True, pack=4)  # fmt: skip
    return x.to(tl.float16)


@triton.jit
def _step(q, kv_ptr, bt_row, c, n_blocks, ctx, h, m_i, l_i, acc, stride_kind, stride_kb,
          stride_kt, stride_kh, scale, D: tl.constexpr, BS: tl.constexpr, NB: tl.constexpr,
          MODE: tl.constexpr):  # fmt: skip
    d = tl.arange(0, D)
    t = tl.arange(0, NB * BS)
    b = c * NB + t // BS
    active = b < n_blocks
    blk = tl.load(bt_row + b, mask=active, other=0).to(tl.int64)
    offs = blk[:, None] * stride_kb + (t % BS)[:, None] * stride_kt + h * stride_kh + d[None, :]
    k = tl.load(kv_ptr + offs, mask=active[:, None], other=0.0)
    v = tl.load(kv_ptr + stride_kind + offs, mask=active[:, None], other=0.0)
    if MODE == 3 or MODE == 4 or MODE == 1:
        scores = tl.dot(q, tl.trans(k)) * scale
    else:
        scores = tl.dot(q, tl.trans(_to_f16(k, MODE))) * scale
    pos = c * (NB * BS) + t
    scores = tl.where((pos < ctx)[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MODE == 4:
        pv = tl.dot((p * 448.0).to(tl.float8e4nv), v) * (1.0 / 448.0)
    elif MODE == 1:
        pv = tl.dot(p.to(tl.float16), v)
    else:
        pv = tl.dot(p.to(tl.float16), _to_f16(v, MODE))
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _partial2(q_ptr, kv_ptr, bt_ptr, lens_ptr, acc_ptr, ml_ptr, ks_ptr, stride_qt, stride_qh,
              stride_kind, stride_kb, stride_kt, stride_kh, stride_bt, scale,
              G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
              NB: tl.constexpr, NUM_SPLITS: tl.constexpr, MODE: tl.constexpr,
              STAGES: tl.constexpr):  # fmt: skip
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
        scale = scale * 256.0
        vs = vs * 256.0
    if MODE == 3 or MODE == 4:
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
    n = tl.minimum(per_split, n_chunks - c_lo)
    if STAGES > 0:
        for i in tl.range(0, n, num_stages=STAGES):
            m_i, l_i, acc = _step(q, kv_ptr, bt_row, c_lo + i, n_blocks, ctx, h, m_i, l_i, acc,
                                  stride_kind, stride_kb, stride_kt, stride_kh, scale, D, BS,
                                  NB, MODE)  # fmt: skip
    else:
        for i in range(0, n):
            m_i, l_i, acc = _step(q, kv_ptr, bt_row, c_lo + i, n_blocks, ctx, h, m_i, l_i, acc,
                                  stride_kind, stride_kb, stride_kt, stride_kh, scale, D, BS,
                                  NB, MODE)  # fmt: skip
    acc = acc * vs
    r = (s * (tl.num_programs(1) * G) + heads) * NUM_SPLITS + sp
    tl.store(acc_ptr + r[:, None] * D + d[None, :], acc, mask=(g < G)[:, None])
    tl.store(ml_ptr + r * 2, m_i, mask=g < G)
    tl.store(ml_ptr + r * 2 + 1, l_i, mask=g < G)


_ASM4 = tl.constexpr(_bit_moves("$4") + "mov.b32 {$0, $1}, t0;\nmov.b32 {$2, $3}, t1;\n}")


@triton.jit
def _words(x):
    """int32 words of four e4m3 bytes -> four float16 tiles, 2^-8 times byte j's value."""
    return tl.inline_asm_elementwise(_ASM4, "=h,=h,=h,=h,r", [x], dtype=(tl.float16,) * 4,
                                     is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _partial_words(q_ptr, kv_ptr, bt_ptr, lens_ptr, acc_ptr, ml_ptr, ks_ptr, stride_qt,
                   stride_qh, stride_kind, stride_kb, stride_kt, stride_kh, stride_bt, scale,
                   G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                   NB: tl.constexpr, NUM_SPLITS: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """The cache read as int32 words (``kv_ptr`` an int32 view, strides in words): column
    j of word w is dimension 4 w + j, so each dot is four dots over D / 4, with q's and the
    output's dimensions taken with stride 4."""
    s, h, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(lens_ptr + s)
    n_blocks = (ctx + BS - 1) // BS
    g = tl.arange(0, G_PAD)
    w = tl.arange(0, D // 4)
    heads = h * G + g
    qrow = q_ptr + s * stride_qt + heads[:, None] * stride_qh + 4 * w[None, :]
    qm = (g < G)[:, None]
    q0 = tl.clamp(tl.load(qrow, mask=qm, other=0.0).to(tl.float32), -65504.0, 65504.0)
    q1 = tl.clamp(tl.load(qrow + 1, mask=qm, other=0.0).to(tl.float32), -65504.0, 65504.0)
    q2 = tl.clamp(tl.load(qrow + 2, mask=qm, other=0.0).to(tl.float32), -65504.0, 65504.0)
    q3 = tl.clamp(tl.load(qrow + 3, mask=qm, other=0.0).to(tl.float32), -65504.0, 65504.0)
    q0, q1, q2, q3 = q0.to(tl.float16), q1.to(tl.float16), q2.to(tl.float16), q3.to(tl.float16)
    scale = scale * tl.load(ks_ptr) * 256.0
    m_i = tl.full([G_PAD], -1e30, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    a0 = tl.zeros([G_PAD, D // 4], tl.float32)
    a1 = tl.zeros([G_PAD, D // 4], tl.float32)
    a2 = tl.zeros([G_PAD, D // 4], tl.float32)
    a3 = tl.zeros([G_PAD, D // 4], tl.float32)
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
        offs = offs + w[None, :]
        k0, k1, k2, k3 = _words(tl.load(kv_ptr + offs, mask=active[:, None], other=0))
        scores = tl.dot(q0, tl.trans(k0))
        scores = tl.dot(q1, tl.trans(k1), scores)
        scores = tl.dot(q2, tl.trans(k2), scores)
        scores = tl.dot(q3, tl.trans(k3), scores) * scale
        pos = c * (NB * BS) + t
        scores = tl.where((pos < ctx)[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(tl.float16)
        v0, v1, v2, v3 = _words(tl.load(kv_ptr + stride_kind + offs, mask=active[:, None],
                                        other=0))  # fmt: skip
        a0 = tl.dot(p, v0, a0 * alpha[:, None])
        a1 = tl.dot(p, v1, a1 * alpha[:, None])
        a2 = tl.dot(p, v2, a2 * alpha[:, None])
        a3 = tl.dot(p, v3, a3 * alpha[:, None])
        m_i = m_new
    vs = tl.load(ks_ptr + 1) * 256.0
    r = (s * (tl.num_programs(1) * G) + heads) * NUM_SPLITS + sp
    out = acc_ptr + r[:, None] * D + 4 * w[None, :]
    tl.store(out, a0 * vs, mask=qm)
    tl.store(out + 1, a1 * vs, mask=qm)
    tl.store(out + 2, a2 * vs, mask=qm)
    tl.store(out + 3, a3 * vs, mask=qm)
    tl.store(ml_ptr + r * 2, m_i, mask=g < G)
    tl.store(ml_ptr + r * 2 + 1, l_i, mask=g < G)


def run_variant(q, cache, scales, meta, out, nb, mode, stages, target=264):
    if mode == 5:
        cache = cache.view(torch.int32)
    _, _, bs, hk, d = cache.shape
    b, hq = meta.seq_lens.shape[0], q.shape[1]
    splits = triton.next_power_of_2(max(1, target // (b * hk)))
    acc = torch.empty(b * hq * splits, q.shape[2], dtype=torch.float32, device=q.device)
    ml = torch.empty(b * hq * splits, 2, dtype=torch.float32, device=q.device)
    bt = meta.block_tables
    args = (q, cache, bt, meta.seq_lens, acc, ml, scales, q.stride(0), q.stride(1),
            cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), bt.stride(0),
            q.shape[2] ** -0.5)  # fmt: skip
    g, g_pad = hq // hk, max(16, triton.next_power_of_2(hq // hk))
    if mode == 5:
        _partial_words[(b, hk, splits)](*args, G=g, G_PAD=g_pad, D=q.shape[2], BS=bs, NB=nb,
                                        NUM_SPLITS=splits, STAGES=stages, num_warps=4)  # fmt: skip
    else:
        _partial2[(b, hk, splits)](*args, G=g, G_PAD=g_pad, D=d, BS=bs, NB=nb,
                                   NUM_SPLITS=splits, MODE=mode, STAGES=stages,
                                   num_warps=4)  # fmt: skip
    _decode_reduce[(b, hq)](acc, ml, meta.query_start_loc[:-1], out, out.stride(0),
                            out.stride(1), hq, D=q.shape[2], NUM_SPLITS=splits,
                            SPLITS_PAD=triton.next_power_of_2(splits))  # fmt: skip


# name: (mode, stages); mode 0 cvt, 1 noconv, 2 asm, 3 qk8, 4 all8, 5 words
VARIANTS = {"cvt": (0, 0), "cvt_s2": (0, 2), "noconv": (1, 0), "words_s1": (5, 1),
            "words_s2": (5, 2), "words_s3": (5, 3)}  # fmt: skip
if len(sys.argv) > 2 and sys.argv[2] == "all":
    VARIANTS.update({"cvt_s3": (0, 3), "asm": (2, 0), "asm_s3": (2, 3), "qk8": (3, 0),
                     "all8": (4, 0)})  # fmt: skip


def main() -> None:
    torch.manual_seed(0)
    hq, hk, d, bs = 32, 8, 128, 32
    rows = []
    for ctx, batch in ((1536, 880), (1024, 256), (8192, 64)):
        q, cache, meta = _paged(batch, ctx, 1, hq, hk, d, bs, torch.bfloat16)
        scales = torch.tensor([0.05, 0.05], device="cuda")
        fp8 = (cache.float() / 0.05).to(torch.float8_e4m3fn)
        out = torch.empty_like(q)
        bf16_ms = {}
        for nb in (1, 4):
            fn = functools.partial(decode_attention_triton, q, cache, meta.block_tables,
                                   meta.seq_lens, meta.query_start_loc[:-1], out, d**-0.5,
                                   ctx, num_warps=4, blocks_per_step=nb)  # fmt: skip
            bf16_ms[nb] = median_cuda_ms(fn)
        del cache
        deq = fp8.float() * 0.05
        ref = paged_attention_ref(q.float(), deq, meta, d**-0.5)
        del deq
        nbytes = batch * ctx * 2 * hk * d
        row = {"context": ctx, "batch": batch,
               "bf16_engine": {f"nb{k}": {"ms": v, "tb_s": 2 * nbytes / v / 1e9}
                               for k, v in bf16_ms.items()}}  # fmt: skip
        half = fp8.view(torch.float16)
        q_half = q[..., : d // 2].contiguous()
        out_half = torch.empty_like(q_half)
        for nb in (2, 4, 8):
            eng = functools.partial(
                decode_attention_triton, q, fp8, meta.block_tables, meta.seq_lens,
                meta.query_start_loc[:-1], out, d**-0.5, ctx, num_warps=4, kv_scale=scales,
                blocks_per_step=nb,
            )  # fmt: skip
            ms = median_cuda_ms(eng)
            row[f"engine_nb{nb}"] = {"ms": ms, "tb_s": nbytes / ms / 1e9}
            for name, (mode, stages) in VARIANTS.items():
                if mode == 1:
                    fn = functools.partial(run_variant, q_half, half, scales, meta, out_half, nb,
                                           mode, stages)  # fmt: skip
                else:
                    fn = functools.partial(run_variant, q, fp8, scales, meta, out, nb, mode,
                                           stages)  # fmt: skip
                key = f"{name}_nb{nb}"
                out.fill_(float("nan"))
                try:
                    fn()
                    res = {}
                    if mode != 1:
                        res["max_err"] = (out.float() - ref).abs().max().item()
                    res["ms"] = median_cuda_ms(fn)
                    res["tb_s"] = nbytes / res["ms"] / 1e9
                except Exception as e:  # a variant that fails to compile is a result
                    res = {"error": f"{type(e).__name__}: {e}"[-400:]}
                row[key] = res
        print(json.dumps(row), flush=True)
        rows.append(row)
        del fp8, half
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
