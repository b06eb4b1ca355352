"""Checkpoint readers. Every reader yields tensors under Hugging Face Llama names
(``model.layers.0.self_attn.q_proj.weight`` ...) so the builder has one name map.

Sources: a Hugging Face directory (config.json + safetensors), a ``.gguf`` file, or a
``dummy:<preset>`` with random weights. Pickle files are refused; checkpoint code
(``auto_map``) is never imported or run.
"""

from __future__ import annotations

from pathlib import Path

from kiln.checkpoint.base import PICKLE_SUFFIXES, Checkpoint, file_fingerprint, refuse_pickle
from kiln.checkpoint.default_model import default_model_path
from kiln.checkpoint.dummy import PRESETS, DummyCheckpoint
from kiln.errors import CheckpointError

__all__ = [
    "PRESETS",
    "Checkpoint",
    "default_model_path",
    "open_checkpoint",
    "source_identity",
]

SOURCES_HELP = (
    "pass a Hugging Face directory (config.json + *.safetensors), a .gguf file, "
    f"an engine directory built by `kiln build`, or dummy:<preset> (presets: {', '.join(PRESETS)})"
)


def source_identity(source: str) -> tuple[str, str]:
    """(canonical source, fingerprint) without parsing the checkpoint: a build-cache lookup
    must cost a few stat() calls, not a GGUF parse."""
    if source.startswith("dummy:"):
        ckpt = DummyCheckpoint.from_source(source)
        return ckpt.source, ckpt.fingerprint()
    path = Path(source).expanduser()
    if not path.exists():
        raise CheckpointError(f"model path {source!r} does not exist; {SOURCES_HELP}.")
    files = [p for p in path.iterdir() if p.is_file()] if path.is_dir() else [path]
    return str(path.resolve()), file_fingerprint(files)


def open_checkpoint(source: str) -> Checkpoint:
    """Open ``source`` for reading; raises ``CheckpointError`` with what to do instead."""
    if source.startswith("dummy:"):
        return DummyCheckpoint.from_source(source)
    path = Path(source).expanduser()
    if not path.exists():
        raise CheckpointError(f"model path {source!r} does not exist; {SOURCES_HELP}.")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            from kiln.checkpoint.gguf_reader import GGUFCheckpoint

            return GGUFCheckpoint(path)
        if path.suffix.lower() in PICKLE_SUFFIXES:
            refuse_pickle(path)
        raise CheckpointError(f"{source!r} is a file kiln cannot read; {SOURCES_HELP}.")
    if (path / "config.json").is_file():
        from kiln.checkpoint.hf import HFCheckpoint

        return HFCheckpoint(path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        from kiln.checkpoint.gguf_reader import GGUFCheckpoint

        return GGUFCheckpoint(ggufs[0])
    raise CheckpointError(f"directory {source!r} holds no config.json; {SOURCES_HELP}.")
