"""``dummy:<preset>`` sources: real model shapes with random weights, for benchmarks with
nothing to download. The engine stores the preset and seed, never the tensors; the weights
are generated on the target device when the engine loads (see ``materialize``).

Fields can be overridden after the preset name: ``dummy:llama-3.1-8b,num_hidden_layers=2``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kiln.checkpoint.base import Checkpoint
from kiln.config import ModelConfig
from kiln.errors import CheckpointError

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA3_EOS = (128001, 128008, 128009)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        architecture="LlamaForCausalLM",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_ids=(),
    ),
    # tiny too, with every projection of whole 128-wide int4 groups and 16-row tiles (the
    # float16-code int4 kernel's shapes, kiln/kernels/wq_f16.py)
    "tiny-g128": dict(
        architecture="LlamaForCausalLM",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_ids=(),
    ),
    "smollm2-135m": dict(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "llama-2-7b": dict(
        architecture="LlamaForCausalLM",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "llama-3.1-8b": dict(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        bos_token_id=128000,
        eos_token_ids=_LLAMA3_EOS,
    ),
    "llama-3.1-70b": dict(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        bos_token_id=128000,
        eos_token_ids=_LLAMA3_EOS,
    ),
    "mistral-7b": dict(
        architecture="MistralForCausalLM",
        vocab_size=32768,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "qwen2.5-7b": dict(
        architecture="Qwen2ForCausalLM",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        attention_bias=True,
        bos_token_id=None,
        eos_token_ids=(151645,),
    ),
}

_OVERRIDABLE = ("num_hidden_layers", "max_position_embeddings", "vocab_size")


def parse_dummy(source: str) -> tuple[str, dict[str, int]]:
    spec = source.removeprefix("dummy:")
    name, *pairs = spec.split(",")
    if name not in PRESETS:
        raise CheckpointError(f"unknown dummy preset {name!r}; available: {', '.join(PRESETS)}.")
    overrides: dict[str, int] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in _OVERRIDABLE or not value.isdigit() or int(value) < 1:
            raise CheckpointError(
                f"dummy override {pair!r} is invalid; allowed: "
                f"{', '.join(k + '=<positive int>' for k in _OVERRIDABLE)}."
            )
        overrides[key] = int(value)
    return name, overrides


class DummyCheckpoint(Checkpoint):
    kind = "dummy"

    def __init__(self, preset: str, overrides: dict[str, int]) -> None:
        self.preset = preset
        self.overrides = overrides
        self.source = "dummy:" + ",".join([preset, *(f"{k}={v}" for k, v in overrides.items())])
        self.config = ModelConfig(**{**PRESETS[preset], **overrides})

    @classmethod
    def from_source(cls, source: str) -> DummyCheckpoint:
        return cls(*parse_dummy(source))

    def fingerprint(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    def tensor_names(self) -> list[str]:
        return []

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(())  # weights are generated at load time, never stored

    def save_tokenizer(self, dst: Path) -> bool:
        return False


@torch.no_grad()
def materialize(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter of ``model`` (already on its target device) with seeded random
    values: N(0, 0.02) for matrices and biases, 1 for norm weights. The same seed gives the
    same weights on the same device type."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
