"""``kiln build``: checkpoint -> engine directory for one target."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

import kiln
from kiln.build.engine_dir import FORMAT_VERSION, MANIFEST, write_manifest
from kiln.build.names import convert
from kiln.build.prequant import convert_prequantized
from kiln.build.target import (
    DTYPE_BY_NAME,
    describe_target,
    dtype_supported,
    resolve_device,
    resolve_dtype,
)
from kiln.build.tuning import write_tuning
from kiln.build.tuning_cache import cached_tune
from kiln.checkpoint import Checkpoint, open_checkpoint
from kiln.config import BuildConfig, uses_sq_alpha
from kiln.errors import CheckpointError, ConfigError, bad_value
from kiln.kernels.hadamard import kv_rotation_allowed
from kiln.layers.attention import set_kv_rotation
from kiln.models import build_model
from kiln.quant.auto_exclude import keep_costliest
from kiln.quant.build import (
    enforce_quality_limit,
    measure_quality,
    model_on,
    quant_model_on,
    quantize_state,
)
from kiln.quant.calibration import calibration_token_ids, read_calib_text
from kiln.quant.passes import check_options_fit, shell_report, summarize
from kiln.runtime.kv_cache import calibrate_kv_scales
from kiln.tokenizer import HFTokenizer

KV_CALIB_TOKENS = 2048
"""Most calibration tokens the fp8 KV cache's scales are computed from (one sequence, so
no more than the model's positions; the figures in docs/quantization.md used 2,048)."""


def build_engine(
    source: str | Checkpoint,
    output: str | Path,
    cfg: BuildConfig | None = None,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Build ``source`` into the engine directory ``output`` and return its manifest.
    The directory appears atomically: a failed build leaves nothing behind."""
    t0 = time.perf_counter()
    cfg = cfg or BuildConfig()

    def stage(msg: str) -> None:
        if progress:
            tqdm.write(f"[kiln build {time.perf_counter() - t0:6.1f} s] {msg}", file=sys.stderr)

    stage(f"reading {source if isinstance(source, str) else source.source}")
    ckpt = open_checkpoint(source) if isinstance(source, str) else source
    model_cfg = ckpt.config
    device = resolve_device(cfg.device)
    target = describe_target(device)
    dtype = resolve_dtype(cfg.dtype, ckpt.default_dtype, device)
    if reason := dtype_supported(dtype, target):
        raise ConfigError(
            f"dtype={dtype!r} cannot run on this device: {reason}; use --dtype float16."
        )
    limits = {
        "max_batch_size": cfg.max_batch_size,
        "max_seq_len": cfg.resolved_max_seq_len(model_cfg),
        "max_num_tokens": cfg.max_num_tokens,
    }
    calib_text = _check_quant_options(ckpt, cfg, dtype)
    out = Path(output).expanduser().resolve()
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise ConfigError(
            f"output directory {str(out)!r} exists and is not an engine; choose an empty or new "
            "directory."
        )
    tmp = out.parent / f".{out.name}.building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        stage("writing tokenizer")
        has_tokenizer = ckpt.save_tokenizer(tmp / "tokenizer")
        quant: dict[str, Any] = dataclasses.asdict(cfg.quant)
        kv_fp8 = cfg.quant.kv_cache_dtype == "fp8"
        # the KV cache scales come from one sequence: at most KV_CALIB_TOKENS positions
        kv_calib_tokens = min(cfg.quant.calib_tokens, KV_CALIB_TOKENS)
        # an fp8 cache calibrated here is calibrated (and run) with q and k rotated
        rotate = kv_fp8 and cfg.quant.kv_rotation != "none"
        if ckpt.kind == "dummy":
            weights: dict[str, Any] = {"kind": "dummy", "seed": seed}
            if cfg.quant.algo is not None:
                model = build_model(model_cfg, DTYPE_BY_NAME[dtype], "meta")
                quant["applied"] = "load"  # dummy weights are generated, then quantized
                if quant.get("weight_rounding"):  # ... to nearest: no calibration at load
                    quant["weight_rounding"] = "nearest"
                quant["report"] = summarize(shell_report(model, cfg.quant))
        else:
            stage(f"converting {model_cfg.architecture} weights to {dtype}")
            if ckpt.quant is not None:
                state, quant = _load_prequantized(ckpt, cfg, DTYPE_BY_NAME[dtype], progress)
                if kv_fp8:
                    stage("calibrating the fp8 KV cache's per-layer scales")
                    tok = HFTokenizer(tmp / "tokenizer") if has_tokenizer else None
                    ids = calibration_token_ids(
                        tok, cfg.quant.calib_text, kv_calib_tokens, text=calib_text
                    )
                    qmodel = quant_model_on(model_cfg, state, ckpt.quant, device)
                    set_kv_rotation(qmodel, rotate, DTYPE_BY_NAME[dtype])
                    quant["kv_scales"] = calibrate_kv_scales(qmodel, ids)
                    del qmodel
            else:
                state = _convert_weights(ckpt, DTYPE_BY_NAME[dtype], progress)
            if ckpt.quant is None and (cfg.quant.algo is not None or kv_fp8):
                tok = HFTokenizer(tmp / "tokenizer") if has_tokenizer else None
                # the text read and tokenized once: the weights calibrate on all of it, the
                # KV cache on its first kv_calib_tokens (a prefix: see calibration_token_ids)
                n_calib = cfg.quant.calib_tokens if cfg.quant.algo is not None else kv_calib_tokens
                calib_ids = calibration_token_ids(
                    tok, cfg.quant.calib_text, n_calib, text=calib_text
                )
                ids = calib_ids[:kv_calib_tokens]
                report: dict[str, Any] = {}
                if cfg.quant.algo is not None:
                    stage(f"quantizing to {cfg.quant.algo}")
                    qstate, report, qmodel = quantize_state(
                        model_cfg, state, cfg.quant, tok, device, calib_ids
                    )
                    quant["applied"] = "build"
                    quant["report"] = summarize(report)
                else:
                    qstate, qmodel = state, model_on(model_cfg, state, device)
                if kv_fp8:
                    stage("calibrating the fp8 KV cache's per-layer scales")
                    set_kv_rotation(qmodel, rotate, DTYPE_BY_NAME[dtype])
                    quant["kv_scales"] = calibrate_kv_scales(qmodel, ids)
                stage("measuring quality on held-out text")
                kv_ids = ids if kv_fp8 else None
                quant["quality"] = _quality_gate(
                    model_cfg, cfg, state, qstate, qmodel, report, tok, limits, quant, kv_ids,
                    device, stage,
                )  # fmt: skip
                del qmodel
                state = qstate
            save_file(state, str(tmp / "rank0.safetensors"), metadata={"format": "pt"})
            del state
            weights = {"kind": "safetensors", "ranks": ["rank0.safetensors"]}
        # what the engine runs with: "hadamard" where the head size allowed it
        quant["kv_rotation"] = (
            "hadamard" if rotate and kv_rotation_allowed(model_cfg.head_dim) else "none"
        )
        stage("tuning kernels" if device == "cuda" else "recording default kernel settings")
        # a pre-quantized checkpoint's kernels are tuned for its own quantization (the
        # build's options name none of it); its unconverted modules may stay dense
        tune_quant, dense = cfg.quant, True
        if ckpt.quant is not None:
            tune_quant = dataclasses.replace(
                ckpt.quant, kv_cache_dtype=cfg.quant.kv_cache_dtype,
                act_scale_search=cfg.quant.act_scale_search,
            )  # fmt: skip
        elif cfg.quant.algo is not None:
            dense = bool(cfg.quant.exclude_modules) or cfg.quant.auto_exclude > 0
        tuning = cached_tune(model_cfg, DTYPE_BY_NAME[dtype], device, limits, tune_quant,
                             reuse=cfg.reuse_tuning, dense_layers=dense)  # fmt: skip
        if tuning.get("reused"):
            stage(f"kernel tuning reused from {tuning['reused']['path']} (--no-tuning-cache "
                  "times the kernels again)")  # fmt: skip
        write_tuning(tmp, tuning)
        stage("hashing files")
        manifest = {
            "format_version": FORMAT_VERSION,
            "kiln_version": kiln.__version__,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "source": {"kind": ckpt.kind, "model": ckpt.source},
            "model": model_cfg.to_dict(),
            "dtype": dtype,
            "quant": quant,
            "mapping": dataclasses.asdict(cfg.mapping),
            "limits": limits,
            "target": target,
            "weights": weights,
            "tokenizer": "tokenizer" if has_tokenizer else None,
            "build": {"wall_time_s": round(time.perf_counter() - t0, 3)},
        }
        manifest = write_manifest(tmp, manifest)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        stage(f"done: {out}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _quality_gate(
    model_cfg: Any,
    cfg: BuildConfig,
    state: dict[str, torch.Tensor],
    qstate: dict[str, torch.Tensor],
    qmodel: torch.nn.Module,
    report: dict[str, Any],
    tok: Any,
    limits: dict[str, int],
    quant: dict[str, Any],
    kv_ids: list[int] | None,
    device: str,
    stage: Any,
) -> dict[str, Any]:
    """The build's quality measurement; past ``--max-quality-loss``, either a refusal or,
    with ``--auto-exclude N``, up to N of the costliest projections kept in full precision
    (``qmodel``, ``qstate``, ``report`` and ``quant`` updated; kiln/quant/auto_exclude.py)."""
    q = cfg.quant
    auto = q.auto_exclude > 0 and q.max_quality_loss is not None

    def measure(recalibrate: bool = True) -> dict[str, Any]:
        if recalibrate and kv_ids is not None:  # the cache's scales follow the model
            quant["kv_scales"] = calibrate_kv_scales(qmodel, kv_ids)
        return measure_quality(
            model_cfg, state, qmodel, q, report, tok, limits, quant.get("kv_scales"),
            enforce=not auto,
        )  # fmt: skip

    quality = measure(recalibrate=False)  # the scales were just calibrated on this model
    if not auto or quality["ppl_increase_pct"] <= q.max_quality_loss:
        return quality
    stage(f"keeping up to {q.auto_exclude} of the costliest projections in full precision")
    ref = model_on(model_cfg, state, device)
    quality, kept = keep_costliest(
        qmodel, qstate, ref, state, report, q.max_quality_loss, q.auto_exclude, measure, quality
    )
    quant["auto_excluded"] = kept
    quant["exclude_modules"] = [*quant["exclude_modules"], *(k["module"] for k in kept)]
    quant["report"] = summarize(report)
    enforce_quality_limit(quality, q, kept)
    return quality


def _convert_weights(
    ckpt: Checkpoint, dtype: torch.dtype, progress: bool
) -> dict[str, torch.Tensor]:
    cfg = ckpt.config
    want = {k: tuple(v.shape) for k, v in build_model(cfg, dtype, "meta").state_dict().items()}
    total = len(ckpt.tensor_names())
    state: dict[str, torch.Tensor] = {}
    stream = tqdm(
        ckpt.tensors(),
        total=total,
        desc="converting",
        unit="tensor",
        disable=not progress,
        leave=False,
    )
    for name, t in convert(cfg, stream):
        if tuple(t.shape) != want[name]:
            raise CheckpointError(
                f"tensor {name} has shape {tuple(t.shape)} but the config implies {want[name]}; "
                "the weights do not match config.json."
            )
        state[name] = t.to(dtype).contiguous()
    return state


def _check_quant_options(ckpt: Checkpoint, cfg: BuildConfig, dtype: str) -> str | None:
    """The quantization options checked against the model before any work: module patterns
    and the int4 group size against its projections (a meta model), and the calibration
    text where the build reads one. Returns that text (read here, once), else None."""
    q = cfg.quant
    if q.algo is not None and ckpt.quant is None:
        check_options_fit(build_model(ckpt.config, DTYPE_BY_NAME[dtype], "meta"), q)
    # checked at build only: a manifest that records such a value still loads
    if q.sq_alpha is not None and not uses_sq_alpha(q.algo, q.activation_scheme):
        raise bad_value("quant.sq_alpha", q.sq_alpha,
                        "only w8a8-sq and fp8 with smooth activations use it")  # fmt: skip
    calibrates = ckpt.kind != "dummy" and (q.algo is not None or q.kv_cache_dtype == "fp8")
    if q.calib_text is not None:
        if ckpt.kind == "dummy":
            why = "None for dummy: models (random weights, nothing calibrated)"
            raise bad_value("quant.calib_text", q.calib_text, why)
        if not calibrates:
            why = "None unless --quant or --kv-cache-dtype fp8 calibrates"
            raise bad_value("quant.calib_text", q.calib_text, why)
        return read_calib_text(q.calib_text)  # exists, UTF-8, not blank: before conversion
    return None


def _load_prequantized(
    ckpt: Checkpoint, cfg: BuildConfig, dtype: torch.dtype, progress: bool
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A pre-quantized checkpoint's engine state and the manifest's quant record."""
    assert ckpt.quant is not None
    if cfg.quant.algo not in (None, ckpt.quant.algo):
        raise ConfigError(
            f"the checkpoint is already quantized ({ckpt.quant.algo}); build it without "
            f"--quant {cfg.quant.algo}, or from the unquantized model."
        )
    asked = cfg.quant.activation_scheme
    if cfg.quant.scheme_given and asked != ckpt.quant.activation_scheme:
        raise ConfigError(
            f"the checkpoint is already quantized with {ckpt.quant.activation_scheme} "
            f"activation scales; --activation-scheme {asked} needs the unquantized model."
        )
    if cfg.quant.quantize_lm_head:
        raise ConfigError(
            f"the checkpoint is already quantized ({ckpt.quant.algo}) with lm_head "
            "unquantized; --quantize-lm-head needs the unquantized model."
        )
    # runtime activation options apply to the checkpoint's scheme (the config refuses a
    # scale search with static activation scales, naming the field)
    qcfg = dataclasses.replace(ckpt.quant, kv_cache_dtype=cfg.quant.kv_cache_dtype,
                               act_scale_search=cfg.quant.act_scale_search)  # fmt: skip
    want = {
        k: tuple(v.shape) for k, v in build_model(ckpt.config, dtype, "meta").state_dict().items()
    }
    stream = tqdm(
        ckpt.tensors(),
        total=len(ckpt.tensor_names()),
        desc="converting",
        unit="tensor",
        disable=not progress,
        leave=False,
    )
    state, report = convert_prequantized(ckpt.config, stream, qcfg, dtype, want, ckpt.quant_layout)
    quant: dict[str, Any] = dataclasses.asdict(qcfg)
    quant["applied"] = "checkpoint"
    quant["weight_rounding"] = None  # rounded by whoever quantized the checkpoint
    quant["checkpoint_layout"] = ckpt.quant_layout
    quant["report"] = summarize(report)
    return state, quant
