"""Weight-only quantized matmuls, W4A16 (grouped asymmetric int4) and W8A16 (per-channel
int8): ``y = (x / smooth) @ dequant(w).T (+ bias)``, with the weight dequantized in
registers. Triton kernel, its launcher, a dequantizing kernel for large inputs, the
reference and the dispatcher ``QuantLinear`` calls on CUDA. Weight layouts: see
``kiln.quant.formats`` (int4: (N, K/2) uint8, element 2j in the low nibble; scale and
zero (N, K/G)).

The kernel streams the quantized weight once per BLOCK_M rows of x, so it is built for
decode (a few rows, bound by reading the weight):

- grid (N / BLOCK_N, SPLIT_K, M / BLOCK_M); rows of the last column block past N read row
  N - 1 (never stored); split-K partials are reduced in a fixed order (deterministic), by
  ``kiln.kernels.gemv``'s reduction kernel;
- int4: a (BLOCK_N, BLOCK_K / 2) tile of bytes gives the even-k codes (low nibbles) and the
  odd-k codes (high nibbles), turned into the 16-bit floats ``B + q`` (bfloat16: B = 128,
  the bits ``0x4300 | q``; float16: 1024) by packed PTX, two codes per register and about
  one integer instruction per code (``_codes_biased``; the earlier per-code int16
  arithmetic and bfloat16 subtraction made this kernel 1.3-2x slower at 16 rows). Each
  half is multiplied on tensor cores
  with the matching columns of x; the zero point is applied after the dot as
  ``(B + zero) * sum(x)`` over the tile. BLOCK_K divides the group size, so a tile lies in
  one group and its scale is applied to the tile's float32 result;
- int8: int8 codes (exact in x's dtype) times x on tensor cores; the row scale is applied
  once at the end;
- smoothing factors (AWQ) scale x as it is loaded (times ``1 / s``, rounded to x's
  dtype; the reference divides, so the two may differ by an ulp of x).

For one to four rows the tuner may pick the forms without tensor cores in
``kiln.kernels.wq_fma`` instead (``FMA`` configurations): int8 and int4 broadcast-multiply,
and, for int4 (``WORDS``, the default at one row), codes read as 32-bit words, one shift
per two codes and one ``lop3`` and one FMA per code, on the GPU in its Gluon form
(``GLUON``, ``kiln.kernels.wq_gluon``) where the configuration asks for it.

For many rows (prefill) the kernel's single pass over the weight per BLOCK_M rows does not
pay; there the dispatcher dequantizes the weight to x's dtype once (one Triton pass) and
calls cuBLAS. ``WQ_MAX_M`` is the switch point. Both paths lose to bf16 cuBLAS beyond
about 16-32 rows (measured): weight-only quantization pays at small decode batches and in
memory."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.kernels._triton import INTERPRET, use_triton
from kiln.kernels.gemv import _num_sms, _store_result, split_k_reduce
from kiln.kernels.partials import SplitPartials
from kiln.kernels.wq_config import (  # noqa: F401 (re-exported: callers use wq_gemm's names)
    MMA_CHUNK,
    MMA_MAX_M,
    _group_tile,
    mma_config,
    mma_eligible,
    mma_rows,
    split_k_plan,
    wq_config,
    wq_default_config,
    wq_shape_key,
)
from kiln.kernels.wq_fma import (
    _program_tiles,
    _wq4_fma_kernel,
    _wq_fma_kernel,
    launch_words,
    words_ok,
)

WQ_FMA_MAX_M = 4
"""The kernels without tensor cores are tuning candidates up to this many rows: the
broadcast-multiply kernels (int8: rows in one block; int4: one row per program, from two
rows on), and for int4 at one row the word kernels (``kiln.bench.quant_bench``)."""
WQ_MAX_M = {"int4": 96, "int8": 64}
"""Inputs of at most this many rows use the fused kernel, more dequantize then cuBLAS: the
crossover of the two on an H200 at Llama-3.1-8B's projections (int8: benchmarks/results/
2026-11-30-h200-quant-kernels-55a943c.json; int4, the tensor-core kernel's token tiles:
…-int4-many-rows-485e497.json, a layer's four projections 0.239 / 0.373 / 0.445 ms at
64 / 96 / 128 rows against 0.355 / 0.362 / 0.367 dequantized)."""


def wq_linear_ref(
    x: torch.Tensor,  # (M, K)
    w: torch.Tensor,  # int4: (N, K/2) uint8; int8: (N, K)
    scale: torch.Tensor,  # int4: (N, K/G); int8: (N,)
    zero: torch.Tensor | None = None,  # int4: (N, K/G) uint8
    smooth: torch.Tensor | None = None,  # (K,)
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 reference: x / smooth rounded to x's dtype, the weight dequantized in float32,
    a float32 matmul, the result rounded once to x's dtype."""
    from kiln.quant import formats as qf

    if smooth is not None:
        x = (x.float() / smooth.float()).to(x.dtype)
    if zero is not None:
        wd = qf.dequantize_int4(qf.unpack_int4(w), scale, zero)
    else:
        wd = qf.dequantize_rows(w, scale)
    y = F.linear(x.float(), wd)
    return (y if bias is None else y + bias.float()).to(x.dtype)


_CODES_PTX = """{
        .reg .b32 t0, t1, zz;
        mov.b32 zz, 0;
        prmt.b32 t0, $4, zz, 0x4140;
        prmt.b32 t1, $4, zz, 0x4342;
        lop3.b32 $0, t0, 0x000F000F, MAGIC, 0xEA;
        lop3.b32 $1, t1, 0x000F000F, MAGIC, 0xEA;
        shr.u32 t0, t0, 4;
        shr.u32 t1, t1, 4;
        lop3.b32 $2, t0, 0x000F000F, MAGIC, 0xEA;
        lop3.b32 $3, t1, 0x000F000F, MAGIC, 0xEA;
        }"""
_CODES_BF16 = tl.constexpr(_CODES_PTX.replace("MAGIC", "0x43004300"))
_CODES_F16 = tl.constexpr(_CODES_PTX.replace("MAGIC", "0x64006400"))


@triton.jit
def _codes_biased(p, F16: tl.constexpr):
    """uint8 bytes of two codes -> (low, high) codes as B + q in x's 16-bit dtype
    (bfloat16: B = 128, bits 0x4300 | q; float16: B = 1024, bits 0x6400 | q), exact, two
    per 32-bit register, four bytes per call: ``prmt`` spreads bytes 0, 1 (2, 3) into the
    halves of a register, ``lop3`` keeps a nibble per half and sets the exponent bits; the
    high nibbles the same after a shift by 4. About one integer instruction per code,
    where per-code int16 arithmetic and a bfloat16 subtraction took several."""
    if F16:
        return tl.inline_asm_elementwise(_CODES_F16, "=r,=r,=r,=r,r", [p],
                                         dtype=(tl.float16, tl.float16), is_pure=True,
                                         pack=4)  # fmt: skip
    else:
        return tl.inline_asm_elementwise(_CODES_BF16, "=r,=r,=r,=r,r", [p],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                         pack=4)  # fmt: skip


@triton.jit
def _wq_kernel(x_ptr, w_ptr, s_ptr, z_ptr, sm_ptr, b_ptr, out_ptr, part_ptr,
               M, N, K, stride_xm, stride_wn, stride_sn, stride_om, k_per_split,
               K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, INT4: tl.constexpr,
               GROUP: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_BIAS: tl.constexpr,
               EVEN_K: tl.constexpr, UPCAST: tl.constexpr, F16: tl.constexpr,
               PRECISION: tl.constexpr):  # fmt: skip
    pid_k, offs_n, offs_m, m_ok, rows, k_lo, w_row = _program_tiles(
        w_ptr, M, N, stride_wn, k_per_split, BLOCK_M, BLOCK_N
    )
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # see kiln.kernels.gemv: a run-time loop bound when compiled, a constant interpreted
    for k in range(0, K_PER_SPLIT if K_PER_SPLIT > 0 else k_per_split, BLOCK_K):
        k0 = k_lo + k
        if INT4:
            HB: tl.constexpr = BLOCK_K // 2
            oh = tl.arange(0, HB)
            ke = k0 + 2 * oh  # the even columns of this tile
            k_ok = ke < K
            if EVEN_K:  # no masks along K: vector loads (masked: 1.3-1.55x slower at 16 rows)
                p = tl.load(w_row + (k0 // 2 + oh)[None, :], eviction_policy="evict_first")
                xm = m_ok[:, None]
            else:
                p = tl.load(w_row + (k0 // 2 + oh)[None, :], mask=k_ok[None, :], other=0,
                            eviction_policy="evict_first")  # fmt: skip
                xm = m_ok[:, None] & k_ok[None, :]
            xe = tl.load(x_ptr + offs_m[:, None] * stride_xm + ke[None, :], mask=xm, other=0.0)
            xo = tl.load(x_ptr + offs_m[:, None] * stride_xm + ke[None, :] + 1, mask=xm,
                         other=0.0)  # fmt: skip
            if HAS_SMOOTH:  # x * (1 / s): one division per column, shared by the rows
                se = tl.load(sm_ptr + ke, mask=k_ok, other=1.0)
                so = tl.load(sm_ptr + ke + 1, mask=k_ok, other=1.0)
                xe = (xe.to(tl.float32) * (1.0 / se)[None, :]).to(dt)
                xo = (xo.to(tl.float32) * (1.0 / so)[None, :]).to(dt)
            g = k0 // GROUP  # past K (the last split's tail) the tile is all zeros
            sc = tl.load(s_ptr + rows * stride_sn + g, mask=k0 < K, other=0.0).to(tl.float32)
            zp = tl.load(z_ptr + rows * stride_sn + g, mask=k0 < K, other=0)
            if UPCAST:  # float32 inputs, and the interpreter (no inline PTX): conversions
                zf = zp.to(tl.float32)[:, None]
                a_lo = (p & 0xF).to(tl.float32) - zf
                a_hi = (p >> 4).to(tl.float32) - zf
                t = tl.dot(a_lo, tl.trans(xe.to(tl.float32)), input_precision=PRECISION)
                t = tl.dot(a_hi, tl.trans(xo.to(tl.float32)), t, input_precision=PRECISION)
                acc += sc[:, None] * t
            else:  # biased codes B + q in x's dtype by packed PTX; B + zero after the dot
                if F16:
                    a_lo, a_hi = _codes_biased(p, True)
                    zb = zp.to(tl.float32) + 1024.0
                else:
                    a_lo, a_hi = _codes_biased(p, False)
                    zb = zp.to(tl.float32) + 128.0
                t = tl.dot(a_lo, tl.trans(xe), input_precision=PRECISION)
                t = tl.dot(a_hi, tl.trans(xo), t, input_precision=PRECISION)
                xs = tl.sum(xe.to(tl.float32), axis=1) + tl.sum(xo.to(tl.float32), axis=1)
                acc += sc[:, None] * (t - zb[:, None] * xs[None, :])
        else:
            kk = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                wq = tl.load(w_row + kk[None, :], eviction_policy="evict_first")
                xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                             mask=m_ok[:, None], other=0.0)  # fmt: skip
            else:
                k_ok = kk < K
                wq = tl.load(w_row + kk[None, :], mask=k_ok[None, :], other=0,
                             eviction_policy="evict_first")  # fmt: skip
                xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                             mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
            if UPCAST:
                acc = tl.dot(wq.to(tl.float32), tl.trans(xt.to(tl.float32)), acc,
                             input_precision=PRECISION)  # fmt: skip
            else:
                acc = tl.dot(wq.to(dt), tl.trans(xt), acc, input_precision=PRECISION)
    if not INT4:
        acc *= tl.load(s_ptr + rows)[:, None]
    _store_result(acc, offs_n, offs_m, b_ptr, out_ptr, part_ptr, pid_k, M, N, stride_om,
                  SPLIT_K, HAS_BIAS)  # fmt: skip


@triton.jit
def _int4_biased(p, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(BLOCK_N, BLOCK_K / 2) int32 bytes of packed codes -> (BLOCK_N, BLOCK_K) float32
    2**23 + q in K order (k = 2j from the low nibble, 2j + 1 the high one), without
    int -> float conversions: the bits 0x4B000000 | q are that float."""
    lo = ((p & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    hi = ((p >> 4) | 0x4B000000).to(tl.float32, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))


def wq_linear_triton(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None = None,
    smooth: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: dict | None = None,
    smooth_inv: torch.Tensor | None = None,
    partials: bool = False,
) -> torch.Tensor | SplitPartials:
    """Same contract as ``wq_linear_ref``; (M, N) in x's dtype. int4 when ``zero`` is given.
    ``smooth_inv``: ``1 / smooth`` where the caller keeps it (else computed here).
    ``partials``: a launch split along K without bias returns its float32 partials
    (``kiln.kernels.partials``) in place of adding them."""
    m, k = x.shape
    int4 = zero is not None
    n = w.shape[0]
    group = k // scale.shape[1] if int4 else None
    assert x.stride(1) == 1 and w.is_contiguous() and w.shape[1] == (k // 2 if int4 else k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    sms = _num_sms(x.device.index if x.is_cuda else None)
    cfg = config or wq_config(n, k, m, group, sms)
    if cfg.get("MMA"):  # the tensor-core few-row kernel where it can take the call
        from kiln.kernels import wq_mma

        if int4 and not INTERPRET and wq_mma.ENABLED and wq_mma.mma_ok(x, k, group, smooth):
            return wq_mma.wq4_mma(x, w, scale_arg(scale), zero, bias, r=cfg["R"],
                                  num_warps=cfg["num_warps"], split=cfg["SPLIT_K"],
                                  ch=cfg["CH"], pf=cfg["PF"], out=out,
                                  partials=partials, nt=cfg.get("NT"),
                                  zs=bool(cfg.get("ZS")))  # fmt: skip
        cfg = wq_default_config(n, k, m, group, sms, mma=False)
    block_k = cfg["BLOCK_K"]
    fma = bool(cfg.get("FMA"))
    if int4 and group % block_k and not (fma and block_k % group == 0):
        raise ValueError(
            f"BLOCK_K {block_k} must divide the int4 group size {group}"
            + (" or be a multiple of it" if fma else "")
        )
    block_m = max(16, min(64, triton.next_power_of_2(m)))
    k_per_split, split = split_k_plan(k, block_k, cfg["SPLIT_K"])
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    b = bias if bias is not None else out
    sc = scale_arg(scale)
    sm = smooth if smooth is not None else sc
    common = (x, w, sc, zero if int4 else sc, sm, b, out, part, m, n, k, x.stride(0),
              w.stride(0), sc.stride(0), out.stride(0), k_per_split)  # fmt: skip
    if fma:
        if smooth is not None:  # the broadcast kernels multiply by the reciprocals
            inv = smooth_inv if smooth_inv is not None else 1.0 / smooth.float()
            common = (*common[:4], inv, *common[5:])
        kw = dict(K_PER_SPLIT=k_per_split if INTERPRET else 0, BLOCK_N=cfg["BLOCK_N"],
                  BLOCK_K=block_k, SPLIT_K=split, HAS_SMOOTH=smooth is not None,
                  HAS_BIAS=bias is not None, num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])  # fmt: skip
        if int4:
            even = k_per_split * split == k
            grid = (m, triton.cdiv(n, cfg["BLOCK_N"]), split)
            gs = min(block_k, group)
            if cfg.get("WORDS") and words_ok(x, k, gs, even, smooth):
                kw.pop("HAS_SMOOTH")
                launch_words(grid, x, w, common, cfg, split, GROUP=group, GS=gs, **kw)
            else:
                _wq4_fma_kernel[grid](*common, GROUP=group, GS=gs, EVEN_K=even, **kw)
        else:
            block_m = triton.next_power_of_2(min(m, WQ_FMA_MAX_M))
            grid = (triton.cdiv(n, cfg["BLOCK_N"]), split, triton.cdiv(m, block_m))
            _wq_fma_kernel[grid](*common, BLOCK_M=block_m, **kw)
    else:
        upcast = INTERPRET or x.dtype == torch.float32  # bfloat16 / float16 on the GPU only
        _wq_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), split, triton.cdiv(m, block_m))](
            *common, K_PER_SPLIT=k_per_split if INTERPRET else 0, BLOCK_M=block_m,
            BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, SPLIT_K=split, INT4=int4,
            GROUP=group or 1, HAS_SMOOTH=smooth is not None, HAS_BIAS=bias is not None,
            EVEN_K=k_per_split * split == k, UPCAST=upcast, F16=x.dtype == torch.float16,
            PRECISION="ieee" if upcast else "tf32",
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )  # fmt: skip
    if split > 1:
        if partials and bias is None:
            return SplitPartials(part, x.dtype)
        split_k_reduce(part, out, bias)
    return out


def scale_arg(scale: torch.Tensor) -> torch.Tensor:
    """Weight scales as the kernels take them, contiguous: float32, or float16 for int4
    (the loader's compact scales, ``kiln.quant.passes.compact_int4_scales``)."""
    return (scale if scale.dtype in (torch.float32, torch.float16) else scale.float()).contiguous()


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_wn, stride_sn,
                    INT4: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, TILED: tl.constexpr = False):  # fmt: skip
    """A (BLOCK_N, BLOCK_K) tile of the dequantized weight; int4 tiles lie in one group
    (BLOCK_K divides it) and are read as BLOCK_K / 2 contiguous bytes per row, or with
    ``TILED`` from ``wq_f16.tile_words``' order (per 16-row tile and 128-code chunk, 16
    rows of 64 bytes)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rk = k0 + tl.arange(0, BLOCK_K)
    n_ok = rn < N
    mask = n_ok[:, None] & (rk < K)[None, :]
    if INT4:
        oh = tl.arange(0, BLOCK_K // 2)
        if TILED:
            j = k0 // 2 + oh  # the byte of a row-major row
            col = (j // 64) * 1024 + j % 64  # its chunk's 1 KB, then the byte in the row's 64
            off = (rn // 16).to(tl.int64)[:, None] * (K * 8) + ((rn % 16) * 64)[:, None]
            off += col[None, :]
        else:
            off = rn.to(tl.int64)[:, None] * stride_wn + (k0 // 2 + oh)[None, :]
        p = tl.load(w_ptr + off, mask=n_ok[:, None] & (k0 + 2 * oh < K)[None, :],
                    other=0).to(tl.int32)  # fmt: skip
        sc = tl.load(s_ptr + rn * stride_sn + k0 // GROUP, mask=n_ok, other=0.0).to(tl.float32)
        zp = tl.load(z_ptr + rn * stride_sn + k0 // GROUP, mask=n_ok, other=0).to(tl.float32)
        v = (_int4_biased(p, BLOCK_N, BLOCK_K) - (zp + 8388608.0)[:, None]) * sc[:, None]
    else:
        q = tl.load(w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :], mask=mask, other=0)
        v = q.to(tl.float32) * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[:, None]
    tl.store(out_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :],
             v.to(out_ptr.dtype.element_ty), mask=mask)  # fmt: skip


def dequantize_triton(
    w: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    k: int,
    dtype: torch.dtype,
    tiled: bool = False,
) -> torch.Tensor:
    """The (N, K) weight in ``dtype``: float32 dequantization rounded once. ``tiled``: int4
    words in ``wq_f16.tile_words``' order."""
    n = w.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=w.device)
    sc = scale_arg(scale)
    int4 = zero is not None
    group = k // sc.shape[1] if int4 else 1
    block_k = _group_tile(group) if int4 else 128
    grid = (triton.cdiv(n, 32), triton.cdiv(k, block_k))
    _dequant_kernel[grid](w, sc, zero if int4 else sc, out, n, k, w.stride(0), sc.stride(0),
                          INT4=int4, GROUP=group, BLOCK_N=32, BLOCK_K=block_k,
                          **({"TILED": True} if tiled else {}))  # fmt: skip
    return out


def wq_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None = None,
    smooth: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    smooth_inv: torch.Tensor | None = None,
    partials: bool = False,
) -> torch.Tensor | SplitPartials:
    """The dispatcher: on CUDA, the fused kernel for up to ``WQ_MAX_M[mode]`` rows, else the
    weight dequantized once and cuBLAS; on the CPU, the reference. ``partials``: the fused
    kernel of a 2-D x may return split-K partials (``kiln.kernels.partials``)."""
    if not use_triton(x) or x.dtype not in (torch.bfloat16, torch.float16):
        return wq_linear_ref(x, w, scale, zero, smooth, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] <= WQ_MAX_M["int4" if zero is not None else "int8"]:
        y = wq_linear_triton(
            x2,
            w,
            scale,
            zero,
            smooth,
            bias,
            smooth_inv=smooth_inv,
            partials=partials and x.dim() == 2,
        )
        if isinstance(y, SplitPartials):
            return y
    else:
        if smooth is not None:
            x2 = (x2.float() / smooth).to(x.dtype)
        wd = dequantize_triton(w, scale, zero, x2.shape[1], x.dtype)
        y = F.linear(x2, wd, bias)
    return y.view(*x.shape[:-1], y.shape[-1])
