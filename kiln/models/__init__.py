"""Model registry: Hugging Face ``architectures`` name -> kiln model class."""

from __future__ import annotations

import torch
from torch import nn

from kiln.config import ModelConfig, unsupported_architecture
from kiln.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """Instantiate the model with uninitialized weights (``device="meta"`` allocates none)."""
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise unsupported_architecture(cfg.architecture)
    return cls(cfg, dtype, device)
