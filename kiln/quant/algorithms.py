"""Quantization math as pure functions: int4 group-wise round-to-nearest, AWQ scale search,
SmoothQuant factors, and int8 quantize-dequantize helpers for measuring w8a8 error.

Everything here computes in float32 and returns float32; no storage format (packing, dtype
of scales) lives here, that is ``kiln/quant/formats.py``'s business. The int4 math below is
the reference the packed format is checked against.

Convention for per-input-channel scales ``s`` (K,) of a Linear y = x W^T, W: (N, K), both for
AWQ and SmoothQuant: the transformed layer computes

    y = (x / s) @ (W * s)^T        (W * s scales column j of W by s_j)

which equals x W^T exactly before quantization. The weight that gets quantized is W * s; the
division of x by s is folded into whatever produces x (the RMSNorm weight for qkv / gate_up,
the up rows of gate_up for down, the v rows of qkv for o when heads line up), or applied at
run time. A fused projection (qkv, gate_up) shares one input, so one s serves all its rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kiln.quant.stats import InputStats

INT4_MAX = 15
SCALE_EPS = 1e-6
"""Smallest int4 group scale: a group whose values are all equal gets this scale."""


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    if w.dim() != 2:
        raise ValueError(f"weight must be (N, K), got {tuple(w.shape)}")
    n, k = w.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"K={k} is not a multiple of group_size={group_size}")
    return w.float().reshape(n, k // group_size, group_size)


def rtn_int4_quant(
    w: torch.Tensor, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric int4 round-to-nearest of ``w`` (N, K) along K.

    For each row and each group of ``group_size`` consecutive input channels:
    ``scale = max(max - min, 15 * SCALE_EPS) / 15``, ``zero = clamp(round(-min / scale), 0, 15)``,
    ``q = clamp(round(w / scale) + zero, 0, 15)``; dequantized ``w_hat = (q - zero) * scale``.
    Rounding is torch.round (half to even). A group that does not straddle 0 gets zero clamped
    to 0 or 15, so part of its range is clipped (as in the AWQ reference quantizer).

    Returns ``q`` (N, K) uint8 in [0, 15], ``scale`` (N, K // g) float32, ``zero``
    (N, K // g) float32 holding integers in [0, 15].
    """
    g = _groups(w, group_size)
    lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    scale = (hi - lo).clamp_min(INT4_MAX * SCALE_EPS) / INT4_MAX
    zero = torch.round(-lo / scale).clamp(0, INT4_MAX)
    q = (torch.round(g / scale) + zero).clamp(0, INT4_MAX)
    return q.reshape(w.shape).to(torch.uint8), scale.squeeze(-1), zero.squeeze(-1)


def int4_dequant(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int = 128
) -> torch.Tensor:
    """(N, K) float32 ``(q - zero) * scale``, ``scale``/``zero`` (N, K // g) per group."""
    g = _groups(q, group_size)
    return ((g - zero.float().unsqueeze(-1)) * scale.float().unsqueeze(-1)).reshape(q.shape)


def rtn_int4_dequant(w: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """Quantize then dequantize: the (N, K) float32 weight an int4 RTN kernel multiplies by."""
    return int4_dequant(*rtn_int4_quant(w, group_size), group_size)


# --- AWQ -----------------------------------------------------------------------------------


@dataclass
class AwqResult:
    scales: torch.Tensor
    """(K,) float32 best s; all ones when alpha 0 (plain RTN) won."""
    alpha: float
    """The exponent that won."""
    error: float
    """Mean squared output error with ``scales`` on the search samples."""
    rtn_error: float
    """The same with plain RTN (alpha 0), for comparison."""


def awq_candidate(act_mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|x|^alpha normalised by sqrt(max(s) * min(s)), clamped to >= 1e-4. Alpha 0 gives
    all ones."""
    s = act_mean_abs.float().clamp_min(1e-8).pow(alpha)
    s = s / (s.max() * s.min()).sqrt()
    return s.clamp_min(1e-4)


def awq_output_error(
    w: torch.Tensor, x: torch.Tensor, s: torch.Tensor | None, group_size: int = 128
) -> float:
    """Mean over samples and outputs of (x W^T - (x / s) Q(W * s)^T)^2, Q = int4 group RTN.
    ``s`` None is plain RTN."""
    w, x = w.float(), x.to(w.device, torch.float32)
    ref = x @ w.T
    if s is None:
        out = x @ rtn_int4_dequant(w, group_size).T
    else:
        s = s.to(w.device, torch.float32)
        out = (x / s) @ rtn_int4_dequant(w * s, group_size).T
    return (out - ref).pow(2).mean().item()


def awq_search(
    w: torch.Tensor,
    x_samples: torch.Tensor,
    act_mean_abs: torch.Tensor,
    group_size: int = 128,
    grid: int = 20,
) -> AwqResult:
    """Grid search of AWQ's per-input-channel scale over alpha in {0, 1/grid, ...,
    (grid-1)/grid}: s = awq_candidate(act_mean_abs, alpha), keeping the s that minimises
    ``awq_output_error`` on ``x_samples``. Alpha 0 (s = 1, plain RTN) is tried first and only
    a strictly smaller error replaces it, so the result is never worse than RTN on the
    samples. Computes on ``w``'s device."""
    if x_samples.dim() != 2 or x_samples.shape[0] == 0 or x_samples.shape[1] != w.shape[1]:
        raise ValueError(f"x_samples {tuple(x_samples.shape)} does not fit weight {tuple(w.shape)}")
    w = w.float()
    x = x_samples.to(w.device, torch.float32)
    a = act_mean_abs.to(w.device, torch.float32)
    best_s, best_alpha, best_err, rtn_err = None, 0.0, float("inf"), float("inf")
    for i in range(max(grid, 1)):
        alpha = i / max(grid, 1)
        s = awq_candidate(a, alpha)
        err = awq_output_error(w, x, s, group_size)
        if i == 0:
            rtn_err = err
        if err < best_err:
            best_s, best_alpha, best_err = s, alpha, err
    assert best_s is not None
    return AwqResult(best_s, best_alpha, best_err, rtn_err)


def awq_scales(
    w: torch.Tensor,
    x_samples: torch.Tensor,
    act_mean_abs: torch.Tensor,
    group_size: int = 128,
    grid: int = 20,
) -> torch.Tensor:
    """(K,) AWQ scale s of weight ``w`` (N, K) (a fused weight is one (N, K)); the layer then
    computes (x / s) @ Q(w * s)^T. See ``awq_search``."""
    return awq_search(w, x_samples, act_mean_abs, group_size, grid).scales


def awq_layer_scales(
    weights: dict[str, torch.Tensor],
    stats: Mapping[str, InputStats],
    group_size: int = 128,
    grid: int = 20,
) -> dict[str, torch.Tensor]:
    """AWQ scales of every weight (N, K) in ``weights`` whose name is in ``stats`` (a
    ``collect_input_stats`` result: ``InputStats`` with ``samples`` and ``mean_abs``).
    Returns name -> (K,) float32 on the weight's device."""
    out = {}
    for name, w in weights.items():
        st = stats.get(name)
        if st is None:
            continue
        out[name] = awq_scales(w, st.samples, st.mean_abs, group_size, grid)
    return out


# --- SmoothQuant and int8 ------------------------------------------------------------------


def smoothquant_factors(
    act_absmax: torch.Tensor,
    w: torch.Tensor,
    alpha: float = 0.5,
    eps: float = 1e-5,
    max_factor: float = 1e4,
) -> torch.Tensor:
    """(K,) float32 s_j = max|X_j|^alpha / max_i |W_ij|^(1 - alpha), both maxima clamped to
    >= ``eps``, s clamped to [1 / max_factor, max_factor]. The layer computes
    (x / s) @ (w * s)^T: outlier activation channels are divided down, their weight columns
    multiplied up, moving quantization difficulty from activations to weights."""
    a = act_absmax.to(w.device, torch.float32).clamp_min(eps)
    wmax = w.float().abs().amax(dim=0).clamp_min(eps)
    s = a.pow(alpha) / wmax.pow(1.0 - alpha)
    return s.clamp(1.0 / max_factor, max_factor)


def _int8_sym(t: torch.Tensor, dim: int) -> torch.Tensor:
    t = t.float()
    scale = t.abs().amax(dim=dim, keepdim=True).clamp_min(1e-8) / 127.0
    return (torch.round(t / scale).clamp(-127, 127)) * scale


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 quantize-dequantize of activations (T, K), one scale per row (token):
    scale = max|x_row| / 127, q = clamp(round(x / scale), -127, 127). Float32."""
    return _int8_sym(x, dim=-1)


def int8_per_channel(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 quantize-dequantize of a weight (N, K), one scale per output channel
    (row): scale = max|w_row| / 127. Float32."""
    return _int8_sym(w, dim=-1)


def w8a8_output_error(w: torch.Tensor, x: torch.Tensor, s: torch.Tensor | None = None) -> float:
    """Mean squared error of the w8a8 output int8_per_token(x / s) @ int8_per_channel(w * s)^T
    against the float x @ w^T (``s`` None: no smoothing)."""
    w, x = w.float(), x.to(w.device, torch.float32)
    ref = x @ w.T
    if s is not None:
        s = s.to(w.device, torch.float32)
        x, w = x / s, w * s
    out = int8_per_token(x) @ int8_per_channel(w).T
    return (out - ref).pow(2).mean().item()
