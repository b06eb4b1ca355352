"""Quantized number formats: quantize / dequantize, int4 packing, and the matmuls.

Layouts (``w`` is a linear weight of shape (N, K) = (out_features, in_features)):

- FP8 weights: ``float8_e4m3fn`` (N, K), symmetric, one float32 scale per output row,
  ``scale = amax(|w[n]|) / 448``; activations per token (row scale (M, 1)) or per tensor
  (one float32 scale from calibration).
- INT8 weights: ``int8`` (N, K) in [-127, 127], one float32 scale per output row,
  ``scale = amax / 127``; activations for w8a8 per token the same way.
- INT4 weights: asymmetric uint4 in groups of ``G`` along K: ``scale`` and ``zero`` of shape
  (N, K / G) (values on float16's grid, stored in float16, and uint8 in [0, 15]);
  ``w ~ (q - zero) * scale``. Two values per byte: (N, K / 2) uint8, element ``2j`` in
  the low nibble, ``2j + 1`` in the high nibble.

``act_matmul_ref`` is the exact arithmetic of the GPU path (``act_matmul_cuda``) emulated
in float32: dequantize both operands, multiply in float32 (what ``torch._scaled_mm`` /
``torch._int_mm`` compute up to the order of the float32 / int32 accumulation). The
weight-only matmuls (int8-wo, int4) and their reference are in ``kiln.kernels.wq_gemm``;
per-token activation quantization (and its fusion into RMSNorm and SiLU-mul) in
``kiln.kernels.quant_act``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.kernels.fp8_gemv import fp8_skinny_config, fp8_skinny_triton
from kiln.kernels.fp8_mma import fp8_mma_ok
from kiln.kernels.quant_act import QuantAct, quantize_rows
from kiln.kernels.quant_act_ref import expand_groups

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
INT8_MAX = 127.0
INT4_MAX = 15
FP8_BLOCK = 128
"""fp8 "block" weights: one scale per FP8_BLOCK x FP8_BLOCK tile; their activations one per
token and FP8_BLOCK channels (DeepSeek-V3's recipe, ``torch._scaled_mm``'s 1x128 / 128x128
block scales; Hugging Face fp8 checkpoints with ``weight_block_size`` [128, 128])."""
_TINY = 1e-12  # all-zero rows and groups get this scale instead of 0


# ---------------------------------------------------------------- symmetric, per row / token


def _row_scale(t: torch.Tensor, qmax: float) -> torch.Tensor:
    """(R, C) -> (R, 1) float32 amax / qmax of each row."""
    return t.float().abs().amax(dim=-1, keepdim=True).clamp(min=_TINY) / qmax


def quantize_fp8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t / scale`` saturated to +-448 and rounded to e4m3 (``scale`` broadcasts)."""
    return (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> (float8 (N, K), float32 scale (N,))."""
    s = _row_scale(w, FP8_MAX)
    return quantize_fp8(w, s), s.squeeze(1)


def quantize_fp8_block_weight(
    w: torch.Tensor, block: int = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> (float8 (N, K), float32 scale (ceil(N / block), ceil(K / block))): one
    scale per block x block tile, ``amax / 448`` of the tile (edge tiles ragged)."""
    n, k = w.shape
    rb, cb = -(-n // block), -(-k // block)
    a = F.pad(w.float().abs(), (0, cb * block - k, 0, rb * block - n))
    s = a.reshape(rb, block, cb, block).amax(dim=(1, 3)).clamp(min=_TINY) / FP8_MAX
    return quantize_fp8(w, block_scales_full(s, n, k, block)), s


def block_scales_full(scale: torch.Tensor, n: int, k: int, block: int = FP8_BLOCK) -> torch.Tensor:
    """Block scales (ceil(N / block), ceil(K / block)) -> (N, K), each over its tile."""
    full = scale.float().repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)
    return full[:n, :k]


def fp8_static_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """Per-tensor activation scale from a calibrated absolute maximum: float32 ()."""
    return (torch.as_tensor(amax, dtype=torch.float32).clamp(min=_TINY) / FP8_MAX).reshape(())


def _quantize_int8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(t.float() / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def quantize_int8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> (int8 (N, K), float32 scale (N,))."""
    s = _row_scale(w, INT8_MAX)
    return _quantize_int8(w, s), s.squeeze(1)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 / int8 (N, K) with per-row scale (N,) or (N, 1) -> float32 (N, K); an fp8
    weight of ``FP8_BLOCK`` x ``FP8_BLOCK`` tiles takes its (N / 128, K / 128) scales."""
    if (scale.dim() == 2 and scale.shape[1] > 1) or scale.shape[0] != q.shape[0]:
        return q.float() * block_scales_full(scale, *q.shape)
    return q.float() * scale.reshape(-1, 1).float()


# ---------------------------------------------------------------- int4, grouped, asymmetric


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, ...]:
    """(N, K) -> (uint8 q (N, K) in [0, 15] unpacked, float32 scale (N, K/G),
    uint8 zero (N, K/G)). The range of every group includes 0, so zero is exact."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide in_features {k}")
    g = w.float().reshape(n, k // group_size, group_size)
    scale, zero = int4_fit(g)
    q = int4_codes(g, scale[..., None], zero[..., None]).reshape(n, k)
    return q, scale, zero.to(torch.uint8)


def int4_fit(g: torch.Tensor, ratio: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point (float32, ``g``'s shape without its last dimension) of groups
    along the last dimension: the range [min(w, 0), max(w, 0)] shrunk to ``ratio`` times
    itself (1.0: the whole range; less clips the outermost weights), the scale on
    float16's grid (``f16_grid_up``; an all-zero group gets float16's smallest)."""
    lo = g.amin(dim=-1).clamp(max=0.0)
    hi = g.amax(dim=-1).clamp(min=0.0)
    scale = f16_grid_up((hi - lo) * ratio / INT4_MAX)
    zero = torch.round(-lo * ratio / scale).clamp(0, INT4_MAX)
    return scale, zero


F16_TINY = 2.0**-24  # float16's smallest positive (subnormal) value
F16_MAX = 65504.0


def on_f16_grid(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is a float16 value (float16 holds it exactly)."""
    return t.dtype == torch.float16 or torch.equal(t.half().float(), t.float())


def int4_scale_storage(s: torch.Tensor) -> torch.Tensor:
    """int4 group scales as an engine stores them: float16 where every value is on its
    grid (kiln's builds, AWQ and most GPTQ checkpoints), else float32."""
    return s.half() if on_f16_grid(s) else s.float()


def f16_grid_up(s: torch.Tensor) -> torch.Tensor:
    """The smallest float16 value at least ``s`` (float32, within float16's range) as
    float32: int4 scales sit on float16's grid, as AWQ and GPTQ checkpoints store them, so
    engines store them in float16 without changing a product (a step reads 2 bytes a
    group in place of 4). Rounding up keeps each group's range within the 16 codes."""
    c = s.float().clamp(F16_TINY, F16_MAX)
    h = c.half()
    bits = h.view(torch.int16) + (h.float() < c).to(torch.int16)  # the next float16 up
    return bits.view(torch.float16).float()


def int4_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 15] of ``w`` at the given (broadcastable) float scale and zero."""
    return (torch.round(w / scale) + zero).clamp(0, INT4_MAX).to(torch.uint8)


def int4_qdq(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``w`` rounded to int4 at the given scale and zero and dequantized (float32)."""
    return (int4_codes(w, scale, zero).float() - zero) * scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Unpacked uint8 q (N, K), scale / zero (N, K/G) -> float32 (N, K)."""
    n, k = q.shape
    groups = scale.shape[-1]
    g = q.reshape(n, groups, k // groups).float() - zero.float()[..., None]
    return (g * scale.float()[..., None]).reshape(n, k)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 (N, K) of values 0..15, K even -> (N, K/2): even k low nibble, odd k high."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even last dimension, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 -> (N, K) uint8 of values 0..15; the inverse of ``pack_int4``."""
    lo, hi = p & 0x0F, p >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


# ---------------------------------------------------------------- matmuls


def split_fp8_columns(w: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight columns (N, C) float32 on the per-row grid ``scale`` (N,) -> (hi, lo) e4m3:
    ``hi = e4m3(w / scale)`` and ``lo = e4m3(w / scale - hi)``, so ``(hi + lo) * scale``
    holds w to about 2**-8 of itself. The scale must cover the columns (|w| <= 448 scale)."""
    v = (w.float() / scale.float()[:, None]).clamp(-FP8_MAX, FP8_MAX)
    hi = v.to(FP8_DTYPE)
    return hi, (v - hi.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_act(
    x: torch.Tensor,
    input_scale: torch.Tensor | None,
    kind: str,
    smooth: torch.Tensor | None = None,
    outliers: torch.Tensor | None = None,
    search: int = 0,
    group: int | None = None,
) -> QuantAct:
    """The activation side of fp8 / w8a8: per token after optional smoothing
    (``input_scale`` None; Triton on CUDA), with fp8 outlier channels split in two
    (``outliers``), the fp8 scale searched among ``search`` candidates, or one per token
    and ``group`` channels (fp8 "block"); or with a static per-tensor fp8 scale."""
    if input_scale is None:
        return quantize_rows(x, kind, smooth, outliers, search, group)
    s = input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return QuantAct(quantize_fp8(x, input_scale.float()), s)


def act_matmul_ref(
    a: QuantAct,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """FP8 x FP8 or INT8 x INT8 emulated: both operands dequantized, float32 matmul, bias
    added in float32, rounded once to ``out_dtype``. fp8 "block": ``a.scale`` per token and
    ``FP8_BLOCK`` channels, ``w_scale`` per tile."""
    k = a.q.shape[1]
    y = F.linear(a.q.float() * expand_groups(a.scale, k, FP8_BLOCK), dequantize_rows(w, w_scale))
    return _bias(y, bias).to(out_dtype)


def act_matmul_cuda(
    a: QuantAct,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """fp8: ``torch._scaled_mm`` with row-wise scales (A (M, K) e4m3 with scale (M, 1), B =
    w.t() column-major with scale (1, N), float32 scales, output in ``out_dtype``; K and N
    multiples of 16). int8: ``torch._int_mm`` (int32 accumulation; it needs M > 16, so rows
    are zero-padded to at least 32 and a multiple of 8), then both scales in float32."""
    if w_scale.dim() == 2:  # fp8 "block"
        return _block_matmul_cuda(a, w, w_scale, bias, out_dtype)
    if a.q.dtype == FP8_DTYPE:
        y = fp8_small(a, w, w_scale, bias, out_dtype)
        if y is not None:
            return y
        y = torch._scaled_mm(
            a.q, w.t(), scale_a=a.scale, scale_b=w_scale.float().reshape(1, -1), out_dtype=out_dtype
        )
        return y if bias is None else y + bias
    m = a.q.shape[0]
    pad = max(32, -(-m // 8) * 8) - m
    xq = F.pad(a.q, (0, 0, 0, pad)) if pad else a.q
    acc = torch._int_mm(xq, w.t())[:m]
    return _bias(acc.float() * a.scale * w_scale.float().reshape(1, -1), bias).to(out_dtype)


def block_gemm_ok(n: int, k: int) -> bool:
    """Whether cuBLAS's block-scaled GEMM (``torch._scaled_mm`` with 1x128 / 128x128 block
    scales, sm_90) takes N outputs and K inputs as they are: whole multiples of four blocks.
    Measured on an H100 with torch 2.11 / CUDA 13.0
    (``scripts/experiments/block_scaled_mm_layouts.py``): 384 x 256 (3 x 2 tiles) ran and
    gave wrong sums at every row count, Llama's 4096 / 6144 / 14336 (32-112 tiles) matched
    the emulation. Other shapes are zero-padded to such multiples (``_block_matmul_cuda``)."""
    return n % BLOCK_GEMM_MULTIPLE == 0 and k % BLOCK_GEMM_MULTIPLE == 0


BLOCK_GEMM_MULTIPLE = 4 * FP8_BLOCK


def _up(v: int, to: int) -> int:
    return -(-v // to) * to


def pad_block_weight(w: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 "block" weight (N, K) and its (N / 128, K / 128) tile scales zero-padded (codes
    0, scales 1) to whole multiples of four tiles a side, as cuBLAS takes them; as they are
    where they are such multiples already."""
    n, k = w.shape
    np_, kp = _up(n, BLOCK_GEMM_MULTIPLE), _up(k, BLOCK_GEMM_MULTIPLE)
    if (np_, kp) == (n, k):
        return w, w_scale
    wp = torch.zeros(np_, kp, dtype=w.dtype, device=w.device)
    wp[:n, :k] = w
    ws = torch.ones(np_ // FP8_BLOCK, kp // FP8_BLOCK, dtype=w_scale.dtype, device=w.device)
    ws[: w_scale.shape[0], : w_scale.shape[1]] = w_scale
    return wp, ws


def _block_matmul_cuda(
    a: QuantAct,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    n: int | None = None,
) -> torch.Tensor:
    """fp8 "block": ``torch._scaled_mm`` with A's scales (M, K / 128) column-major (1x128
    blocks) and B = w.t() with the weight's (N / 128, K / 128) tile scales, transposed
    (128x128 blocks). cuBLAS refuses A's scales unless their leading dimension (M) is a
    multiple of 4, so the rows are zero-padded to one (scale 1) and the output cut back.
    N and K must be whole multiples of four tiles (``block_gemm_ok``): the activations are
    zero-padded to the weight's K, and a weight that is not padded yet is padded here
    (``pad_block_weight``, a copy each call; ``QuantLinear.pad_block_weight`` does it once at
    load). ``n``: the outputs wanted of a padded weight. (Such shapes took a float32
    emulation before, whose sums changed with the row count, so eager and graph decode
    disagreed.)"""
    n = w.shape[0] if n is None else n
    w, w_scale = pad_block_weight(w, w_scale)  # as it is where padded already
    np_, kp = w.shape
    m, k = a.q.shape
    mp = _up(m, 4)
    q, sa = a.q, a.scale  # the quantizers write (M, K / 128) with strides (1, M)
    if mp != m or kp != k or sa.stride() != (1, m):
        # (Kp / 128, Mp) contiguous, seen as (Mp, Kp / 128) with strides (1, Mp)
        padded = torch.ones(kp // FP8_BLOCK, mp, dtype=torch.float32, device=q.device)
        padded[: sa.shape[1], :m] = sa.t()
        sa = padded.t()
    if mp != m or kp != k:
        q = torch.zeros(mp, kp, dtype=q.dtype, device=q.device)
        q[:m, :k] = a.q
    y = torch._scaled_mm(q, w.t(), scale_a=sa, scale_b=w_scale.t(), out_dtype=out_dtype)
    if mp != m or np_ != n:
        y = y[:m, :n].contiguous() if np_ != n else y[:m]
    return y if bias is None else y + bias


def fp8_small(
    a: QuantAct,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor | None:
    """fp8 at one to 32 rows where the build's tuner measured the fp8 skinny kernel
    (up to four rows, ``kiln.kernels.fp8_gemv``) or the tensor-core one
    (``kiln.kernels.fp8_mma``) faster than ``torch._scaled_mm`` at that shape; None
    otherwise, and where the tensor-core kernel cannot take the call (per-token or
    per-tensor activation scales only)."""
    m, k = a.q.shape
    if a.scale.numel() not in (1, m) or a.q.stride(1) != 1 or not w.is_contiguous():
        return None
    cfg = fp8_skinny_config(w.shape[0], k, m)
    if cfg is None or (cfg.get("MMA") and not fp8_mma_ok(a.q, w)):
        return None
    return fp8_skinny_triton(a.q, a.scale.float(), w, w_scale, bias, out_dtype, cfg)


def _bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias.float()
