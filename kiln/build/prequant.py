"""Pre-quantized Hugging Face checkpoints onto kiln's ``QuantLinear`` layout.

Supported ``config.json`` ``quantization_config`` formats:

- ``quant_method: "fp8"`` with ``weight_block_size`` [128, 128] (the format of DeepSeek-V3's
  and Qwen3's FP8 releases): ``weight`` e4m3 (N, K) and ``weight_scale_inv`` float32 (ceil(N/128),
  ceil(K/128)), one scale per tile (multiplied, despite the name), dynamic activations:
  kiln's fp8 "block" scheme, as they are (1x128 activation scales, ``torch._scaled_mm``).
- ``quant_method: "fp8"`` (per-tensor or per-channel, no ``weight_block_size``): each
  quantized projection has ``weight`` float8_e4m3fn (N, K), ``weight_scale`` float32 () / (1,)
  per tensor or (N,) / (N, 1) per output channel (``w = weight * weight_scale``), and with
  ``activation_scheme: "static"`` an ``input_scale`` () (``x_q = x / input_scale``). kiln
  keeps one scale per row, so a per-tensor scale is repeated N times (exact).
- ``quant_method: "awq"``, ``version: "gemm"``, 4 bits with zero points (AutoAWQ):
  ``qweight`` int32 (K, N/8), ``qzeros`` int32 (K/G, N/8), ``scales`` float16 (K/G, N),
  ``w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]``. Nibble ``i`` (bits 4i..4i+3) of
  each int32 holds column ``8c + AWQ_ORDER[i]`` of its group of eight.
- ``quant_method: "gptq"``, 4 bits, ``checkpoint_format`` "gptq" (v1) or "gptq_v2"
  (AutoGPTQ, GPTQModel, optimum): ``kiln/build/prequant_gptq.py``.
- ``quant_method: "fbgemm_fp8"`` (Meta's FP8 releases): the fp8 layout's tensors with
  per-channel ``weight_scale`` (N, 1) and dynamic per-token activations. Its
  ``activation_scale_ub`` caps each token's activation amax; kiln does not cap it, so a
  token whose amax exceeds the bound is scaled to its own amax (no clipping), the one
  difference from fbgemm's arithmetic.
- ``quant_method: "compressed-tensors"`` (llm-compressor), FP8 W8A8, int8 W8A8 / W8A16 and
  int4 W4A16: ``kiln/build/prequant_ct.py``.

A projection whose tensors carry no scales stays an unquantized ``Linear`` (the
checkpoint's ignored layers). A projection bias the model has no place for is dropped when
it is all zeros (GPTQ exporters write them), else refused. Fusing q/k/v and gate/up
concatenates the rows of the weights and of their per-row scales; the fused static input
scale is the largest of the parts (the parts see the same input). Embedding, norms and
lm_head are plain tensors."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

from kiln.build.names import convert, hf_names
from kiln.build.prequant_ct import METHOD as CT_METHOD
from kiln.build.prequant_ct import ct_int4_parts, ct_int8_parts, ct_layout_and_quant
from kiln.build.prequant_gptq import (
    GPTQ_FORMATS,
    gptq_format,
    gptq_parts,
    gptq_quant,
    int32_nibbles,
)
from kiln.config import ModelConfig, QuantConfig
from kiln.errors import CheckpointError
from kiln.quant import formats as qf
from kiln.quant.layers import TARGETS

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AutoAWQ int32 holds column AWQ_ORDER[i]
_UNPACK = tuple(AWQ_ORDER.index(j) for j in range(8))  # column j sits in nibble _UNPACK[j]
_PROJ = re.compile(
    r"(model\.layers\.\d+\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj))\.(\w+)"
)
# Tensors some fp8 exporters add for their KV cache; kiln calibrates its own KV scales.
_DROPPED = re.compile(
    r"model\.layers\.\d+\.self_attn\.(?:[kv]_scale|kv_scale|[kv]_proj\.output_scale)"
)


def checkpoint_quant(hf: dict[str, Any]) -> QuantConfig | None:
    """The kiln quant config of a pre-quantized checkpoint's ``config.json`` (None when it
    has no ``quantization_config``); raises for formats kiln cannot load."""
    qc = hf.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
            raise CheckpointError(f"fp8 format {qc.get('fmt')!r} is not supported; only e4m3.")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise CheckpointError(f"fp8 activation_scheme {scheme!r} is not supported.")
        block = qc.get("weight_block_size")
        if block:
            if list(block) != [qf.FP8_BLOCK, qf.FP8_BLOCK] or scheme != "dynamic":
                raise CheckpointError(
                    f"block-wise fp8 checkpoints with weight_block_size={block} and "
                    f"activation_scheme {scheme!r} are not supported; kiln loads "
                    f"[{qf.FP8_BLOCK}, {qf.FP8_BLOCK}] tiles with dynamic activations (or use "
                    "the unquantized model with --quant fp8)."
                )
            return QuantConfig(algo="fp8", activation_scheme="block")
        return QuantConfig(algo="fp8", activation_scheme=scheme)
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        bits = qc.get("bits", qc.get("w_bit", 4))
        group = qc.get("group_size", qc.get("q_group_size", 128))
        if version != "gemm" or bits != 4 or not qc.get("zero_point", True):
            raise CheckpointError(
                f"AWQ checkpoints of version {version!r}, {bits} bits, "
                f"zero_point={qc.get('zero_point', True)} are not supported; only AutoAWQ "
                "'gemm', 4 bits, with zero points."
            )
        return QuantConfig(algo="int4-awq", group_size=int(group))
    if method == "gptq":
        return gptq_quant(qc)
    if method == CT_METHOD:
        return ct_layout_and_quant(qc)[1]
    if method == "fbgemm_fp8":  # Meta's FP8 releases: per-channel weights, per-token inputs
        return QuantConfig(algo="fp8", activation_scheme="dynamic")
    raise CheckpointError(
        f"checkpoint quantization {method or qc!r} is not supported; kiln loads fp8 "
        "(per-tensor / per-channel; fbgemm_fp8 too), AutoAWQ gemm int4, GPTQ int4 and "
        "compressed-tensors (FP8 W8A8, int8 W8A8 / W8A16, int4 W4A16) checkpoints, or "
        "quantizes an unquantized checkpoint itself with --quant."
    )


def checkpoint_layout(qc: dict[str, Any] | None) -> str | None:
    """How a pre-quantized checkpoint stores its projections, from its
    ``quantization_config`` (after ``checkpoint_quant`` accepted it): "fp8", "awq", "gptq"
    (v1 zeros), "gptq_v2", or compressed-tensors' "ct_int4", "ct_int8", "ct_int8_packed" (its
    FP8 is "fp8"); None when it has none."""
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == CT_METHOD:
        return ct_layout_and_quant(qc)[0]
    if method == "fp8" and qc.get("weight_block_size"):
        return "fp8_block"
    if method == "fbgemm_fp8":
        return "fp8"
    return gptq_format(qc) if method == "gptq" else method


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ int32 (R, C) -> uint8 (R, 8C) of values 0..15 in column order."""
    nibbles = int32_nibbles(packed)  # (R, C, 8), nibble order
    return nibbles[..., list(_UNPACK)].reshape(packed.shape[0], -1).to(torch.uint8)


def _fp8_parts(name: str, p: dict[str, torch.Tensor], qcfg: QuantConfig) -> dict[str, Any]:
    w = p["weight"]
    if w.dtype != qf.FP8_DTYPE:
        raise CheckpointError(f"{name}.weight is {w.dtype}, not float8_e4m3fn, yet has a scale.")
    n, s = w.shape[0], p["weight_scale"].float()
    if s.numel() == 1:
        s = s.reshape(1).expand(n)
    elif s.numel() == n and s.dim() <= 2 and s.shape[0] == n:
        s = s.reshape(n)
    else:
        raise CheckpointError(
            f"{name}.weight_scale has shape {tuple(s.shape)}; kiln loads per-tensor or "
            f"per-channel ({n},) fp8 scales."
        )
    out: dict[str, Any] = {"weight": w, "weight_scale": s.contiguous()}
    if qcfg.activation_scheme == "static":
        if "input_scale" not in p:
            raise CheckpointError(f"{name} has no input_scale but activation_scheme is static.")
        out["input_scale"] = p["input_scale"].float().reshape(-1).max()
    return out


def _fp8_block_parts(name: str, p: dict[str, torch.Tensor]) -> dict[str, Any]:
    """fp8 weight tiles: ``weight`` e4m3 (N, K) and its tile scales (ceil(N/128),
    ceil(K/128)), ``weight_scale_inv`` (Hugging Face fp8; despite the name, multiplied:
    ``w = weight * scale`` over each tile) or ``weight_scale`` (compressed-tensors)."""
    w = p["weight"]
    if w.dtype != qf.FP8_DTYPE:
        raise CheckpointError(f"{name}.weight is {w.dtype}, not float8_e4m3fn, yet has a scale.")
    key = "weight_scale_inv" if "weight_scale_inv" in p else "weight_scale"
    n, k = w.shape
    tiles = (-(-n // qf.FP8_BLOCK), -(-k // qf.FP8_BLOCK))
    s = p[key].float()
    if tuple(s.shape) != tiles:
        raise CheckpointError(
            f"{name}.{key} has shape {tuple(s.shape)}; {qf.FP8_BLOCK} x {qf.FP8_BLOCK} tiles "
            f"of a ({n}, {k}) weight need {tiles}."
        )
    return {"weight": w, "weight_scale": s.contiguous(), "rows": n}


def _awq_parts(name: str, p: dict[str, torch.Tensor], qcfg: QuantConfig) -> dict[str, Any]:
    missing = [k for k in ("qweight", "qzeros", "scales") if k not in p]
    if missing:
        raise CheckpointError(f"AWQ projection {name} lacks {missing}.")
    q = unpack_awq(p["qweight"]).t().contiguous()  # (N, K)
    zero = unpack_awq(p["qzeros"]).t().contiguous()  # (N, K/G)
    scale = p["scales"].float().t().contiguous()  # (N, K/G)
    n, k = q.shape
    g = qcfg.group_size or 0
    if scale.shape != (n, k // g) or zero.shape != scale.shape or k % g:
        raise CheckpointError(
            f"AWQ projection {name}: qweight {tuple(p['qweight'].shape)}, scales "
            f"{tuple(p['scales'].shape)} and qzeros {tuple(p['qzeros'].shape)} do not fit "
            f"group_size {g}."
        )
    return {"weight": q, "weight_scale": qf.int4_scale_storage(scale), "weight_zero": zero}


def _parts(layout: str, name: str, p: dict[str, torch.Tensor], qcfg: QuantConfig) -> dict[str, Any]:
    if layout in GPTQ_FORMATS:
        return gptq_parts(name, p, qcfg.group_size or 0, v1=layout == "gptq")
    if layout == "ct_int4":
        return ct_int4_parts(name, p, qcfg.group_size or 0)
    if layout in ("ct_int8", "ct_int8_packed"):
        return ct_int8_parts(name, p, packed=layout == "ct_int8_packed")
    if layout == "fp8_block":
        return _fp8_block_parts(name, p)
    return _awq_parts(name, p, qcfg) if layout == "awq" else _fp8_parts(name, p, qcfg)


# the tensors that mark a projection as quantized, by layout
_MARK = {"fp8": ("weight_scale",), "fp8_block": ("weight_scale_inv", "weight_scale"),
         "ct_int8": ("weight_scale",), "ct_int4": ("weight_packed",),
         "ct_int8_packed": ("weight_packed",)}  # fmt: skip
_STORED = (qf.FP8_DTYPE, torch.uint8, torch.int8)  # quantized weights, kept as they are


def _split(
    cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], qcfg: QuantConfig, layout: str
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, dict[str, Any]]]:
    """Plain (name, tensor) pairs for ``convert`` (quantized weights as (N, K) fp8 / unpacked
    uint8 so fusion and shape checks apply), and the quantized projections' other tensors."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    plain: list[tuple[str, torch.Tensor]] = []
    for name, t in tensors:
        if _DROPPED.fullmatch(name):
            continue
        m = _PROJ.fullmatch(name)
        if m and m.group(2) == "bias" and not _has_bias(cfg, m.group(1)) and not t.any():
            continue  # an all-zero bias the model has no place for: no bias at all
        if m is None or m.group(2) == "bias":
            plain.append((name, t))
        else:
            modules.setdefault(m.group(1), {})[m.group(2)] = t
    quant: dict[str, dict[str, Any]] = {}
    for mod, p in modules.items():
        if not any(key in p for key in _MARK.get(layout, ("qweight",))):
            if set(p) != {"weight"}:
                raise CheckpointError(f"{mod} has tensors {sorted(p)} but no quantization scales.")
            plain.append((mod + ".weight", p["weight"]))
            continue
        parts = _parts(layout, mod, p, qcfg)
        plain.append((mod + ".weight", parts.pop("weight")))
        quant[mod] = parts
    return plain, quant


def _has_bias(cfg: ModelConfig, mod: str) -> bool:
    return cfg.attention_bias and mod.rsplit(".", 1)[1] in ("q_proj", "k_proj", "v_proj")


def _fuse(target: str, quant: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor] | None:
    """The scales of engine projection ``target`` (``layers.i.attn.qkv``) from its HF parts,
    or None when it is unquantized; raises when only some parts are quantized."""
    mods = [n.removesuffix(".weight") for n in hf_names(target + ".weight")]
    have = [m in quant for m in mods]
    if not any(have):
        return None
    if not all(have):
        raise CheckpointError(
            f"{target} fuses {mods}, of which only some are quantized; kiln needs all or none."
        )
    parts = [quant[m] for m in mods]
    rows = [p.get("rows") for p in parts]
    if rows[0] is not None and any(r % qf.FP8_BLOCK for r in rows[:-1]):
        raise CheckpointError(
            f"{target} fuses {mods} of {rows} rows, whose {qf.FP8_BLOCK}-row weight tiles "
            "would straddle two of them; kiln fuses block-wise fp8 parts whose rows are "
            f"whole multiples of {qf.FP8_BLOCK} (all but the last)."
        )
    out = {
        k: torch.cat([p[k] for p in parts])
        for k in ("weight_scale", "weight_zero")
        if k in parts[0]
    }
    perms = [p.get("input_perm") for p in parts]
    if any(pm is not None for pm in perms):
        if any(pm is None or not torch.equal(pm, perms[0]) for pm in perms):
            raise CheckpointError(
                f"{target} fuses {mods}, whose act-order input orders (g_idx) differ; kiln "
                "needs one order for all (re-export without act order, or with static groups)."
            )
        out["input_perm"] = perms[0]
    if "input_scale" in parts[0]:
        out["input_scale"] = torch.stack([p["input_scale"] for p in parts]).max().reshape(())
    return out


def convert_prequantized(
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    qcfg: QuantConfig,
    dtype: torch.dtype,
    want: dict[str, tuple[int, ...]],
    layout: str | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """HF tensors of a pre-quantized checkpoint -> the engine state dict (kiln names,
    ``QuantLinear`` tensors for quantized projections, ``dtype`` for the rest) and the
    per-module report ``quantize_model`` would give. ``want``: the unquantized model's
    tensor shapes. ``layout``: ``checkpoint_layout`` of the checkpoint (None: "fp8" or
    "awq" by ``qcfg.algo``)."""
    layout = layout or ("fp8" if qcfg.algo == "fp8" else "awq")
    plain, quant = _split(cfg, tensors, qcfg, layout)
    state: dict[str, torch.Tensor] = {}
    for name, t in convert(cfg, plain):
        if tuple(t.shape) != want[name]:
            raise CheckpointError(
                f"tensor {name} has shape {tuple(t.shape)} but the config implies {want[name]}; "
                "the weights do not match config.json."
            )
        state[name] = t.contiguous() if t.dtype in _STORED else t.to(dtype)
    report: dict[str, dict[str, Any]] = {}
    elem = torch.empty((), dtype=dtype).element_size()
    for i in range(cfg.num_hidden_layers):
        for sub in TARGETS:
            target = f"layers.{i}.{sub}"
            n, k = want[target + ".weight"]
            before = n * k * elem + (n * elem if target + ".bias" in state else 0)
            extra = _fuse(target, quant)
            if extra is None:
                if state[target + ".weight"].dtype in _STORED:
                    raise CheckpointError(f"{target} has a quantized weight but no scales.")
                report[target] = {"mode": "none", "bytes_before": before, "bytes_after": before}
                continue
            w = state[target + ".weight"]
            if qcfg.algo == "int4-awq":
                state[target + ".weight"] = qf.pack_int4(w)
            if qcfg.algo in ("int4-awq", "w8a8-sq"):
                extra["smooth"] = torch.ones(k)  # nothing to divide x by: folded or none
            for key, t in extra.items():  # int4 scales on float16's grid stay float16
                keep = key in ("weight_zero", "input_perm") or t.dtype == torch.float16
                state[f"{target}.{key}"] = t if keep else t.float()
            after = sum(
                v.numel() * v.element_size()
                for key, v in state.items()
                if key.startswith(target + ".")
            )
            report[target] = {"mode": qcfg.algo, "bytes_before": before, "bytes_after": after}
    return state, report
