"""compressed-tensors checkpoints (llm-compressor's format, ``quant_method:
"compressed-tensors"``) onto kiln's ``QuantLinear``, for the schemes kiln has kernels for:

- **FP8 W8A8** (``format`` "float-quantized" or "naive-quantized"): weights float, 8 bits,
  symmetric, static, per tensor or per output channel; input activations float, 8 bits,
  dynamic (per token, or per tensor, which kiln runs per token) or static per tensor. The
  tensors are those of the ``fp8`` layout: ``weight`` float8_e4m3fn (N, K),
  ``weight_scale`` (1,) or (N, 1) in the weights' dtype, ``input_scale`` (1,) when static.
- **W4A16 int4** (``format`` "pack-quantized"): weights int, 4 bits, per group of G inputs,
  symmetric or not, no input quantization. ``weight_packed`` int32 (N, K/8) holds each
  signed code q in [-8, 7] as q + 8, input 8j + i in bits 4i..4i+3 of column j;
  ``weight_scale`` (N, K/G); ``w = (q - zp) * scale``. Symmetric checkpoints store no zero
  point (zp = 0); others store ``weight_zero_point`` int32 (N/8, K/G), each zp + 8 packed
  the same way along the outputs. So the stored nibbles are kiln's uint4 codes as they are,
  with zero 8 (symmetric) or the stored zero nibble. ``weight_g_idx`` (act order "group")
  is handled as GPTQ's ``g_idx``: groups interleaved along K are stored sorted, and the
  layer gathers x's columns to match.

- **int8** (weights int, 8 bits, symmetric, per channel or tensor): W8A8 with dynamic,
  symmetric int8 activations (per token, or per tensor, which kiln runs per token;
  ``format`` "int-quantized"; ``weight`` int8 (N, K), ``weight_scale`` (N, 1) or (1,))
  runs as kiln's ``w8a8-sq`` with no smoothing
  (llm-compressor folds SmoothQuant into the weights); W8A16 (no activation quantization;
  "pack-quantized": ``weight_packed`` int32 (N, K/4), input 4j + i in bits 8i..8i+7 of
  column j, stored as q + 128; or unpacked) runs as ``int8-wo``.

Modules without scales (``ignore``, or outside ``targets``) stay unquantized, as in the
other layouts: the tensors present decide. Refused, each with what to use instead: several
different schemes in one checkpoint, FP8 weights without activation quantization,
block-wise FP8 other than FP8_BLOCK (128 x 128 weight tiles, dynamic activations per
group of 128: kiln's fp8 "block", layout "fp8_block"), channel-wise int4 scales, other
bit widths, sparsity and transforms, output activation quantization, and checkpoints in
another state than "compressed" (FP8 also "frozen", whose fp8 weights are stored as they
are; kiln checks their dtype).
``kv_cache_scheme`` is ignored: kiln calibrates its own fp8 KV scales
(``--kv-cache-dtype fp8``)."""

from __future__ import annotations

from typing import Any

import torch

from kiln.build.prequant_gptq import act_order_perm, unpack_gptq_cols
from kiln.config import QuantConfig
from kiln.errors import CheckpointError
from kiln.quant import formats as qf

METHOD = "compressed-tensors"
FP8_FORMATS = ("float-quantized", "naive-quantized")
INT4_FORMAT = "pack-quantized"
_INSTEAD = "or the unquantized model with kiln's --quant"
_RESAVE = "re-export it saved compressed (llm-compressor's default), " + _INSTEAD


def _refuse(what: str, instead: str = _INSTEAD) -> CheckpointError:
    return CheckpointError(f"compressed-tensors checkpoint: {what} is not supported; {instead}.")


def _scheme(qc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
    """The one scheme of the checkpoint's groups: weights, input activations, format."""
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise _refuse("a quantization_config without config_groups (or with a preset name)")
    schemes = []
    for name, g in groups.items():
        if not isinstance(g, dict) or not isinstance(g.get("weights"), dict):
            raise _refuse(f"config group {name!r} without weight arguments")
        if g.get("output_activations"):
            raise _refuse("output activation quantization")
        schemes.append((g["weights"], g.get("input_activations"), g.get("format")))
    if any(s != schemes[0] for s in schemes[1:]):
        raise _refuse("several different schemes in one checkpoint (mixed precision)",
                      "re-export with one scheme for every quantized Linear")  # fmt: skip
    w, a, fmt = schemes[0]
    return w, a or None, str(fmt or qc.get("format") or "")


def _strategy(args: dict[str, Any]) -> str:
    s = args.get("strategy")
    if s:
        return str(s)
    gs = args.get("group_size")
    return "tensor" if gs is None else ("channel" if gs == -1 else "group")


def _fp8_block(w: dict[str, Any], a: dict[str, Any] | None) -> tuple[str, QuantConfig]:
    """FP8_BLOCK: weights in 128 x 128 tiles, activations dynamic per token and 128
    channels: kiln's fp8 "block" scheme."""
    tiles = list(w.get("block_structure") or [])
    a_ok = (
        a is not None
        and a.get("type") == "float"
        and a.get("num_bits") == 8
        and bool(a.get("dynamic"))
        and _strategy(a) == "group"
        and a.get("group_size") == 128
    )
    if tiles != [128, 128] or not w.get("symmetric", True) or not a_ok:
        raise _refuse(
            f"block-wise FP8 weights with block_structure {tiles} and activations {a}",
            "use FP8_BLOCK (128 x 128 weight tiles, dynamic activations in groups of 128) "
            + _INSTEAD,
        )
    return "fp8_block", QuantConfig(algo="fp8", activation_scheme="block")


def ct_layout_and_quant(qc: dict[str, Any]) -> tuple[str, QuantConfig]:
    """(the layout: "fp8", "fp8_block", "ct_int8", "ct_int8_packed" or "ct_int4"; the kiln
    quant config)
    of a compressed-tensors ``quantization_config``; raises for what kiln cannot load
    exactly."""
    status = qc.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):
        instead = _RESAVE
        raise _refuse(f"quantization_status {status!r} (weights not stored compressed)", instead)
    sparsity = qc.get("sparsity_config") or {}
    if sparsity and str(sparsity.get("format", "dense")) != "dense":
        raise _refuse(f"sparsity ({sparsity.get('format')})")
    if qc.get("transform_config"):
        raise _refuse("a transform (rotation) config")
    w, a, fmt = _scheme(qc)
    kind, bits, strategy = w.get("type"), w.get("num_bits"), _strategy(w)
    if w.get("dynamic"):
        raise _refuse("dynamic weight quantization")
    if kind == "float" and bits == 8 and fmt in FP8_FORMATS and strategy == "block":
        return _fp8_block(w, a)
    if kind == "float" and bits == 8 and fmt in FP8_FORMATS:
        if not w.get("symmetric", True) or strategy not in ("tensor", "channel"):
            raise _refuse(f"FP8 weights with strategy {strategy!r}"
                          f"{'' if w.get('symmetric', True) else ', asymmetric'}",
                          "use per-tensor or per-channel FP8 weights " + _INSTEAD)  # fmt: skip
        if a is None:
            instead = "use an FP8 W8A8 export (FP8_DYNAMIC or static FP8) " + _INSTEAD
            raise _refuse("FP8 weights without activation quantization (W8A16)", instead)
        if a.get("type") != "float" or a.get("num_bits") != 8:
            raise _refuse(f"FP8 weights with {a.get('type')} {a.get('num_bits')}-bit "
                          "activations")  # fmt: skip
        dynamic, a_strategy = bool(a.get("dynamic")), _strategy(a)
        if not dynamic and a_strategy != "tensor":
            raise _refuse(f"static {a_strategy} activation scales")
        return "fp8", QuantConfig(algo="fp8", activation_scheme="dynamic" if dynamic else "static")
    if kind == "int" and bits == 8:
        return _int8(w, a, fmt, strategy)
    if kind == "int" and bits == 4 and fmt == INT4_FORMAT:
        if status != "compressed":  # "frozen" int4 weights are not packed
            instead = _RESAVE
            raise _refuse(f"int4 weights in quantization_status {status!r}", instead)
        if a is not None:
            raise _refuse("int4 weights with quantized activations (W4A8)")
        gs = w.get("group_size")
        if strategy != "group" or not isinstance(gs, int) or gs < 2 or gs % 2:
            raise _refuse(f"int4 weights with strategy {strategy!r} and group_size {gs!r}",
                          "use group-wise int4 (group 32, 64, 128, ...) " + _INSTEAD)  # fmt: skip
        return "ct_int4", QuantConfig(algo="int4-awq", group_size=gs)
    raise _refuse(f"{kind} {bits}-bit weights in format {fmt!r}",
                  "kiln loads FP8 W8A8, int8 W8A8 / W8A16 and int4 W4A16 "
                  "compressed-tensors checkpoints, " + _INSTEAD)  # fmt: skip


def _int8(
    w: dict[str, Any], a: dict[str, Any] | None, fmt: str, strategy: str
) -> tuple[str, QuantConfig]:
    """int8 weights: W8A8 (dynamic per-token int8 activations) -> w8a8-sq with no
    smoothing; W8A16 -> int8-wo. Per-channel or per-tensor symmetric weights only."""
    if not w.get("symmetric", True) or strategy not in ("tensor", "channel"):
        raise _refuse(f"int8 weights with strategy {strategy!r}"
                      f"{'' if w.get('symmetric', True) else ', asymmetric'}",
                      "use symmetric per-channel int8 weights " + _INSTEAD)  # fmt: skip
    if a is None:
        if fmt == "pack-quantized":
            return "ct_int8_packed", QuantConfig(algo="int8-wo")
        if fmt in ("int-quantized", "naive-quantized"):
            return "ct_int8", QuantConfig(algo="int8-wo")
    elif fmt in ("int-quantized", "naive-quantized"):
        if (a.get("type"), a.get("num_bits")) != ("int", 8):
            raise _refuse(f"int8 weights with {a.get('type')} {a.get('num_bits')}-bit "
                          "activations")  # fmt: skip
        if not a.get("dynamic") or not a.get("symmetric", True):
            raise _refuse(f"{'static' if not a.get('dynamic') else 'asymmetric'} int8 "
                          "activations", "kiln's W8A8 int8 (w8a8-sq) quantizes activations "
                          "per token, dynamically and symmetrically; use such an export "
                          + _INSTEAD)  # fmt: skip
        return "ct_int8", QuantConfig(algo="w8a8-sq")
    raise _refuse(f"int8 weights in format {fmt!r}")


def ct_int8_parts(name: str, p: dict[str, torch.Tensor], packed: bool) -> dict[str, Any]:
    """An int8 projection's tensors -> int8 (N, K) and one scale per row. Packed (W8A16):
    ``weight_packed`` int32 (N, K/4), input 4j + i in bits 8i..8i+7 of column j, stored as
    q + 128."""
    s = p["weight_scale"].float()
    if packed:
        n, k = _shape(p, 4)
        shifts = torch.arange(0, 32, 8, dtype=torch.int32)
        b = (p["weight_packed"].to(torch.int32)[..., None] >> shifts) & 0xFF
        q = (b.reshape(b.shape[0], -1)[:, :k] - 128).to(torch.int8)
    else:
        q = p["weight"]
        if q.dtype != torch.int8:
            raise CheckpointError(f"{name}.weight is {q.dtype}, not int8, yet has a scale.")
        n, k = q.shape
    if q.shape != (n, k) or s.numel() not in (1, n):
        raise CheckpointError(
            f"{name}: int8 weight {tuple(q.shape)} with weight_scale {tuple(s.shape)}; kiln "
            "loads per-tensor or per-channel int8 scales."
        )
    return {"weight": q, "weight_scale": s.reshape(-1).expand(n).contiguous()}


def _unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """int32 (R, C) -> uint8 (R, n): nibble i of column j is element 8j + i (GPTQ's qzeros
    order), the padding past n dropped."""
    return unpack_gptq_cols(packed)[:, :n]


def _shape(p: dict[str, torch.Tensor], per_word: int) -> tuple[int, int]:
    """(N, K) of a packed weight: its ``weight_shape``, else from ``weight_packed``."""
    if "weight_shape" in p:
        n, k = (int(v) for v in p["weight_shape"].reshape(-1).tolist())
        return n, k
    return p["weight_packed"].shape[0], p["weight_packed"].shape[1] * per_word


def ct_int4_parts(name: str, p: dict[str, torch.Tensor], group: int) -> dict[str, Any]:
    """A pack-quantized projection's tensors -> kiln's uint4 codes (N, K), per-group scales
    and zeros (N, K/G)."""
    if "weight_scale" not in p:
        raise CheckpointError(f"{name} has weight_packed but no weight_scale.")
    scale = p["weight_scale"].float()
    n, k = _shape(p, 8)
    if k % group or scale.shape != (n, k // group) or p["weight_packed"].shape[0] != n:
        raise CheckpointError(
            f"{name}: weight_packed {tuple(p['weight_packed'].shape)} and weight_scale "
            f"{tuple(scale.shape)} do not fit a ({n}, {k}) weight in groups of {group}."
        )
    q = _unpack(p["weight_packed"], k)
    if "weight_zero_point" in p:
        zero = _unpack(p["weight_zero_point"].t(), n).t().contiguous()  # packed along N
        if zero.shape != scale.shape:
            raise CheckpointError(
                f"{name}: weight_zero_point {tuple(p['weight_zero_point'].shape)} does not fit "
                f"{n} outputs in {k // group} groups."
            )
    else:
        zero = torch.full(scale.shape, 8, dtype=torch.uint8)  # symmetric: zp 0, stored as 8
    out = {
        "weight": q,
        "weight_scale": qf.int4_scale_storage(scale.contiguous()),
        "weight_zero": zero,
    }
    perm = act_order_perm(name, p["weight_g_idx"], k, group) if "weight_g_idx" in p else None
    if perm is not None:  # act order "group": columns in group order, x gathered to match
        out |= {"weight": q[:, perm].contiguous(), "input_perm": perm}
    return out
