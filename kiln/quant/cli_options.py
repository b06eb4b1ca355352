"""The quantization options of the CLI (``kiln build``, ``kiln eval``), their
``QuantConfig``, and how ``kiln inspect`` describes a quantized engine."""

from __future__ import annotations

import argparse
from typing import Any

from kiln.config import (
    ACT_SCALE_SEARCHES,
    ACTIVATION_SCHEMES,
    DEFAULT_CALIB_TOKENS,
    DEFAULT_SQ_ALPHA,
    KV_CACHE_DTYPES,
    KV_ROTATIONS,
    QUANT_ALGOS,
    WEIGHT_ROUNDINGS,
    KvCacheConfig,
    QuantConfig,
    uses_sq_alpha,
)
from kiln.errors import bad_value

LOAD_KV_CACHE_DTYPES = ("auto", "fp8")
"""A KV cache dtype chosen at load: the engine's (auto), or fp8 for one built without it."""


def add_quant_options(p: argparse.ArgumentParser) -> None:
    """The quantization options of ``kiln build`` (and ``kiln eval``'s build of a source)."""
    p.add_argument(
        "--quant",
        default=None,
        choices=QUANT_ALGOS,
        help="quantize the decoder layers' linear weights (default: none)",
    )
    p.add_argument(
        "--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES, help="default: the dtype"
    )
    p.add_argument(
        "--exclude-modules",
        default="",
        help="comma list of module name patterns kept unquantized, e.g. 'layers.0.*,*.down'",
    )
    p.add_argument("--group-size", type=int, default=None, help="int4-awq group (default 128)")
    p.add_argument(
        "--sq-alpha",
        type=float,
        default=None,
        help=f"SmoothQuant alpha in [0, 1] (w8a8-sq; fp8 --activation-scheme smooth; "
        f"{DEFAULT_SQ_ALPHA})",
    )
    p.add_argument(
        "--activation-scheme",
        default=None,
        choices=ACTIVATION_SCHEMES,
        help="fp8 activations: outliers (the default): per token with each projection's "
        "--act-outliers channels of largest calibrated amax carried in two fp8 parts; "
        "dynamic: per token (fastest); static: per tensor (calibrated); smooth: per token "
        "after SmoothQuant's migration (strength --sq-alpha); block: per token and 128 "
        "channels, weights per 128 x 128 tile",
    )
    p.add_argument("--act-outliers", type=int, default=None,
                   help="channels split in two with --activation-scheme outliers (a multiple "
                        "of 8; 64)")  # fmt: skip
    p.add_argument("--outlier-modules", default="",
                   help="with --activation-scheme outliers: comma list of the projections it "
                        "applies to, e.g. '*.mlp.down' (default: all)")  # fmt: skip
    p.add_argument(
        "--act-scale-search",
        type=int,
        default=0,
        choices=ACT_SCALE_SEARCHES,
        help="fp8 per-token activations: candidate scales amax/448 * (1 + j/N) each token "
        "(with --activation-scheme block, each 128-channel group) tries, keeping the least "
        "squared rounding error of its 4 largest values (0: amax/448)",
    )
    p.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="quantize lm_head too (fp8, int8-wo, int4-awq; GPTQ as the layers, no AWQ)",
    )
    p.add_argument(
        "--calib-text",
        default=None,
        help="UTF-8 text file for calibration (at least 16 tokens; repeated to --calib-tokens)",
    )
    p.add_argument(
        "--calib-tokens",
        type=int,
        default=DEFAULT_CALIB_TOKENS,
        help=f"tokens of calibration text (default {DEFAULT_CALIB_TOKENS}; more: slower build)",
    )
    p.add_argument(
        "--weight-rounding",
        default=None,
        choices=WEIGHT_ROUNDINGS,
        help="fp8 / int4-awq weights: gptq (default; slower build, less loss) or nearest",
    )
    p.add_argument(
        "--kv-rotation",
        default=None,
        choices=KV_ROTATIONS,
        help="fp8 KV cache: rotate q and k by a Hadamard matrix before k is rounded "
        "(default where the head size is a power of two) or not",
    )
    p.add_argument(
        "--max-quality-loss",
        type=float,
        default=None,
        help="refuse the engine if held-out perplexity rises more than this many percent",
    )
    p.add_argument(
        "--quality-tokens", type=int, default=1024, help="held-out tokens the gate scores"
    )
    p.add_argument(
        "--auto-exclude",
        type=int,
        default=0,
        metavar="N",
        help="with --max-quality-loss: keep up to N of the costliest projections in full "
        "precision (re-measuring after each) instead of refusing (fp8, int8-wo, w8a8-sq)",
    )


def _patterns(text: str) -> tuple[str, ...]:
    """A comma-separated list of module patterns, blanks dropped."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


def quant_config_from_args(a: argparse.Namespace) -> QuantConfig:
    """The ``QuantConfig`` of parsed options (the default one where none were added)."""
    if not hasattr(a, "quant"):
        return QuantConfig()
    if a.sq_alpha is not None and not uses_sq_alpha(a.quant, a.activation_scheme):
        raise bad_value("quant.sq_alpha", a.sq_alpha, "only --quant w8a8-sq and --quant fp8 "
                        "--activation-scheme smooth use it")  # fmt: skip
    return QuantConfig(
        algo=a.quant,
        kv_cache_dtype=a.kv_cache_dtype,
        group_size=a.group_size,
        exclude_modules=_patterns(a.exclude_modules),
        activation_scheme=a.activation_scheme,
        act_outliers=a.act_outliers,
        outlier_modules=_patterns(a.outlier_modules),
        act_scale_search=a.act_scale_search,
        quantize_lm_head=a.quantize_lm_head,
        sq_alpha=a.sq_alpha,
        calib_text=a.calib_text,
        calib_tokens=a.calib_tokens,
        weight_rounding=a.weight_rounding,
        kv_rotation=a.kv_rotation,
        max_quality_loss=a.max_quality_loss,
        quality_tokens=a.quality_tokens,
        auto_exclude=a.auto_exclude,
    )


_LAYOUTS = {"awq": "AutoAWQ", "gptq": "GPTQ (v1)", "gptq_v2": "GPTQ (v2)",
            "ct_int4": "compressed-tensors", "ct_int8": "compressed-tensors",
            "ct_int8_packed": "compressed-tensors"}  # fmt: skip


def quant_desc(q: dict[str, Any]) -> str:
    """One line of ``kiln inspect``: a manifest's ``quant`` record."""
    algo = q.get("algo")
    if not algo:
        return "none"
    extra = []
    if algo == "int4-awq":
        extra.append(f"group {q.get('group_size')}")
    if algo == "fp8":
        scheme = q.get("activation_scheme", "dynamic")
        how = f" with {q.get('act_outliers')} channels split" if scheme == "outliers" else ""
        if scheme == "outliers" and q.get("outlier_modules"):
            how += f" in {','.join(q['outlier_modules'])}"
        desc = f"{scheme}{how} activations"
        if q.get("act_scale_search"):
            desc += f" (scales searched among {q['act_scale_search']} candidates)"
        extra.append(desc)
    from_ckpt = q.get("applied") == "checkpoint"
    # a checkpoint's smoothing is folded into its weights: no alpha of kiln's to report
    if uses_sq_alpha(algo, q.get("activation_scheme")) and not from_ckpt:
        extra.append(f"alpha {q.get('sq_alpha')}")
    if q.get("quantize_lm_head"):
        extra.append("lm_head too")
    if q.get("weight_rounding") == "gptq":
        extra.append("GPTQ rounding")
    r = q.get("report")
    if r:
        extra.append(f"{len(r['modules'])} modules, {len(r['excluded'])} excluded")
        before, after = r["linear_bytes_before"], r["linear_bytes_after"]
        extra.append(f"linear weights {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
    if q.get("auto_excluded"):
        extra.append(
            "kept in full precision by --auto-exclude: "
            + ", ".join(k["module"] for k in q["auto_excluded"])
        )
    if q.get("applied") == "load":
        extra.append("applied at load")
    if from_ckpt:
        layout = q.get("checkpoint_layout")
        extra.append(f"from a pre-quantized {_LAYOUTS.get(layout, layout)} checkpoint")
    qual = q.get("quality")
    if qual:
        extra.append(
            f"held-out perplexity +{qual['ppl_increase_pct']:.2f} %{_interval(qual)}, top-1 "
            f"agreement {qual['top1_agreement']:.3f}"
        )
    return f"{algo} ({', '.join(extra)})" if extra else algo


def _interval(quality: dict[str, Any]) -> str:
    ci = quality.get("ppl_increase_ci95")  # absent from engines built before it existed
    if ci and quality.get("num_windows", 2) < 2:
        return " (one window of text: no interval)"
    return f" (95 % interval {ci[0]:+.2f} to {ci[1]:+.2f})" if ci else ""


def add_kv_cache_options(p: argparse.ArgumentParser, default: Any = None) -> None:
    """The KV cache's memory share and dtype at load (``kiln serve``, ``kiln bench``);
    ``default``: every flag's default (``argparse.SUPPRESS`` for ``kiln serve``, whose
    defaults are ``ServeConfig``'s), else ``KvCacheConfig``'s fraction and auto."""
    p.add_argument(
        "--kv-cache-free-gpu-memory-fraction",
        type=float,
        default=default if default is not None else KvCacheConfig.free_gpu_memory_fraction,
        help="share of the GPU memory left after a step's peak that the KV cache takes (0.9)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=default if default is not None else "auto",
        choices=LOAD_KV_CACHE_DTYPES,
        help="fp8: an fp8 KV cache for an engine built without one (auto: the engine's)",
    )
