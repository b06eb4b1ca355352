"""The one map from Hugging Face Llama tensor names to kiln engine names, with fusion:
q/k/v -> ``attn.qkv`` and gate/up -> ``mlp.gate_up`` (parts concatenated along rows)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from kiln.config import ModelConfig
from kiln.errors import CheckpointError

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_SIMPLE = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_LAYER_SIMPLE = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "self_attn.o_proj.weight": "attn.o.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
}
# fused target -> its parts, in concatenation order
_FUSED = {
    "attn.qkv.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "attn.qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
_PART_OF = {part: (target, i) for target, parts in _FUSED.items() for i, part in enumerate(parts)}
# Present in some checkpoints, recomputed by kiln.
_IGNORED = ("self_attn.rotary_emb.inv_freq",)


def _hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor the config implies (layer tensors without their prefix)."""
    h, i, v, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.q_size, cfg.kv_size
    return {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }


def hf_names(name: str, have: dict[int, torch.Tensor] | None = None) -> list[str]:
    """The checkpoint (HF) names of engine tensor ``name``, less the fused parts in ``have``
    (in concatenation order)."""
    have = have or {}
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m is None:
        return [hf for hf, engine in _SIMPLE.items() if engine == name]
    prefix, sub = f"model.layers.{m.group(1)}.", m.group(2)
    if sub in _FUSED:
        return [prefix + part for i, part in enumerate(_FUSED[sub]) if i not in have]
    return [prefix + hf for hf, engine in _LAYER_SIMPLE.items() if engine == sub]


def expected_names(cfg: ModelConfig) -> set[str]:
    names = {"embed.weight", "norm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        names |= {p + n for n in _LAYER_SIMPLE.values()}
        names |= {p + "attn.qkv.weight", p + "mlp.gate_up.weight"}
        if cfg.attention_bias:
            names.add(p + "attn.qkv.bias")
    return names


def convert(
    cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename and fuse a stream of HF tensors; yields each engine tensor as soon as all its
    parts have arrived. Raises if a tensor is unknown or one the model needs is missing."""
    pending: dict[str, dict[int, torch.Tensor]] = {}
    seen: set[str] = set()
    shapes = _hf_shapes(cfg)
    for hf, t in tensors:
        m = _LAYER.fullmatch(hf)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            raise CheckpointError(
                f"checkpoint tensor {hf!r} is beyond num_hidden_layers={cfg.num_hidden_layers}."
            )
        want = shapes.get(m.group(2) if m else hf)
        if want is not None and tuple(t.shape) != want:
            raise CheckpointError(
                f"checkpoint tensor {hf!r} has shape {tuple(t.shape)} but the config implies "
                f"{want}; the weights do not match config.json."
            )
        if hf in _SIMPLE:
            name = _SIMPLE[hf]
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # tied: the engine stores the embedding once
        elif m and m.group(2) in _LAYER_SIMPLE:
            name = f"layers.{m.group(1)}.{_LAYER_SIMPLE[m.group(2)]}"
        elif m and m.group(2) in _PART_OF:
            target, idx = _PART_OF[m.group(2)]
            name = f"layers.{m.group(1)}.{target}"
            parts = pending.setdefault(name, {})
            parts[idx] = t
            if len(parts) < len(_FUSED[target]):
                continue
            t = torch.cat([parts[i] for i in range(len(parts))], dim=0)
            del pending[name]
        elif m and m.group(2) in _IGNORED:
            continue
        else:
            raise CheckpointError(
                f"checkpoint tensor {hf!r} has no place in a {cfg.architecture} model; "
                "is the config.json from the same checkpoint as the weights?"
            )
        seen.add(name)
        yield name, t
    missing = [
        hf
        for name in sorted(expected_names(cfg) - seen, key=_natural)
        for hf in hf_names(name, pending.get(name, {}))
    ]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(
            f"checkpoint is missing tensors for {missing[:5]}{more}; it is incomplete or does not "
            "match its config.json."
        )


def _natural(s: str) -> list[object]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]
