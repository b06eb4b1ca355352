"""The int4 projections whose weights are stored tile-major for the float16-code kernel
(``kiln.kernels.wq_f16``): which rows take it, the dispatcher their ``QuantLinear`` calls,
and the producers' side (RMSNorm and SiLU·mul writing x prepared, ``kiln.kernels.f16_prep``).

The engine's tuner times the float16-code kernel beside the others at up to eight rows and
records where it wins (``tuning.json``, ``weight_only.f16``: {shape key: {rows: config}}).
At load, a projection whose producer can write its input prepared (qkv after attn_norm,
gate_up after mlp_norm, down after SiLU·mul, a quantized head after the final norm in the
decode graphs) and whose one-row pick is that kernel gets its words tile-major in place
(no second copy) and ``f16_rows``: the steps of up to that many rows run the float16-code
kernel, with x from the producer. Other row counts read the same
tile-major words: the bfloat16-code tensor-core kernel (``wq_mma``, ``TILED``) up to
``WQ_MAX_M`` rows, past it the dequantizing kernel (``TILED``) and cuBLAS; on the CPU the
references."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.kernels import wq_f16
from kiln.kernels._triton import INTERPRET, use_triton
from kiln.kernels.gemv import _num_sms
from kiln.kernels.partials import SplitPartials, buffer, finished
from kiln.kernels.tuning import tuned
from kiln.kernels.wq_config import wq_config, wq_default_config, wq_shape_key
from kiln.kernels.wq_f16 import F16Act


def f16_picks(n: int, k: int, group: int | None) -> dict[int, dict]:
    """The tuner's float16-code picks for a shape: {rows: config} (empty: none won)."""
    by_m = tuned("weight_only").get("f16", {}).get(wq_shape_key(n, k, group), {})
    return {int(m): cfg for m, cfg in by_m.items()}


def f16_rows(n: int, k: int, group: int | None) -> int:
    """Up to how many rows a step takes the float16-code kernel: the largest tuned row
    count up to which every tuned row count's pick is that kernel (a step of m rows takes
    the pick of the smallest tuned count >= m), 0 where its one-row pick is not."""
    if not wq_f16.f16_eligible(n, k, group):
        return 0
    picks = f16_picks(n, k, group)
    tuned_ms = sorted(int(m) for m in tuned("weight_only")["by_shape"].get(
        wq_shape_key(n, k, group), {}))  # fmt: skip
    rows = 0
    for m in sorted(set(tuned_ms) | set(picks)):
        if m > wq_f16.MAX_M or m not in picks:
            break
        rows = m
    return rows


def _f16_config(n: int, k: int, m: int, group: int) -> dict:
    picks = f16_picks(n, k, group)
    ms = sorted(picks)
    return picks[next((r for r in ms if r >= m), ms[-1])] if ms else wq_f16.DEFAULT


def linear(x: torch.Tensor | F16Act, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
           partials: bool = False, out: torch.Tensor | None = None,
           ) -> torch.Tensor | SplitPartials:  # fmt: skip
    """x @ dequantized(w).T for tile-major int4 words ``w`` (group ``K / scale.shape[1]``,
    no smoothing or bias): x prepared (``F16Act``) takes the float16-code kernel, a tensor
    the others (module docstring). ``partials``: a launch split along K may return its
    partials (``kiln.kernels.partials``). ``out``: a float32 buffer the float16-code
    kernel may write its (rounded) result into (``wq_f16.wq4_f16``); else unused."""
    n = w.shape[0]
    if isinstance(x, F16Act):
        m, k = x.shape
        group = k // scale.shape[1]
        if not x.xq.is_cuda or INTERPRET:
            return wq_f16.wq4_f16_ref(x, w, scale, zero)
        return wq_f16.wq4_f16(x, w, scale, zero, _f16_config(n, k, m, group), partials, out)
    from kiln.kernels import wq_gemm as wq

    k = x.shape[-1]
    group = k // scale.shape[1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if not use_triton(x2) or x2.dtype not in (torch.bfloat16, torch.float16):
        y = wq.wq_linear_ref(x2, wq_f16.untile_words(w), scale, zero)
    elif m <= wq.WQ_MAX_M["int4"] and _mma_takes(x2, k, group):
        from kiln.kernels.wq_mma import wq4_mma

        cfg = wq_config(n, k, m, group, _num_sms(x2.device.index))
        if not cfg.get("MMA"):  # a pick of another form: the tensor-core kernel's default
            cfg = wq_default_config(n, k, m, group, _num_sms(x2.device.index))
        y = wq4_mma(x2.contiguous(), w, wq.scale_arg(scale), zero, None, r=cfg["R"],
                    num_warps=cfg["num_warps"], split=cfg["SPLIT_K"], ch=cfg["CH"],
                    pf=cfg["PF"], partials=partials and x.dim() == 2, nt=cfg.get("NT"),
                    zs=bool(cfg.get("ZS")), tiled=True)  # fmt: skip
        if isinstance(y, SplitPartials):
            return y
    else:
        wd = wq.dequantize_triton(w, scale, zero, k, x2.dtype, tiled=True)
        y = F.linear(x2, wd)
    return y.view(*x.shape[:-1], n)


def _mma_takes(x: torch.Tensor, k: int, group: int) -> bool:
    from kiln.kernels import wq_mma

    return not INTERPRET and wq_mma.ENABLED and wq_mma.mma_ok(x, k, group, None)


# ------------------------------------------------------------------ the producers' side


def wants_f16(consumer: torch.nn.Module | None, rows: int) -> bool:
    """Whether a producer writes ``consumer``'s input prepared at a step of ``rows`` rows."""
    return consumer is not None and 0 < rows <= getattr(consumer, "f16_rows", 0)


def rms_norm_f16(x: torch.Tensor | SplitPartials, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None) -> tuple[F16Act, torch.Tensor | None]:  # fmt: skip
    """RMSNorm (after the residual add) written as the float16-code kernel's x."""
    from kiln.kernels import f16_prep

    src = buffer(x)[0]
    if use_triton(src) and src.stride(-1) == 1:
        (xq, sums), r = f16_prep.rms_norm_prep_triton(x, weight, eps, residual)
    else:
        (xq, sums), r = f16_prep.rms_norm_prep_ref(finished(x), weight, eps, residual)
    return F16Act(xq, sums, x.dtype), r


def silu_mul_f16(x: torch.Tensor | SplitPartials) -> F16Act:
    """SiLU·mul of [gate | up] written as the float16-code kernel's x."""
    from kiln.kernels import f16_prep

    src = buffer(x)[0]
    if use_triton(src) and src.stride(-1) == 1:
        xq, sums = f16_prep.silu_mul_prep_triton(x)
    else:
        xq, sums = f16_prep.silu_mul_prep_ref(x)
    return F16Act(xq, sums, x.dtype)
