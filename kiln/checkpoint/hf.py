"""Hugging Face directories: config.json + one or more ``*.safetensors`` files (sharded ones
through ``model.safetensors.index.json``). ``auto_map`` code is never imported."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from kiln.build.prequant import checkpoint_layout, checkpoint_quant
from kiln.checkpoint.base import PICKLE_SUFFIXES, Checkpoint, file_fingerprint, refuse_pickle
from kiln.config import ModelConfig
from kiln.errors import CheckpointError

INDEX = "model.safetensors.index.json"
# Copied verbatim into the engine when present; everything here is data, none of it code.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)


class HFCheckpoint(Checkpoint):
    kind = "hf"

    def __init__(self, path: Path) -> None:
        self.path = path.resolve()
        self.source = str(self.path)
        try:
            hf = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"cannot read {path / 'config.json'}: {e}.") from e
        self.hf_config = hf
        self.files = self._weight_files()
        self.config = ModelConfig.from_hf(hf, eos_token_ids=self._generation_eos())
        self.quant = checkpoint_quant(hf)
        self.quant_layout = checkpoint_layout(hf.get("quantization_config"))

    def _weight_files(self) -> list[Path]:
        index = self.path / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (self.path / n).is_file()]
            if missing:
                raise CheckpointError(
                    f"{index} lists shard(s) {missing} that are not in {self.path}; "
                    "download the complete checkpoint."
                )
            return [self.path / n for n in names]
        files = sorted(self.path.glob("*.safetensors"))
        if files:
            return files
        pickles = [p for p in sorted(self.path.iterdir()) if p.suffix in PICKLE_SUFFIXES]
        if pickles:
            refuse_pickle(pickles[0])
        raise CheckpointError(f"{self.path} holds config.json but no *.safetensors weights.")

    def _generation_eos(self) -> tuple[int, ...]:
        gen = self.path / "generation_config.json"
        if not gen.is_file():
            return ()
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, list) else (int(eos),)

    def fingerprint(self) -> str:
        extra = [self.path / "config.json"] + [
            self.path / f for f in TOKENIZER_FILES if (self.path / f).is_file()
        ]
        return file_fingerprint(self.files + extra)

    def tensor_names(self) -> list[str]:
        names: list[str] = []
        for f in self.files:
            with safe_open(f, framework="pt") as sf:
                names.extend(sf.keys())
        return names

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for f in self.files:
            with safe_open(f, framework="pt") as sf:
                for name in sf.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, sf.get_tensor(name)

    @property
    def default_dtype(self) -> str:
        d = self.hf_config.get("dtype") or self.hf_config.get("torch_dtype") or "bfloat16"
        return d if d in ("bfloat16", "float16", "float32") else "bfloat16"

    def save_tokenizer(self, dst: Path) -> bool:
        found = False
        dst.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            src = self.path / name
            if src.is_file():
                shutil.copyfile(src, dst / name)
                found = found or name != "generation_config.json"
        return found
