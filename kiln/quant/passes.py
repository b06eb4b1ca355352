"""Model-level quantization passes over the decoder layers' projections: which are targets,
replacing them with ``QuantLinear`` (``quantize_model``) or empty shells for loading
(``quant_shells``), the size report, moving activation quantization into the ops that
produce the inputs (``fuse_activation_quant``), and the load-time layouts (float16-code
tiles, padded fp8 blocks, float16 int4 scales)."""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from kiln.config import QuantConfig
from kiln.errors import ConfigError, bad_value, env_flag
from kiln.layers.linear import Linear
from kiln.quant import formats as qf
from kiln.quant.layers import TARGETS, QuantLinear

LM_HEAD = "lm_head.proj"
"""The quantized lm_head's module name (``--quantize-lm-head``)."""


def _nbytes(m: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in m.state_dict().values())


def _head_bytes(model: nn.Module) -> int:
    w = model.lm_head.dense_weight()
    return w.numel() * w.element_size()


def _quantize_head(
    model: nn.Module,
    qcfg: QuantConfig,
    shell: bool,
    rounded: tuple[torch.Tensor, ...] | None = None,
) -> QuantLinear:
    """lm_head as a ``QuantLinear`` (``qcfg.quantize_lm_head``) from the head's matrix (the
    embedding's when tied): ``rounded`` by GPTQ or to nearest; or an empty shell for
    loading."""
    head = model.lm_head
    w = head.dense_weight()
    vocab, hidden = w.shape
    if qcfg.algo == "fp8" and vocab % 16:
        raise bad_value(
            "quant.quantize_lm_head", True, f"fp8 GEMMs need a vocabulary of a multiple of 16, "
            f"this model has {vocab}; use int8-wo or int4-awq, or leave lm_head unquantized"
        )  # fmt: skip
    if shell:
        q = QuantLinear(hidden, vocab, qcfg.algo or "", dtype=w.dtype, device=w.device,
                        group_size=qcfg.group_size, act_search=qcfg.act_scale_search,
                        weight_block=qcfg.weight_block)  # fmt: skip
    else:
        lin = Linear(hidden, vocab, dtype=w.dtype, device="meta")
        lin.weight = nn.Parameter(w, requires_grad=False)
        q = QuantLinear.from_linear(lin, qcfg.algo or "", qcfg.group_size, rounded=rounded,
                                    act_search=qcfg.act_scale_search,
                                    weight_block=qcfg.weight_block)  # fmt: skip
    head.set_proj(q)
    return q


def is_excluded(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def quant_targets(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, Linear]]:
    """(name, parent, attribute, Linear) of every replaceable projection, in order."""
    for name, m in list(model.named_modules()):
        parts = name.split(".")
        if (
            isinstance(m, Linear)
            and len(parts) == 4
            and parts[0] == "layers"
            and ".".join(parts[2:]) in TARGETS
        ):
            yield name, model.get_submodule(".".join(parts[:-1])), parts[-1], m


def check_options_fit(model: nn.Module, qcfg: QuantConfig) -> None:
    """Refuse, before a build does any work, options this model's projections cannot take
    (``model`` may be on "meta"): a module pattern that matches none of them, and an int4
    group size that does not divide the input size of one it would quantize."""
    sizes = {name: lin.in_features for name, _, _, lin in quant_targets(model)}
    if qcfg.quantize_lm_head:
        sizes[LM_HEAD] = model.lm_head.dense_weight().shape[1]
    some = ", ".join(list(sizes)[:3] + [f"layers.0.{t}" for t in TARGETS[3:]])
    for field, patterns in (("exclude_modules", qcfg.exclude_modules),
                            ("outlier_modules", qcfg.outlier_modules)):  # fmt: skip
        for pat in patterns:
            if not any(fnmatch.fnmatchcase(n, pat) for n in sizes):
                raise bad_value(
                    f"quant.{field}", pat, f"a pattern matching a quantized projection's name "
                    f"(names are like {some}; lm_head.proj with --quantize-lm-head)"
                )  # fmt: skip
    gs = qcfg.group_size
    if qcfg.algo != "int4-awq" or gs is None:
        return
    ks = sorted({k for n, k in sizes.items() if not is_excluded(n, qcfg.exclude_modules)})
    if any(k % gs for k in ks):
        fits = [g for g in (128, 64, 32, 16) if all(k % g == 0 for k in ks)]
        hint = f"--group-size {fits[0]} fits" if fits else "exclude the projections it does not"
        raise bad_value(
            "quant.group_size", gs, f"it must divide the input size of every projection "
            f"int4 quantizes ({', '.join(map(str, ks))} in this model); {hint}"
        )  # fmt: skip


def _act_outliers(qcfg: QuantConfig, name: str, k: int) -> int | None:
    """How many outlier channels fp8 "outliers" activations split for projection ``name``
    (``k`` input channels): None for other schemes and projections it leaves out. At most
    an eighth of the inputs, in multiples of 8 (small models' narrow projections split
    fewer; none below 64 inputs)."""
    if qcfg.activation_scheme != "outliers":
        return None
    if qcfg.outlier_modules and not is_excluded(name, qcfg.outlier_modules):
        return None
    return outlier_count(qcfg.act_outliers or 0, k) or None


def outlier_count(requested: int, k: int) -> int:
    """The outlier channels a projection of ``k`` inputs splits when ``requested`` are
    asked for: at most an eighth of the inputs, in multiples of 8 (0 below 64 inputs).
    The build's fp8 tuner times the same widened shapes (``kiln.build.tuning``)."""
    return min(requested, k // 64 * 8)


def outlier_channels(
    qcfg: QuantConfig,
    act_stats: dict[str, dict[str, torch.Tensor]] | None,
    name: str,
    k: int,
) -> torch.Tensor | None:
    """fp8 "outliers" activations: the input channels of projection ``name`` (``k``
    inputs) carried in two e4m3 parts, those of largest calibrated amax, ascending; None
    for other schemes."""
    n = _act_outliers(qcfg, name, k)
    if n is None:
        return None
    if not act_stats or name not in act_stats:
        raise ConfigError(
            f"fp8 with outlier channels needs calibration statistics for {name}; none were "
            "collected."
        )
    return act_stats[name]["channel_amax"].float().topk(n).indices.sort().values


def _check(model: nn.Module, qcfg: QuantConfig) -> list[tuple[str, nn.Module, str, Linear]]:
    if qcfg.algo is None:
        raise bad_value("quant.algo", None, "quantize_model needs an algorithm")
    targets = list(quant_targets(model))
    for name, _, _, lin in targets:
        gs = qcfg.group_size
        if qcfg.algo == "int4-awq" and gs and lin.in_features % gs:
            raise bad_value(
                "quant.group_size",
                gs,
                f"it must divide in_features={lin.in_features} of {name}; pick a divisor or "
                f"--exclude-modules '{name}'",
            )
    return targets


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    qcfg: QuantConfig,
    act_stats: dict[str, dict[str, torch.Tensor]] | None = None,
    input_scales: dict[str, torch.Tensor] | None = None,
    rounded: dict[str, tuple[torch.Tensor, ...]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Replace, in place, every decoder-layer projection not matched by
    ``qcfg.exclude_modules`` with a ``QuantLinear``. ``act_stats[name]["amax"]`` (max |x|
    seen at the module's input) is required for fp8 with static activations;
    ``input_scales[name]`` are AWQ / SmoothQuant factors (K,); ``rounded[name]`` a weight
    already quantized by GPTQ (``QuantLinear.from_linear``). Returns per module
    ``{"mode", "bytes_before", "bytes_after"}`` (mode "none" for excluded ones)."""
    static = qcfg.algo == "fp8" and qcfg.activation_scheme == "static"
    report: dict[str, dict[str, Any]] = {}
    for name, parent, attr, lin in _check(model, qcfg):
        before = _nbytes(lin)
        if is_excluded(name, qcfg.exclude_modules):
            report[name] = {"mode": "none", "bytes_before": before, "bytes_after": before}
            continue
        amax = None
        if static:
            if not act_stats or name not in act_stats:
                raise ConfigError(
                    f"fp8 with static activation scales needs calibration statistics for "
                    f"{name}; none were collected."
                )
            amax = act_stats[name]["amax"]
        smooth = (input_scales or {}).get(name)
        r = (rounded or {}).get(name)
        outliers = outlier_channels(qcfg, act_stats, name, lin.in_features)
        q = QuantLinear.from_linear(
            lin,
            qcfg.algo,
            qcfg.group_size,
            amax,
            smooth,
            r,
            outlier_channels=outliers,
            act_search=qcfg.act_scale_search,
            weight_block=qcfg.weight_block,
        )
        setattr(parent, attr, q)
        report[name] = {"mode": qcfg.algo, "bytes_before": before, "bytes_after": _nbytes(q)}
    if qcfg.quantize_lm_head:
        before = _head_bytes(model)
        q = _quantize_head(model, qcfg, shell=False, rounded=(rounded or {}).get(LM_HEAD))
        report[LM_HEAD] = {"mode": qcfg.algo, "bytes_before": before, "bytes_after": _nbytes(q)}
    return report


def quant_shells(model: nn.Module, qcfg: QuantConfig, names: list[str] | None = None) -> None:
    """Replace the projections that ``quantize_model`` would quantize (or exactly ``names``)
    with empty ``QuantLinear`` modules on the same device, e.g. on "meta" before
    ``load_state_dict(assign=True)`` of a quantized engine."""
    static = qcfg.algo == "fp8" and qcfg.activation_scheme == "static"
    for name, parent, attr, lin in _check(model, qcfg):
        wanted = name in names if names is not None else not is_excluded(name, qcfg.exclude_modules)
        if not wanted:
            continue
        shell = QuantLinear(
            lin.in_features,
            lin.out_features,
            qcfg.algo or "",
            bias=lin.bias is not None,
            dtype=lin.weight.dtype,
            device=lin.weight.device,
            group_size=qcfg.group_size,
            static_input=static,
            act_outliers=_act_outliers(qcfg, name, lin.in_features),
            smooth=qcfg.algo == "fp8" and qcfg.activation_scheme == "smooth",
            act_search=qcfg.act_scale_search,
            weight_block=qcfg.weight_block,
        )
        setattr(parent, attr, shell)
    if (LM_HEAD in names) if names is not None else qcfg.quantize_lm_head:
        _quantize_head(model, qcfg, shell=True)


def summarize(report: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The manifest's record of a ``quantize_model`` report."""
    quantized = [n for n, r in report.items() if r["mode"] != "none"]
    before = sum(r["bytes_before"] for r in report.values())
    after = sum(r["bytes_after"] for r in report.values())
    modes: dict[str, int] = {}
    for r in report.values():
        modes[r["mode"]] = modes.get(r["mode"], 0) + 1
    return {
        "modules": quantized,
        "excluded": [n for n in report if n not in quantized],
        "modes": modes,
        "linear_bytes_before": before,
        "linear_bytes_after": after,
    }


def shell_report(model: nn.Module, qcfg: QuantConfig) -> dict[str, dict[str, Any]]:
    """The report ``quantize_model`` would give, from shapes alone (the model may be on
    "meta"): for dummy engines, whose weights are quantized when they load."""
    before = {name: _nbytes(lin) for name, _, _, lin in quant_targets(model)}
    if qcfg.quantize_lm_head:
        before[LM_HEAD] = _head_bytes(model)
    quant_shells(model, qcfg)
    report = {}
    for name, m in model.named_modules():
        if name in before:
            mode = m.algo if isinstance(m, QuantLinear) else "none"
            report[name] = {"mode": mode, "bytes_before": before[name], "bytes_after": _nbytes(m)}
    return report


def fuse_activation_quant(model: nn.Module, enable: bool = True) -> int:
    """Move the per-token activation quantization of every fp8 (dynamic) / w8a8-sq
    projection into the op that produces its input: attn_norm for attn.qkv, mlp_norm for
    mlp.gate_up, SiLU-mul for mlp.down (attn.o quantizes its own input). The arithmetic is
    unchanged (the fused kernels reproduce the unfused sequence); on CUDA it saves a pass
    over the activation and a launch per projection. Returns the number of fusions."""
    fused = 0
    for layer in getattr(model, "layers", []):
        pairs = [(layer.attn_norm, layer.attn.qkv), (layer.mlp_norm, layer.mlp.gate_up)]
        for norm, proj in pairs:
            ok = enable and isinstance(proj, QuantLinear) and proj.act_kind is not None
            norm.quantize_output_for(proj if ok else None)
            fused += ok
        down = layer.mlp.down
        layer.mlp.fuse_down_quant = (
            enable and isinstance(down, QuantLinear) and down.act_kind is not None
        )
        fused += layer.mlp.fuse_down_quant
    return fused


def tile_f16_weights(model: nn.Module, enable: bool | None = None) -> int:
    """Give every int4 projection whose producer can write its input prepared (attn.qkv
    after attn_norm, mlp.gate_up after mlp_norm, mlp.down after SiLU·mul, the quantized
    head after the final norm, in the decode graphs: ``head_input``) and whose tuned
    one-row pick is the float16-code kernel its tile-major words and ``f16_rows``
    (``kiln.kernels.wq_tiled``), and point its producer at it. The loader calls it on the
    GPU after the engine's tuning is active. ``enable`` False (default:
    ``wq_f16.ENABLED``, off with ``KILN_WQ_F16=0``) tiles nothing; ``KILN_WQ_F16_HEAD=0``
    leaves the head out (``wq_f16.HEAD``). Returns how many it tiled."""
    from kiln.kernels.wq_f16 import ENABLED, HEAD
    from kiln.kernels.wq_tiled import f16_rows

    on = ENABLED if enable is None else enable
    tiled = 0

    def rows(proj: nn.Module) -> int:
        if not on or not isinstance(proj, QuantLinear) or not proj.f16_ok():
            return 0
        return f16_rows(proj.out_features, proj.in_features, proj.group_size)

    for layer in getattr(model, "layers", []):
        pairs = [(layer.attn_norm, layer.attn.qkv), (layer.mlp_norm, layer.mlp.gate_up)]
        for norm, proj in pairs:
            if (r := rows(proj)) and not proj.f16_rows:
                proj.tile_for_f16(r)
                tiled += 1
            norm.prepare_output_for(proj if getattr(proj, "f16_rows", 0) else None)
        down = layer.mlp.down
        if (r := rows(down)) and not down.f16_rows:
            down.tile_for_f16(r)
            tiled += 1
    head = getattr(getattr(model, "lm_head", None), "proj", None) if HEAD else None
    if hasattr(model, "norm"):  # its output is the head's input in the decode graphs only
        if (r := rows(head)) and not head.f16_rows:
            head.tile_for_f16(r)
            tiled += 1
        model.norm.prepare_output_for(head if getattr(head, "f16_rows", 0) else None)
    return tiled


def pad_block_weights(model: nn.Module) -> int:
    """Pad once, on the GPU, every fp8 "block" projection whose shape cuBLAS's block-scaled
    GEMM does not take as it is (``QuantLinear.pad_block_weight``). Returns how many."""
    padded = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear) and mod.weight_block and mod.weight.is_cuda:
            mod.pad_block_weight()
            padded += mod.block_padded is not None
    return padded


SCALE16 = env_flag(os.environ, "KILN_INT4_SCALE16", True)
"""Whether loads hold int4 group scales in float16 where that is exact
(``compact_int4_scales``; ``KILN_INT4_SCALE16=0``: float32, an A/B on one engine; another
value is a ``ConfigError`` naming it)."""


def compact_int4_scales(model: nn.Module, enable: bool | None = None) -> int:
    """Hold every int4 projection's group scales in float16 where no value changes. Engines
    store them so since 2026-12-06 (on float16's grid: ``formats.int4_fit``; converted
    AWQ / GPTQ checkpoints keep theirs); this turns the float32 scales of engines built
    before into float16 where they are on the grid. A one-row step then reads 3 bytes of
    scale and zero a group and row of 128 codes (64 bytes) in place of 5; the kernels
    widen them to float32 and the references take them as they are, so no product
    changes. ``enable`` (default ``SCALE16``) False widens every int4 projection's float16
    scales to float32 instead (the A/B). Returns how many changed dtype."""
    on = SCALE16 if enable is None else enable
    done = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear) and mod.algo == "int4-awq":
            s = mod.weight_scale
            want = qf.int4_scale_storage(s) if on else s.float()
            if want.dtype != s.dtype:
                mod.weight_scale = want
                done += 1
    return done
