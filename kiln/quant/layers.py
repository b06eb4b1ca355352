"""``QuantLinear`` and the pass that swaps the decoder layers' ``Linear`` modules for it.

State of a ``QuantLinear`` (stable names; they are the engine file's tensor names):

=============  ==========================  ==========================================
name           dtype                       shape
=============  ==========================  ==========================================
weight         float8_e4m3fn / int8        (N, K)   fp8, int8-wo, w8a8-sq
weight         uint8 (two int4 per byte)   (N, K/2) int4-awq
weight_scale   float32                     (N,) or (N, K/G) for int4-awq
weight_zero    uint8 (0..15)               (N, K/G) int4-awq only
input_scale    float32                     ()       fp8 with static activations only
smooth         float32                     (K,)     int4-awq, w8a8-sq (ones: no smoothing)
bias           engine dtype                (N,)     when the projection has one
=============  ==========================  ==========================================

``smooth`` is the per-input-channel factor ``s`` of AWQ / SmoothQuant: the stored weight
quantizes ``w * s[None, :]`` and forward computes ``x / s``. The factors themselves come
from the algorithms (``input_scales``); without them int4-awq is round-to-nearest int4 and
w8a8-sq is w8a8 without smoothing."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from kiln.config import DEFAULT_ACT_GROUP_SIZE, QuantConfig
from kiln.errors import ConfigError, bad_value
from kiln.kernels.quant_act import QuantAct
from kiln.kernels.wq_gemm import wq_linear
from kiln.layers.linear import Linear
from kiln.quant import formats as qf
from kiln.quant.formats import quantize_act

TARGETS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
"""Projections of every decoder layer that quantization replaces (``layers.{i}.<target>``)."""

_STORAGE = {
    "fp8": qf.FP8_DTYPE,
    "int8-wo": torch.int8,
    "w8a8-sq": torch.int8,
    "int4-awq": torch.uint8,
}


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W stored quantized (see the module docstring for the layout).
    CPU: the float32 references of ``kiln.quant.formats``; CUDA: the ``*_cuda`` paths."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        algo: str,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        group_size: int | None = None,
        static_input: bool = False,
        act_group: int | None = None,
    ) -> None:
        super().__init__()
        if algo not in _STORAGE:
            raise bad_value("quant.algo", algo, f"one of {', '.join(_STORAGE)}")
        if act_group is not None and (algo != "fp8" or static_input or in_features % act_group):
            raise bad_value(
                "quant.act_group_size",
                act_group,
                f"fp8 with dynamic activations and a divisor of in_features={in_features}",
            )
        self.in_features, self.out_features, self.algo = in_features, out_features, algo
        # fp8 "group" activations: one scale per token and per act_group input channels
        self.act_group = act_group
        self.out_dtype = dtype or torch.get_default_dtype()  # of outputs from QuantAct inputs
        self.group_size = group_size if algo == "int4-awq" else None
        n, k = out_features, in_features
        f32 = dict(dtype=torch.float32, device=device)
        cols = k // 2 if algo == "int4-awq" else k
        self.weight = nn.Parameter(
            torch.empty(n, cols, dtype=_STORAGE[algo], device=device), requires_grad=False
        )
        for name in ("weight_zero", "input_scale", "smooth"):
            self.register_buffer(name, None)  # set below when the mode has it
        if algo == "int4-awq":
            if not group_size or k % group_size:
                raise bad_value("quant.group_size", group_size, f"it must divide in_features={k}")
            groups = k // group_size
            self.register_buffer("weight_scale", torch.empty(n, groups, **f32))
            self.register_buffer(
                "weight_zero", torch.empty(n, groups, dtype=torch.uint8, device=device)
            )
        else:
            self.register_buffer("weight_scale", torch.empty(n, **f32))
        if static_input:
            self.register_buffer("input_scale", torch.empty((), **f32))
        if algo in ("int4-awq", "w8a8-sq"):
            self.register_buffer("smooth", torch.empty(k, **f32))
        # whether the smoothing factors do anything (all ones: skipped at run time), and
        # their reciprocals for the weight-only kernels; kept by ``refresh_smooth``
        self.smooth_active = self.smooth is not None
        self.register_buffer("smooth_inv", None, persistent=False)
        self.register_load_state_dict_post_hook(lambda mod, _keys: mod.refresh_smooth())
        self.bias = (
            nn.Parameter(torch.empty(n, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    @classmethod
    @torch.no_grad()
    def from_linear(
        cls,
        lin: Linear,
        algo: str,
        group_size: int | None = None,
        input_amax: torch.Tensor | float | None = None,
        smooth: torch.Tensor | None = None,
        rounded: tuple[torch.Tensor, ...] | None = None,
        act_group: int | None = None,
    ) -> QuantLinear:
        """Quantize ``lin``. ``input_amax`` (fp8 static) is the calibrated max |x|;
        ``smooth`` (int4-awq, w8a8-sq) the per-input-channel factors, (K,). ``rounded``: the
        weight already quantized by a rounding algorithm (GPTQ, kiln/quant/gptq.py) from
        ``lin.weight * smooth``, as (weight, scale) or for int4 (unpacked q, scale, zero) in
        the layouts of ``kiln.quant.formats``; None rounds to nearest here. ``act_group``:
        fp8 activations quantized per token and group of that many input channels."""
        w = lin.weight
        q = cls(
            lin.in_features,
            lin.out_features,
            algo,
            bias=lin.bias is not None,
            dtype=w.dtype,
            device=w.device,
            group_size=group_size,
            static_input=input_amax is not None,
            act_group=act_group,
        )
        wf = w.float()
        if q.smooth is not None:
            s = torch.ones(lin.in_features) if smooth is None else smooth.float().reshape(-1)
            if s.shape != (lin.in_features,) or not bool((s > 0).all()):
                raise ConfigError(
                    f"smoothing factors must be {lin.in_features} positive values; got shape "
                    f"{tuple(s.shape)}."
                )
            q.smooth.copy_(s)
            wf = wf * q.smooth[None, :]
        if rounded is not None:
            if algo not in ("fp8", "int4-awq"):
                raise ConfigError(f"no rounding algorithm is wired for {algo} weights.")
            wq, ws = rounded[0], rounded[1]
            if algo == "int4-awq":
                q.weight_zero.copy_(rounded[2])
                wq = qf.pack_int4(wq)
        elif algo == "fp8":
            wq, ws = qf.quantize_fp8_weight(wf)
        elif algo == "int4-awq":
            u, ws, zero = qf.quantize_int4(wf, q.group_size or 0)
            wq = qf.pack_int4(u)
            q.weight_zero.copy_(zero)
        else:
            wq, ws = qf.quantize_int8_weight(wf)
        q.weight.copy_(wq)
        q.weight_scale.copy_(ws)
        if q.input_scale is not None:
            q.input_scale.copy_(qf.fp8_static_scale(torch.as_tensor(input_amax).float()))
        if lin.bias is not None:
            q.bias.copy_(lin.bias)
        q.refresh_smooth()
        return q

    @torch.no_grad()
    def refresh_smooth(self) -> None:
        """Call after setting ``smooth`` (loading does): identity factors (all ones, as
        AWQ's are once folded into the producer of x) are skipped at run time."""
        s = self.smooth
        self.smooth_active = s is not None and not s.is_meta and bool((s != 1).any())
        # only the weight-only kernels multiply by the reciprocals (w8a8-sq divides x when
        # it quantizes it)
        wo = self.algo in ("int8-wo", "int4-awq")
        self.smooth_inv = 1.0 / s if self.smooth_active and wo else None

    @property
    def act_kind(self) -> str | None:
        """The per-token dynamic activation quantization this layer applies to its input:
        "fp8" (fp8 without a static scale), "int8" (w8a8-sq, after smoothing), or None. A
        producer may apply it instead (``QuantAct`` input; see ``fuse_activation_quant``).
        None too for fp8 "group" activations, which this layer quantizes itself."""
        if self.act_group is not None:
            return None
        if self.algo == "fp8" and self.input_scale is None:
            return "fp8"
        return "int8" if self.algo == "w8a8-sq" else None

    def forward(self, x: torch.Tensor | QuantAct) -> torch.Tensor:  # (T, in) -> (T, out)
        if self.algo in ("int8-wo", "int4-awq"):
            zero = self.weight_zero if self.algo == "int4-awq" else None
            smooth = self.smooth if self.smooth_active else None
            return wq_linear(x, self.weight, self.weight_scale, zero, smooth, self.bias,
                             smooth_inv=self.smooth_inv)  # fmt: skip
        if isinstance(x, QuantAct):  # quantized by the producer (smoothing applied there)
            if self.act_kind is None:
                raise TypeError(f"{self.algo} QuantLinear takes no pre-quantized input")
            a, dtype = x, self.out_dtype
        else:
            kind = self.act_kind or "fp8"
            a = quantize_act(x, self.input_scale, kind, self.smooth, self.act_group)
            dtype = x.dtype
        mm = qf.act_matmul_cuda if a.q.is_cuda else qf.act_matmul_ref
        return mm(a, self.weight, self.weight_scale, self.bias, dtype)

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.group_size else ""
        g += f", act_group={self.act_group}" if self.act_group else ""
        return f"{self.in_features}, {self.out_features}, algo={self.algo}{g}"


def _nbytes(m: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in m.state_dict().values())


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


def _act_group(qcfg: QuantConfig) -> int | None:
    """The activation group of fp8 "group" activations (resolved: see ``resolve_act_group``)."""
    if qcfg.activation_scheme != "group":
        return None
    return qcfg.act_group_size or DEFAULT_ACT_GROUP_SIZE


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
        q = QuantLinear.from_linear(
            lin, qcfg.algo, qcfg.group_size, amax, smooth, r, act_group=_act_group(qcfg)
        )
        setattr(parent, attr, q)
        report[name] = {"mode": qcfg.algo, "bytes_before": before, "bytes_after": _nbytes(q)}
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
            act_group=_act_group(qcfg),
        )
        setattr(parent, attr, shell)


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
