"""Calibration: the token ids a model is run on before quantization (the statistics of
the activations are collected by kiln/quant/stats.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kiln.config import DEFAULT_CALIB_TOKENS
from kiln.errors import ConfigError, bad_value
from kiln.quant.calib import TextFileError, default_corpus, load_text, split_corpus

__all__ = [
    "DEFAULT_CALIB_TOKENS",
    "MIN_CALIB_TEXT_TOKENS",
    "calibration_token_ids",
    "read_calib_text",
]

# the fewest tokens a --calib-text file may hold (as --calib-tokens's lower bound): a
# shorter text, repeated to length, would calibrate on one phrase's statistics
MIN_CALIB_TEXT_TOKENS = 16


def read_calib_text(path: str | Path) -> str:
    """The text of a ``--calib-text`` file: UTF-8, not blank; else a ``ConfigError`` naming
    ``quant.calib_text``, the path and what is wrong."""
    try:
        return load_text(Path(path))
    except TextFileError as e:  # missing, a directory, not UTF-8, blank, unreadable
        why = f"a UTF-8 text file that exists, with text in it ({e.reason})"
        raise bad_value("quant.calib_text", str(path), why) from None


def calibration_token_ids(
    tokenizer: Any, path: str | Path | None, n_tokens: int, text: str | None = None
) -> list[int]:
    """``n_tokens`` ids of the calibration text (the file at ``path``, else the calibration
    half of the default corpus; the other half is held out for the quality gate),
    tokenized without special tokens and repeated to length, so that fewer tokens are a
    prefix of more. ``text``, when given, is the file's text already read (``path`` then
    only names it in errors). Without a tokenizer (dummy engines) the ids are a fixed
    pseudo-random sequence."""
    if n_tokens < 1:
        raise ConfigError(f"calibration needs at least one token, got {n_tokens}.")
    if tokenizer is None:
        gen = torch.Generator().manual_seed(0)
        return torch.randint(0, 256, (n_tokens,), generator=gen).tolist()
    if text is None:
        text = read_calib_text(path) if path is not None else split_corpus(default_corpus())[0]
    ids = tokenizer.encode(text, add_special_tokens=False)
    if path is not None and len(ids) < MIN_CALIB_TEXT_TOKENS:
        why = (f"a text of at least {MIN_CALIB_TEXT_TOKENS} tokens (this one has {len(ids)}); "
               "pass a longer sample of what the model will serve, or leave --calib-text out "
               "for the default corpus")  # fmt: skip
        raise bad_value("quant.calib_text", str(path), why)
    if not ids:
        raise ConfigError("the calibration text is empty after tokenization; use another file.")
    reps = -(-n_tokens // len(ids))
    return (ids * reps)[:n_tokens]
