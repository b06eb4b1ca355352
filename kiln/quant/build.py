"""Quantization as a build step (converted state dict -> quantized state dict) and as a
load step (dummy engines, whose random weights exist only once loaded)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.config import GPTQ_ALGOS, ModelConfig, QuantConfig
from kiln.errors import ConfigError
from kiln.models import build_model
from kiln.quant.algorithms import awq_layer_scales, smoothquant_factors
from kiln.quant.auto_exclude import ranked_projections
from kiln.quant.calib import default_corpus, split_corpus
from kiln.quant.calibration import DEFAULT_CALIB_TOKENS, calibration_token_ids
from kiln.quant.fold import fold_smoothing, tie_heads
from kiln.quant.gptq import collect_hessians, gptq_fp8, gptq_fp8_block, gptq_int4
from kiln.quant.passes import (
    LM_HEAD,
    is_excluded,
    outlier_channels,
    quant_shells,
    quant_targets,
    quantize_model,
)
from kiln.quant.sensitivity import SENSITIVITY_TOKENS, output_grad_sq, sensitivity
from kiln.quant.stats import InputStats, collect_input_stats, decoder_linears

CALIB_WINDOW = 512  # tokens per calibration sequence
AWQ_SAMPLES = 256  # input rows kept per projection for AWQ's search
AWQ_GRID = 20  # strengths tried by AWQ's search


def needs_calibration(qcfg: QuantConfig) -> bool:
    """Static fp8 scales, fp8's outlier channels and the AWQ / SmoothQuant factors are
    computed from activations."""
    fp8 = qcfg.algo == "fp8" and qcfg.activation_scheme in ("static", "outliers", "smooth")
    return fp8 or qcfg.algo in ("int4-awq", "w8a8-sq")


def algorithm_input_scales(
    qcfg: QuantConfig, weights: dict[str, torch.Tensor], stats: dict[str, InputStats]
) -> dict[str, torch.Tensor] | None:
    """Per-input-channel factors s (K,) of every decoder projection: AWQ's searched scales
    for int4-awq, SmoothQuant's migration factors (strength ``sq_alpha``) for w8a8-sq and
    fp8 with "smooth" activations. The layer then computes (x / s) @ (W * s).T
    (kiln/quant/algorithms.py)."""
    if qcfg.algo == "int4-awq":
        return awq_layer_scales(weights, stats, qcfg.group_size or 128, grid=AWQ_GRID)
    if qcfg.algo == "w8a8-sq" or (qcfg.algo == "fp8" and qcfg.activation_scheme == "smooth"):
        return {
            n: smoothquant_factors(stats[n].absmax.to(w.device), w.float(), qcfg.sq_alpha)
            for n, w in weights.items()
            if n in stats
        }
    return None


def gptq_weights(
    model: nn.Module,
    qcfg: QuantConfig,
    windows: list[list[int]],
    weights: dict[str, torch.Tensor],
    scales: dict[str, torch.Tensor] | None,
    act_stats: dict[str, dict[str, torch.Tensor]] | None = None,
) -> dict[str, tuple[torch.Tensor, ...]] | None:
    """GPTQ-rounded weights of every projection ``quantize_model`` will quantize (fp8 and
    int4-awq; None for other modes), from the Hessians of their inputs over ``windows``.
    With AWQ factors s the weight rounded is W * s and the Hessian that of x / s. fp8's
    outlier channels (chosen from ``act_stats``) are carried almost exactly (in two e4m3
    parts): their columns and Hessian rows are zeroed, so GPTQ neither rounds them nor
    compensates for them, and the row scales still cover them."""
    if qcfg.algo not in GPTQ_ALGOS:
        return None
    names = [n for n, _, _, _ in quant_targets(model) if not is_excluded(n, qcfg.exclude_modules)]
    head = LM_HEAD if qcfg.quantize_lm_head else None
    hessians = collect_hessians(model, windows, names, head)
    out: dict[str, tuple[torch.Tensor, ...]] = {}
    for name in names:
        w, h = weights[name].float(), hessians.pop(name)
        s = (scales or {}).get(name)
        if s is not None:
            s = s.to(w.device, torch.float32)
            w, h = w * s[None, :], h / s[:, None] / s[None, :]
        idx = outlier_channels(qcfg, act_stats, name, w.shape[1])
        row_amax = None
        if idx is not None:
            idx = idx.to(w.device)
            row_amax = w.abs().amax(dim=1)
            w, h = w.clone(), h.clone()
            w[:, idx], h[idx, :], h[:, idx] = 0.0, 0.0, 0.0
        out[name] = _gptq(qcfg, w, h, row_amax)
    if qcfg.quantize_lm_head:  # from the final hidden states, without AWQ factors
        w, h = model.lm_head.dense_weight().float(), hessians.pop(LM_HEAD)
        out[LM_HEAD] = _gptq(qcfg, w, h)
    return out


def _gptq(
    qcfg: QuantConfig, w: torch.Tensor, h: torch.Tensor, row_amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    if qcfg.weight_block:
        return gptq_fp8_block(w, h, qcfg.weight_block)
    if qcfg.algo == "fp8":
        return gptq_fp8(w, h, row_amax=row_amax)
    return gptq_int4(w, h, qcfg.group_size or 128)


@torch.no_grad()
def quantize_loaded(
    model: nn.Module,
    qcfg: QuantConfig,
    tokenizer: Any = None,
    n_tokens: int = DEFAULT_CALIB_TOKENS,
    measure_errors: bool = True,
    gptq: bool = False,
    calib_ids: list[int] | None = None,
) -> dict[str, dict[str, Any]]:
    """Quantize ``model`` (weights loaded, on its device) in place; the ``quantize_model``
    report. Calibration statistics are collected when the mode needs them (static fp8,
    AWQ, SmoothQuant) or ``measure_errors`` asks for each projection's relative output
    error on the calibration samples (the build's quality gate; a load skips it). With
    ``gptq`` (a build) fp8 and int4-awq weights are rounded by GPTQ (``gptq_weights``)
    instead of to nearest. ``calib_ids`` are the calibration tokens when the caller has
    them already (a build tokenizes its text once); else ``n_tokens`` are made here."""
    act_stats = scales = rounded = None
    stats: dict[str, InputStats] = {}
    linears = decoder_linears(model)
    weights = {n: m.weight.detach() for n, m in linears.items()}
    biases = {n: m.bias for n, m in linears.items()}
    use_gptq = gptq and qcfg.algo in GPTQ_ALGOS
    if measure_errors or use_gptq or needs_calibration(qcfg):
        ids = calib_ids
        if ids is None:
            ids = calibration_token_ids(tokenizer, qcfg.calib_text, n_tokens)
        windows = [ids[i : i + CALIB_WINDOW] for i in range(0, len(ids), CALIB_WINDOW)]
        stats = collect_input_stats(model, windows, keep_samples=AWQ_SAMPLES)
        act_stats = {
            n: {"amax": st.absmax.max(), "channel_amax": st.absmax, "channel_mean_abs": st.mean_abs}
            for n, st in stats.items()
        }
        scales = algorithm_input_scales(qcfg, weights, _awq_stats(model, qcfg, stats))
        if use_gptq:
            rounded = gptq_weights(model, qcfg, windows, weights, scales, act_stats)
    fisher: dict[str, torch.Tensor] = {}
    if measure_errors:  # before quantizing: the unquantized model's loss sensitivities
        targets = {n: linears[n] for n in linears if not is_excluded(n, qcfg.exclude_modules)}
        sens_windows, total = [], 0
        for w in windows:
            if total >= SENSITIVITY_TOKENS:
                break
            sens_windows.append(w)
            total += len(w)
        fisher, _ = output_grad_sq(model, sens_windows, targets)
    report = quantize_model(model, qcfg, act_stats=act_stats, input_scales=scales, rounded=rounded)
    if not measure_errors:
        _fold(model, qcfg, report)
        return report
    # the quality gate names the projections that cost most
    quantized = dict(model.named_modules())
    for name, entry in report.items():
        if entry["mode"] == "none" or name not in stats:
            continue
        x = stats[name].samples.to(weights[name].device, weights[name].dtype)
        ref = torch.nn.functional.linear(x, weights[name], biases[name]).float()
        dy = quantized[name](x).float() - ref
        entry["rel_output_error"] = float(dy.norm() / ref.norm().clamp_min(1e-30))
        if name in fisher:  # the perplexity increase (%) this projection alone would cause
            entry["est_ppl_increase_pct"] = 100 * math.expm1(sensitivity(fisher[name], dy))
    _fold(model, qcfg, report)  # after the errors, which feed the unfolded inputs
    return report


def _awq_stats(model: nn.Module, qcfg: QuantConfig, stats: dict[str, InputStats]) -> dict:
    """The statistics AWQ searches from: ``attn.o``'s tied across the query heads of a
    key-value head, so that its factors fold into the v rows (kiln/quant/fold.py)."""
    if qcfg.algo != "int4-awq":
        return stats
    out = dict(stats)
    for name, st in stats.items():
        if name.endswith(".attn.o"):
            attn = model.get_submodule(name.removesuffix(".o"))
            out[name] = tie_heads(st, attn.num_heads, attn.num_kv_heads)
    return out


def _fold(model: nn.Module, qcfg: QuantConfig, report: dict[str, dict[str, Any]]) -> None:
    """int4-awq: AWQ's factors folded into the producers of each projection's input; the
    report says, per quantized projection, whether x is still divided at run time."""
    if qcfg.algo != "int4-awq":
        return
    folded = set(fold_smoothing(model))
    modules = dict(model.named_modules())
    for name, entry in report.items():
        if entry["mode"] == "int4-awq":
            entry["runtime_smoothing"] = name not in folded and modules[name].smooth_active


def model_on(cfg: ModelConfig, state: dict[str, torch.Tensor], device: str) -> nn.Module:
    """The model of converted engine weights ``state`` (shared, not copied) on ``device``."""
    dtype = next(iter(state.values())).dtype
    model = build_model(cfg, dtype, "meta")
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device).eval()


def quant_model_on(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    qcfg: QuantConfig,
    device: str,
) -> nn.Module:
    """The model of an already quantized engine state (``QuantLinear`` shells wherever
    ``state`` has a ``weight_scale``) on ``device``."""
    dtype = state["embed.weight"].dtype
    model = build_model(cfg, dtype, "meta")
    names = sorted({k.removesuffix(".weight_scale") for k in state if k.endswith(".weight_scale")})
    quant_shells(model, qcfg, names)
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device).eval()


@torch.no_grad()
def quantize_state(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    qcfg: QuantConfig,
    tokenizer: Any = None,
    device: str = "cpu",
    calib_ids: list[int] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], nn.Module]:
    """Converted engine weights (kiln names, engine dtype) -> the quantized state dict (on
    the CPU, contiguous, ready for safetensors), the per-module report and the quantized
    model. The model runs on ``device`` for calibration and quantization, on
    ``calib_ids`` when given (else ``qcfg.calib_tokens`` of the calibration text)."""
    model = model_on(cfg, state, device)
    gptq = qcfg.weight_rounding == "gptq"
    report = quantize_loaded(
        model, qcfg, tokenizer, qcfg.calib_tokens, gptq=gptq, calib_ids=calib_ids
    )
    out = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    return out, report, model


@torch.no_grad()
def measure_quality(
    cfg: ModelConfig,
    ref_state: dict[str, torch.Tensor],
    quantized: nn.Module,
    qcfg: QuantConfig,
    report: dict[str, dict[str, Any]],
    tokenizer: Any,
    limits: dict[str, int],
    kv_scales: list[tuple[float, float]] | None = None,
    enforce: bool = True,
) -> dict[str, Any]:
    """The quality gate: the unquantized and the quantized model (with its fp8 KV cache
    and ``kv_scales`` when the engine has one) score the same held-out
    tokens (the half of the default corpus not used for calibration); perplexity increase,
    top-1 agreement and KL, plus the five projections with the largest output error.
    Raises ConfigError when ``qcfg.max_quality_loss`` is exceeded (unless not ``enforce``:
    see ``enforce_quality_limit``)."""
    from kiln.build.loader import LoadedEngine
    from kiln.quant.quality import compare

    param = next(quantized.parameters())
    dtype = next(iter(ref_state.values())).dtype
    ref = model_on(cfg, ref_state, str(param.device))
    if tokenizer is not None:
        ids = tokenizer.encode(split_corpus(default_corpus())[1], add_special_tokens=False)
    else:  # no tokenizer (a tokenizer-less checkpoint): fixed pseudo-random ids
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, min(cfg.vocab_size, 256), (qcfg.quality_tokens,), generator=gen)
        ids = ids.tolist()
    ids = ids[: qcfg.quality_tokens]
    ref_man = {"limits": limits, "tokenizer": None}
    kv = {"kv_cache_dtype": qcfg.kv_cache_dtype, "kv_scales": kv_scales}
    test_man = {**ref_man, "quant": kv}  # an fp8 KV cache is part of what is measured

    def engine(model: nn.Module, man: dict[str, Any]) -> LoadedEngine:
        return LoadedEngine(Path("."), man, cfg, model, param.device, dtype)

    res = compare(
        engine(ref, ref_man), engine(quantized, test_man), ids, max_tokens=len(ids)
    ).to_dict()
    # ranked by the estimated perplexity cost of each projection alone (sensitivity.py)
    costly = [
        (n, report[n].get("est_ppl_increase_pct", 0.0), report[n]["rel_output_error"])
        for n in ranked_projections(report)[:5]
    ]
    res["costliest_modules"] = [
        {"module": n, "est_ppl_increase_pct": p, "rel_output_error": e} for n, p, e in costly
    ]
    res["held_out_text"] = "default corpus, held-out half" if tokenizer else "pseudo-random ids"
    if enforce:
        enforce_quality_limit(res, qcfg)
    return res


def enforce_quality_limit(
    res: dict[str, Any], qcfg: QuantConfig, kept: list[dict[str, Any]] | None = None
) -> None:
    """Raise ConfigError when the gate's result ``res`` exceeds ``qcfg.max_quality_loss``,
    naming the projections that cost most (and those ``--auto-exclude`` already kept in
    full precision, ``kept``)."""
    limit = qcfg.max_quality_loss
    if limit is None or res["ppl_increase_pct"] <= limit:
        return
    costly = res["costliest_modules"]
    names = (
        ", ".join(f"{c['module']} (+{c['est_ppl_increase_pct']:.2f} %)" for c in costly[:3])
        or "(none quantized)"
    )
    what = " + ".join(x for x in (qcfg.algo, qcfg.kv_cache_dtype and "fp8 KV cache") if x)
    after, more = "", "--auto-exclude"
    if kept:
        after = (
            f" after --auto-exclude kept {len(kept)} in full precision "
            f"({', '.join(k['module'] for k in kept)})"
        )
        more = f"a larger --auto-exclude (it was {len(kept)})"
    raise ConfigError(
        f"the {what} engine's perplexity on held-out text rises "
        f"{_above(res['ppl_increase_pct'], limit)} % over the unquantized model{after} "
        f"(--max-quality-loss {limit:g}); the projections that lose most (estimated "
        f"perplexity increase of each alone): {names}; "
        f"keep them in full precision with --exclude-modules or {more}, or choose "
        "another --quant or --kv-cache-dtype."
    )


def _above(value: float, limit: float) -> str:
    """``value`` (> ``limit``) to two decimals, or to as many more as it takes to show it
    above the limit (a refusal at 1 % must not read "rises 1.00 %")."""
    for digits in range(2, 7):
        text = f"{value:.{digits}f}"
        if float(text) > limit:
            return text
    return repr(value)
