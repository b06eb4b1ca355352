"""Calibration: the token ids a model is run on before quantization (the statistics of
the activations are collected by kiln/quant/stats.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kiln.config import DEFAULT_CALIB_TOKENS
from kiln.errors import ConfigError
from kiln.quant.calib import default_corpus, split_corpus

__all__ = ["DEFAULT_CALIB_TOKENS", "calibration_token_ids"]


def calibration_token_ids(tokenizer: Any, path: str | Path | None, n_tokens: int) -> list[int]:
    """``n_tokens`` ids of the calibration text (the file at ``path``, else the calibration
    half of the default corpus; the other half is held out for the quality gate),
    tokenized without special tokens and repeated to length. Without a tokenizer (dummy
    engines) the ids are a fixed pseudo-random sequence."""
    if n_tokens < 1:
        raise ConfigError(f"calibration needs at least one token, got {n_tokens}.")
    if tokenizer is None:
        gen = torch.Generator().manual_seed(0)
        return torch.randint(0, 256, (n_tokens,), generator=gen).tolist()
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ConfigError(f"--calib-text {str(p)!r} is not a file; pass a UTF-8 text file.")
        text = p.read_text(encoding="utf-8", errors="replace")
    else:
        text = split_corpus(default_corpus())[0]
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ConfigError("the calibration text is empty after tokenization; use another file.")
    reps = -(-n_tokens // len(ids))
    return (ids * reps)[:n_tokens]
