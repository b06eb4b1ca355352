"""Torch references of the per-token activation quantization (``kiln.kernels.quant_act``,
whose docstring gives the format, outlier columns included): ``QuantAct``, and the
quantization alone or after RMSNorm / SiLU-and-multiply. Every Triton kernel there
reproduces these bit for bit; on the CPU they are what runs."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kiln.config import ACT_SCALE_SEARCHES
from kiln.kernels.activation import silu_and_mul_ref
from kiln.kernels.rmsnorm import rms_norm_ref

KINDS = ("fp8", "int8")
_QMAX = {"fp8": 448.0, "int8": 127.0}
_DTYPE = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
_TINY = 1e-12  # the scale of an all-zero row is this / qmax (as kiln.quant.formats)
SEARCHES = ACT_SCALE_SEARCHES
"""fp8 per-token scale search: how many candidate scales a row's quantization tries (0:
none, the scale is amax / 448)."""


class QuantAct(NamedTuple):
    """A quantized activation: ``q`` (M, K), ``scale`` (M, 1) float32 (per token) or
    (M, ceil(K / G)) (per token and group of G consecutive channels, the last group
    ragged when G does not divide K; the Triton quantizers store it column-major, as
    ``torch._scaled_mm``'s 1x128 block scales are)."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device


def check_search(search: int, kind: str, group: int | None = None) -> None:
    """Refuse a scale search the quantizers do not implement."""
    if search not in SEARCHES:
        raise ValueError(f"search={search!r}: expected one of {SEARCHES}")
    if search and kind != "fp8":
        raise ValueError("the scale search is for fp8 quantization only")


SEARCH_TOP = 4
"""The search scores each candidate scale on the row's SEARCH_TOP largest magnitudes."""


def top_magnitudes(a: torch.Tensor, top: int = SEARCH_TOP) -> list[torch.Tensor]:
    """The ``top`` largest distinct values of each row of ``a`` (M, K), non-negative, as
    (M, 1) columns, largest first: the row's max, then the max of what lies below it, and
    so on (0 once a row has no more)."""
    m = a.amax(dim=-1, keepdim=True)
    out = [m]
    for _ in range(top - 1):
        m = torch.where(a < m, a, torch.zeros_like(a)).amax(dim=-1, keepdim=True)
        out.append(m)
    return out


def search_fp8_scale(y: torch.Tensor, search: int, top: int = SEARCH_TOP) -> torch.Tensor:
    """Per-row fp8 scales (M, 1) for float32 rows ``y`` (M, K): among the ``search``
    candidates ``s0 * (1 + j / search)``, j = 0 .. search - 1, with ``s0 = amax / 448`` (the
    row's largest value exact at j = 0), the one under which the row's ``top`` largest
    magnitudes m round to e4m3 with the least squared error, ``s**2 * sum((q - m / s)**2)``
    (the squared error of a row is mostly its largest values'; on SmolLM2 the 4 largest
    chose as well as all of them, docs/quantization.md). ``m / s`` is taken as
    ``m * (1 / s)``, the sum in the order of ``top_magnitudes``, the candidates compared as
    ``(search + j)**2 * sum`` (ties: the smallest j): the Triton kernels do the same
    scalar arithmetic, so they pick the same scale."""
    tops = top_magnitudes(y.abs(), top)
    s0 = tops[0].clamp(min=_TINY) / 448.0
    costs, scales = [], []
    for j in range(search):
        s = s0 * (1.0 + j / search)
        inv = 1.0 / s
        cost = None
        for m in tops:  # at most an ulp or two past 448, which e4m3 rounds to 448
            v = m * inv
            d = v.to(torch.float8_e4m3fn).float() - v
            cost = d * d if cost is None else cost + d * d
        costs.append(cost * float((search + j) ** 2))
        scales.append(s)
    pick = torch.cat(costs, dim=-1).argmin(dim=-1, keepdim=True)  # the first of equals
    return torch.cat(scales, dim=-1).gather(-1, pick)


def quantize_rows_ref(
    x: torch.Tensor,
    kind: str,
    smooth: torch.Tensor | None = None,
    group: int | None = None,
    outliers: torch.Tensor | None = None,
    search: int = 0,
) -> QuantAct:
    """(M, K) -> QuantAct: optional ``x / smooth`` (rounded to x's dtype), then symmetric
    quantization per row, or per row and ``group`` consecutive channels (the last group
    holds what is left when ``group`` does not divide K: ``expand_groups``);
    fp8 saturates and rounds to nearest even, int8 rounds half to even and clamps to +-127.
    ``outliers`` (fp8, per row): q gets the 2C columns of the module docstring.
    ``search`` (fp8, per row): the row's scale is chosen among that many candidates
    (``search_fp8_scale``); 0: amax / 448."""
    if outliers is not None and (kind != "fp8" or group or smooth is not None):
        raise ValueError("outlier channels are split for fp8 per-token quantization only")
    check_search(search, kind, group)
    if smooth is not None:
        x = (x.float() / smooth.float()).to(x.dtype)
    m, k = x.shape
    if group is not None and (isinstance(group, bool) or group <= 0):
        raise ValueError(f"group={group!r} must be a positive number of channels")
    g = min(group or k, k) if k else 1
    xf = x.float()
    n = -(-k // g)
    pad = torch.nn.functional.pad(xf.abs(), (0, n * g - k)).reshape(m, n, g)
    if search:  # each group's scale searched on its own values (zeros past K change nothing)
        s = search_fp8_scale(pad.reshape(m * n, g), search).reshape(m, n)
    else:
        s = pad.amax(dim=-1).clamp(min=_TINY) / _QMAX[kind]
    y = xf / expand_groups(s, k, g)
    if kind == "fp8":
        v = y.clamp(-448.0, 448.0)
        q = v.to(torch.float8_e4m3fn)
        if outliers is not None:
            hi = q[:, outliers]
            lo = (v[:, outliers] - hi.float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            q = torch.cat([q, lo, hi], dim=1)
    else:
        q = torch.round(y).clamp(-127.0, 127.0).to(torch.int8)
    return QuantAct(q, s)


def expand_groups(scale: torch.Tensor, k: int, group: int | None = None) -> torch.Tensor:
    """Per-group scales (M, ceil(K / group)) -> (M, K), each repeated over its group's
    channels (the last group ragged); a per-row scale (M, 1) is returned as it is (it
    broadcasts)."""
    if scale.shape[-1] == 1:
        return scale
    if group is None or scale.shape[-1] != -(-k // group):
        raise ValueError(f"scales of shape {tuple(scale.shape)} are not per {group} of {k}")
    return scale.repeat_interleave(group, dim=-1)[..., :k]


def rms_norm_quant_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    kind: str,
    smooth: torch.Tensor | None = None,
    outliers: torch.Tensor | None = None,
    search: int = 0,
    group: int | None = None,
) -> tuple[QuantAct, torch.Tensor | None]:
    y, r = rms_norm_ref(x, weight, eps, residual)
    return quantize_rows_ref(y, kind, smooth, group, outliers, search), r


def silu_and_mul_quant_ref(
    x: torch.Tensor,
    kind: str,
    smooth: torch.Tensor | None = None,
    outliers: torch.Tensor | None = None,
    search: int = 0,
    group: int | None = None,
) -> QuantAct:
    return quantize_rows_ref(silu_and_mul_ref(x), kind, smooth, group, outliers, search)
