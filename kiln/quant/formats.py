"""Quantized number formats: quantize / dequantize, int4 packing, and the matmuls.

Layouts (``w`` is a linear weight of shape (N, K) = (out_features, in_features)):

- FP8 weights: ``float8_e4m3fn`` (N, K), symmetric, one float32 scale per output row,
  ``scale = amax(|w[n]|) / 448``; activations per token (row scale (M, 1)) or per tensor
  (one float32 scale from calibration).
- INT8 weights: ``int8`` (N, K) in [-127, 127], one float32 scale per output row,
  ``scale = amax / 127``; activations for w8a8 per token the same way.
- INT4 weights: asymmetric uint4 in groups of ``G`` along K: ``scale`` and ``zero`` of shape
  (N, K / G) (float32 and uint8 in [0, 15]); ``w ~ (q - zero) * scale``. Two values per
  byte: (N, K / 2) uint8, element ``2j`` in the low nibble, ``2j + 1`` in the high nibble.

Every ``*_ref`` matmul is the exact arithmetic of the GPU path emulated in float32:
quantize, dequantize, multiply in float32 (what ``torch._scaled_mm`` / ``torch._int_mm``
compute up to the order of the float32 / int32 accumulation)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
INT8_MAX = 127.0
INT4_MAX = 15
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


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activations: (M, K) -> (float8 (M, K), float32 scale (M, 1))."""
    s = _row_scale(x, FP8_MAX)
    return quantize_fp8(x, s), s


def fp8_static_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """Per-tensor activation scale from a calibrated absolute maximum: float32 ()."""
    return (torch.as_tensor(amax, dtype=torch.float32).clamp(min=_TINY) / FP8_MAX).reshape(())


def _quantize_int8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(t.float() / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def quantize_int8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> (int8 (N, K), float32 scale (N,))."""
    s = _row_scale(w, INT8_MAX)
    return _quantize_int8(w, s), s.squeeze(1)


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w8a8 activations: (M, K) -> (int8 (M, K), float32 scale (M, 1))."""
    s = _row_scale(x, INT8_MAX)
    return _quantize_int8(x, s), s


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 / int8 (N, K) with per-row scale (N,) or (N, 1) -> float32 (N, K)."""
    return q.float() * scale.reshape(-1, 1).float()


# ---------------------------------------------------------------- int4, grouped, asymmetric


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, ...]:
    """(N, K) -> (uint8 q (N, K) in [0, 15] unpacked, float32 scale (N, K/G),
    uint8 zero (N, K/G)). The range of every group includes 0, so zero is exact."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide in_features {k}")
    g = w.float().reshape(n, k // group_size, group_size)
    lo = g.amin(dim=-1).clamp(max=0.0)
    hi = g.amax(dim=-1).clamp(min=0.0)
    scale = ((hi - lo) / INT4_MAX).clamp(min=_TINY)
    zero = torch.round(-lo / scale).clamp(0, INT4_MAX)
    q = torch.round(g / scale[..., None]) + zero[..., None]
    q = q.clamp(0, INT4_MAX).to(torch.uint8).reshape(n, k)
    return q, scale, zero.to(torch.uint8)


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


# ---------------------------------------------------------------- matmuls: references


def _bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias.float()


def fp8_linear_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP8 x FP8: x quantized per token (``input_scale`` None) or with the static scale,
    both operands dequantized, float32 matmul, rounded once to x's dtype."""
    if input_scale is None:
        xq, xs = quantize_fp8_per_token(x)
    else:
        xq, xs = quantize_fp8(x, input_scale.float()), input_scale.float()
    y = F.linear(xq.float() * xs, dequantize_rows(w, w_scale))
    return _bias(y, bias).to(x.dtype)


def int8_linear_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    act_int8: bool = False,
) -> torch.Tensor:
    """int8-wo (``act_int8`` False: x as given) or w8a8 (x quantized per token to int8)."""
    if act_int8:
        xq, xs = quantize_int8_per_token(x)
        xf = xq.float() * xs
    else:
        xf = x.float()
    return _bias(F.linear(xf, dequantize_rows(w, w_scale)), bias).to(x.dtype)


def int4_linear_ref(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W4A16: the weight dequantized to float32, float32 matmul."""
    w = dequantize_int4(unpack_int4(packed), scale, zero)
    return _bias(F.linear(x.float(), w), bias).to(x.dtype)


# ---------------------------------------------------------------- matmuls: CUDA


def fp8_linear_cuda(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``torch._scaled_mm`` with row-wise scales: A (M, K) e4m3 with scale_a (M, 1), B = w.t()
    (K, N) column-major with scale_b (1, N), float32 scales, output in x's dtype (bf16 for
    row-wise scaling). A static scale is broadcast to (M, 1). K and N must be multiples of
    16 (true for the Llama shapes)."""
    if input_scale is None:
        xq, xs = quantize_fp8_per_token(x)
    else:
        xq = quantize_fp8(x, input_scale)
        xs = input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    y = torch._scaled_mm(
        xq, w.t(), scale_a=xs, scale_b=w_scale.float().reshape(1, -1), out_dtype=x.dtype
    )
    return y if bias is None else y + bias


def w8a8_linear_cuda(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """int8 x int8 -> int32 with ``torch._int_mm`` (needs M > 16: rows are zero-padded to
    at least 32), then the row scales of x times the column scales of w in float32."""
    xq, xs = quantize_int8_per_token(x)
    m = xq.shape[0]
    pad = max(32, -(-m // 8) * 8) - m
    if pad:
        xq = F.pad(xq, (0, 0, 0, pad))
    acc = torch._int_mm(xq, w.t())[:m]
    y = acc.float() * xs * w_scale.float().reshape(1, -1)
    return _bias(y, bias).to(x.dtype)


def int8_wo_linear_cuda(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """W8A16 for now: dequantize to x's dtype, then ``F.linear``. A fused Triton W8A16
    kernel that reads the int8 weight directly is a later step."""
    wd = (w.to(x.dtype) * w_scale.to(x.dtype).reshape(-1, 1)).contiguous()
    return F.linear(x, wd, bias)


def int4_linear_cuda(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W4A16 for now: unpack + dequantize to x's dtype, then ``F.linear``. This saves memory,
    not time; a fused Triton W4A16 kernel (dequantize in registers) is a later step."""
    w = dequantize_int4(unpack_int4(packed), scale, zero).to(x.dtype)
    return F.linear(x, w, bias)
