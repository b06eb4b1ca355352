"""GPTQ int4 checkpoints (AutoGPTQ, GPTQModel, optimum) onto kiln's int4 ``QuantLinear``.

``quantization_config``: ``quant_method: "gptq"``, ``bits: 4``, ``group_size: G`` (a
positive even integer), ``checkpoint_format: "gptq"`` (the default, "v1") or ``"gptq_v2"``;
``sym`` and ``desc_act`` are accepted. A projection with K inputs and N outputs holds:

- ``qweight`` int32 (K/8, N): input row k in bits 4 * (k % 8) of ``qweight[k // 8, n]``;
- ``qzeros`` int32 (K/G, N/8): output column n in bits 4 * (n % 8) of ``qzeros[g, n // 8]``;
- ``scales`` float16 (K/G, N) and ``g_idx`` int32 (K,), the group of each input row;
- ``w[n, k] = (q[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n]``, where ``zero`` is the
  stored nibble plus one in "gptq" (v1) and the stored nibble itself in "gptq_v2".

That is kiln's asymmetric uint4 layout transposed when every group is a contiguous run of
G inputs, i.e. ``g_idx[k] == k // G``: always without act-order, and with act-order
(``desc_act``) when the exporter kept static groups (AutoGPTQ ``static_groups``). Otherwise
(act order, groups interleaved along K) the columns are stored sorted by group and the
layer gathers x's columns in the same order first (``QuantLinear.input_perm``); the fused
q / k / v and gate / up must share that order (GPTQ gives parts with one input one
order). ``sym=True`` only means every zero is 8 (7 stored in v1); it loads the same way.

A v1 stored zero of 15 reads as zero 16, outside uint4. Quantizers clamp zeros to 0..15, so
it only arises from an asymmetric export whose zero 0 wrapped to -1; the tools then disagree
on what it means (a nibble-wise +1 reads 16, GPTQModel's whole-word v1 -> v2 addition carries
into the neighbouring column, AutoGPTQ's v1 packer had already spilled the -1 into the
higher nibbles). kiln refuses it rather than guess."""

from __future__ import annotations

from typing import Any

import torch

from kiln.config import QuantConfig
from kiln.errors import CheckpointError
from kiln.quant import formats as qf

GPTQ_FORMATS = ("gptq", "gptq_v2")
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble i of an int32: bits 4i..4i+3
_V1_OVERFLOW = 15  # a v1 stored zero that would read as 16


def gptq_quant(qc: dict[str, Any]) -> QuantConfig:
    """The kiln quant config of a GPTQ ``quantization_config``; raises for what kiln cannot
    load exactly (see the module docstring)."""
    bits = qc.get("bits", 4)
    if bits != 4:
        raise CheckpointError(
            f"GPTQ bits={bits!r} is not supported: kiln loads 4-bit GPTQ checkpoints only; "
            "use a bits=4 export, or the unquantized model with --quant int4-awq."
        )
    group = qc.get("group_size", 128)
    if not isinstance(group, int) or isinstance(group, bool) or group < 2 or group % 2:
        raise CheckpointError(
            f"GPTQ group_size={group!r} is not supported: kiln needs groups of a positive even "
            "size along the inputs (32, 64, 128, ...); -1 (one group per row) is not loaded."
        )
    fmt = gptq_format(qc)
    if fmt not in GPTQ_FORMATS:
        raise CheckpointError(
            f"GPTQ checkpoint_format={fmt!r} is not supported: kiln loads 'gptq' (v1) and "
            "'gptq_v2'; re-export in one of them."
        )
    pack = str(qc.get("pack_dtype", "int32")).lower().removeprefix("torch.")
    if pack != "int32":
        raise CheckpointError(
            f"GPTQ pack_dtype={qc['pack_dtype']!r} is not supported: kiln unpacks int32 words "
            "only; re-export with pack_dtype int32."
        )
    if qc.get("lm_head"):
        raise CheckpointError(
            "GPTQ lm_head=true is not supported: kiln keeps lm_head unquantized; re-export "
            "with lm_head=false."
        )
    return QuantConfig(algo="int4-awq", group_size=group)


def gptq_format(qc: dict[str, Any]) -> str:
    """'gptq' (v1 zeros, stored minus one) or 'gptq_v2' as the config names it; anything
    else (Marlin, BitBLAS, ...) as it is spelled, for ``gptq_quant`` to refuse."""
    if qc.get("is_marlin_format"):
        return "marlin"
    return str(qc.get("checkpoint_format") or "gptq").lower()


def int32_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 (R, C) -> int32 (R, C, 8): element [r, c, i] is nibble i (bits 4i..4i+3) of
    ``packed[r, c]`` (0..15; the sign bit is just bit 31)."""
    return (packed.to(torch.int32)[..., None] >> _SHIFTS) & 0xF


def unpack_gptq_rows(packed: torch.Tensor) -> torch.Tensor:
    """GPTQ ``qweight`` int32 (R, C) -> uint8 (8R, C): row 8r + i is nibble i of row r."""
    nib = int32_nibbles(packed)  # (R, C, 8)
    return nib.permute(0, 2, 1).reshape(-1, packed.shape[1]).to(torch.uint8)


def unpack_gptq_cols(packed: torch.Tensor) -> torch.Tensor:
    """GPTQ ``qzeros`` int32 (R, C) -> uint8 (R, 8C): column 8c + i is nibble i of column c."""
    return int32_nibbles(packed).reshape(packed.shape[0], -1).to(torch.uint8)


def _int32(name: str, key: str, t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.int32 or t.dim() != 2:
        raise CheckpointError(
            f"GPTQ projection {name}: {key} is {t.dtype} {tuple(t.shape)}; kiln loads 2-D int32 "
            "packed tensors (pack_dtype int32)."
        )
    return t


def gptq_parts(name: str, p: dict[str, torch.Tensor], group_size: int, v1: bool) -> dict[str, Any]:
    """One GPTQ projection's tensors -> kiln's unpacked int4 ``weight`` uint8 (N, K), float32
    ``weight_scale`` and uint8 ``weight_zero`` (N, K/G). ``v1``: checkpoint_format "gptq"."""
    missing = [k for k in ("qweight", "qzeros", "scales") if k not in p]
    if missing:
        raise CheckpointError(f"GPTQ projection {name} lacks {missing}.")
    q = unpack_gptq_rows(_int32(name, "qweight", p["qweight"])).t().contiguous()  # (N, K)
    stored = unpack_gptq_cols(_int32(name, "qzeros", p["qzeros"])).t().contiguous()
    scale = p["scales"].float().t().contiguous()  # (N, K/G)
    n, k = q.shape
    g = group_size
    if k % g or scale.shape != (n, k // g) or stored.shape != scale.shape:
        raise CheckpointError(
            f"GPTQ projection {name}: qweight {tuple(p['qweight'].shape)}, scales "
            f"{tuple(p['scales'].shape)} and qzeros {tuple(p['qzeros'].shape)} do not fit "
            f"group_size {g}."
        )
    perm = act_order_perm(name, p["g_idx"], k, g) if "g_idx" in p else None
    if v1:
        over = int((stored == _V1_OVERFLOW).sum())
        if over:
            raise CheckpointError(
                f"GPTQ projection {name}: {over} stored zero point(s) are 15, which the v1 "
                "checkpoint_format 'gptq' reads as 16, outside uint4's 0..15 (an asymmetric v1 "
                "export whose zero 0 wrapped; tools disagree on its meaning); re-export with "
                "checkpoint_format='gptq_v2', or with sym=true."
            )
        stored = stored + 1
    out = {"weight": q, "weight_scale": qf.int4_scale_storage(scale), "weight_zero": stored}
    if perm is not None:  # act order: columns in group order, x gathered to match
        out |= {"weight": q[:, perm].contiguous(), "input_perm": perm}
    return out


def act_order_perm(name: str, g_idx: torch.Tensor, k: int, group: int) -> torch.Tensor | None:
    """None when every int4 group is ``group`` consecutive inputs (``g_idx == k // G``);
    else the input order that makes them so (a stable sort of ``g_idx``), for checkpoints
    quantized in act order: the weight's columns are stored in it and the layer gathers
    x's columns to match (``QuantLinear.input_perm``)."""
    g_idx = g_idx.reshape(-1).long()
    if g_idx.shape != (k,):
        raise CheckpointError(
            f"{name}: g_idx has {g_idx.numel()} entries, not one per input ({k})."
        )
    want = torch.arange(k) // group
    if torch.equal(g_idx, want):
        return None
    perm = torch.sort(g_idx, stable=True).indices
    if not torch.equal(g_idx[perm], want):
        raise CheckpointError(
            f"{name}: g_idx does not give every group {group} inputs (groups 0 to "
            f"{k // group - 1}); the checkpoint does not fit its group_size."
        )
    return perm
