"""``ModelConfig``: the normalized description of a Llama-family model, whatever the source
(Hugging Face ``config.json``, GGUF metadata, a dummy preset). Re-exported by
``kiln.config``, where the other configuration objects live."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kiln.errors import ConfigError, bad_value

# HF `architectures` names kiln can build, and the model family each one maps to.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
}

DTYPES = ("float32", "bfloat16", "float16")
ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


def unsupported_architecture(name: object) -> ConfigError:
    return ConfigError(
        f"architecture {name!r} is not supported; kiln builds "
        f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}."
    )


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder. Sizes in elements; ``head_dim`` may differ from
    ``hidden_size // num_attention_heads`` (some checkpoints set it explicitly)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None, or {"rope_type": "linear"|"llama3"|"freq_factors", ...} (see layers/rotary.py).
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False  # Qwen2: bias on q, k, v (not o)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # Mistral v0.1: attend to the last N keys only
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise unsupported_architecture(self.architecture)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise bad_value(f"model.{name}", v, "a positive integer is required")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad_value(
                "model.num_key_value_heads",
                self.num_key_value_heads,
                f"it must divide num_attention_heads={self.num_attention_heads}",
            )
        if self.head_dim % 2:
            raise bad_value("model.head_dim", self.head_dim, "rotary embedding needs it even")
        if self.rope_scaling is not None:
            rt = self.rope_scaling.get("rope_type")
            if rt not in ROPE_TYPES:
                raise bad_value("model.rope_scaling.rope_type", rt, f"one of {ROPE_TYPES}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise bad_value("model.sliding_window", self.sliding_window, "positive or None")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + emb + h

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(
                f"unknown model config fields {sorted(unknown)}; allowed: {sorted(names)}."
            )
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        """Normalize a Hugging Face ``config.json`` (transformers 4.x or 5.x spelling)."""
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise unsupported_architecture(archs[0] if archs else hf.get("model_type"))
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        # transformers 5 moves rope_theta and rope_scaling into rope_parameters.
        rope = dict(hf.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = hf.get("rope_scaling") or (rope if rope else None)
        scaling = _normalize_rope_scaling(scaling)
        window = hf.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not hf.get("use_sliding_window", False):
            window = None
        eos = eos_token_ids or _as_tuple(hf.get("eos_token_id"))
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=int(window) if window else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
        )


def _as_tuple(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, list | tuple):
        return tuple(int(x) for x in v)
    return (int(v),)


def _normalize_rope_scaling(s: dict[str, Any] | None) -> dict[str, Any] | None:
    if not s:
        return None
    s = dict(s)
    rt = s.pop("rope_type", None) or s.pop("type", None) or "default"
    s.pop("rope_theta", None)
    if rt == "default":
        return None
    if rt not in ROPE_TYPES:
        raise bad_value("rope_scaling.rope_type", rt, f"kiln supports {ROPE_TYPES}")
    return {"rope_type": rt, **s}
