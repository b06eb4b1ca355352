"""The interface every checkpoint reader implements."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path

import torch

from kiln.config import ModelConfig, QuantConfig
from kiln.errors import CheckpointError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def refuse_pickle(path: Path) -> None:
    raise CheckpointError(
        f"{str(path)!r} is a pickle file, which kiln never loads because unpickling can run "
        "arbitrary code; convert the checkpoint to safetensors (for example "
        "`model.save_pretrained(dir, safe_serialization=True)` in transformers) and pass that "
        "directory instead."
    )


def file_fingerprint(paths: list[Path]) -> str:
    """A cheap identity of files for the build cache: path, size and mtime, not content."""
    h = hashlib.sha256()
    for p in sorted(paths):
        st = p.stat()
        h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


class Checkpoint(ABC):
    """A model source: its normalized config, its tensors under HF names, its tokenizer."""

    kind: str  # "hf" | "gguf" | "dummy"
    source: str  # as the user named it (absolute path, or dummy:<preset>)
    config: ModelConfig
    quant: QuantConfig | None = None
    """Set for pre-quantized checkpoints: the kiln quant config its tensors already have."""
    quant_layout: str | None = None
    """With ``quant``: how the tensors store it ("fp8", "awq", "gptq", "gptq_v2")."""

    @abstractmethod
    def fingerprint(self) -> str:
        """Identity for the build cache; changes when the checkpoint's files change."""

    @abstractmethod
    def tensor_names(self) -> list[str]:
        """HF-style names of every tensor ``tensors()`` yields."""

    @abstractmethod
    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` one at a time, so peak memory stays at one tensor."""

    @abstractmethod
    def save_tokenizer(self, dst: Path) -> bool:
        """Write tokenizer files (tokenizer.json, tokenizer_config.json with the chat
        template) into ``dst``; return False when the source has no tokenizer."""

    @property
    def default_dtype(self) -> str:
        """The dtype the checkpoint was trained/stored in, for ``--dtype auto`` on a GPU."""
        return "bfloat16"
