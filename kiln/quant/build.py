"""Quantization as a build step (converted state dict -> quantized state dict) and as a
load step (dummy engines, whose random weights exist only once loaded)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kiln.config import ModelConfig, QuantConfig
from kiln.models import build_model
from kiln.quant.calibration import (
    DEFAULT_CALIB_TOKENS,
    calibration_token_ids,
    collect_activation_stats,
)
from kiln.quant.layers import quantize_model


def needs_calibration(qcfg: QuantConfig) -> bool:
    """Static fp8 scales and the AWQ / SmoothQuant factors are computed from activations."""
    return (qcfg.algo == "fp8" and qcfg.activation_scheme == "static") or qcfg.algo in (
        "int4-awq",
        "w8a8-sq",
    )


def algorithm_input_scales(
    model: nn.Module, qcfg: QuantConfig, stats: dict[str, dict[str, torch.Tensor]] | None
) -> dict[str, torch.Tensor] | None:
    """AWQ / SmoothQuant per-input-channel factors from ``kiln.quant.algorithms`` when that
    module provides ``input_scales(model, qcfg, act_stats) -> dict[name, (K,) tensor]``;
    None otherwise (int4-awq is then round-to-nearest, w8a8-sq unsmoothed)."""
    if qcfg.algo not in ("int4-awq", "w8a8-sq") or stats is None:
        return None
    try:
        from kiln.quant import algorithms  # type: ignore[attr-defined]
    except ImportError:
        return None
    fn = getattr(algorithms, "input_scales", None)
    return fn(model, qcfg, stats) if fn is not None else None


@torch.no_grad()
def quantize_loaded(
    model: nn.Module,
    qcfg: QuantConfig,
    tokenizer: Any = None,
    n_tokens: int = DEFAULT_CALIB_TOKENS,
) -> dict[str, dict[str, Any]]:
    """Calibrate ``model`` (weights loaded, on its device) when the mode needs it, then
    quantize it in place; the ``quantize_model`` report."""
    stats = None
    if needs_calibration(qcfg):
        ids = calibration_token_ids(tokenizer, qcfg.calib_text, n_tokens)
        stats = collect_activation_stats(model, ids)
    scales = algorithm_input_scales(model, qcfg, stats)
    return quantize_model(model, qcfg, act_stats=stats, input_scales=scales)


@torch.no_grad()
def quantize_state(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    qcfg: QuantConfig,
    tokenizer: Any = None,
    device: str = "cpu",
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """Converted engine weights (kiln names, engine dtype) -> the quantized state dict (on
    the CPU, contiguous, ready for safetensors) and the per-module report. The model runs
    on ``device`` for calibration and quantization."""
    dtype = next(iter(state.values())).dtype
    model = build_model(cfg, dtype, "meta")
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device).eval()
    report = quantize_loaded(model, qcfg, tokenizer)
    out = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    return out, report
