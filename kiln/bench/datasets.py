"""Benchmark datasets: lists of requests with a prompt and a forced output length.

Synthetic requests follow the method of TensorRT-LLM's published performance tables
(``prepare_dataset.py token-norm-dist``): input and output lengths are fixed or drawn from
a normal distribution (rounded, at least 1), and prompts are random token ids, all from one
seed, so the same arguments give the same requests on every machine. Prompts can also come
from a text file (one prompt per non-empty line). Datasets are saved as JSONL, one request
per line: ``{"task_id": 0, "input_ids": [...], "output_tokens": 128}`` or, for text,
``{"task_id": 0, "prompt": "...", "input_tokens": 9, "output_tokens": 128}``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import ConfigError, bad_value


@dataclass(frozen=True)
class BenchRequest:
    """One request: token ids (synthetic) or text, and how many tokens to generate."""

    task_id: int
    output_tokens: int
    input_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    input_tokens: int = 0  # len(input_ids), or the tokenized length of ``prompt``

    def __post_init__(self) -> None:
        if self.input_ids is not None:
            object.__setattr__(self, "input_tokens", len(self.input_ids))
        if (self.input_ids is None) == (self.prompt is None):
            raise ConfigError(f"request {self.task_id} needs exactly one of input_ids, prompt.")
        if self.output_tokens < 1:
            raise bad_value("output_tokens", self.output_tokens, "at least 1")

    @property
    def payload(self) -> str | list[int]:
        """What is sent to an engine: the token ids, else the text."""
        return list(self.input_ids) if self.input_ids is not None else str(self.prompt)


def _lengths(rng: random.Random, n: int, mean: int, stdev: float, cap: int) -> list[int]:
    if stdev <= 0:
        return [mean] * n
    return [min(cap, max(1, round(rng.gauss(mean, stdev)))) for _ in range(n)]


def synthetic(
    num_requests: int,
    isl: int,
    osl: int,
    vocab_size: int,
    *,
    isl_stdev: float = 0.0,
    osl_stdev: float = 0.0,
    seed: int = 0,
    max_len: int | None = None,
) -> list[BenchRequest]:
    """``num_requests`` requests of random token ids in ``[0, vocab_size)``; input and
    output lengths ``isl``/``osl`` (normal with the given stdev when > 0, rounded, >= 1,
    and capped so that input + output fit ``max_len`` when given)."""
    for name, v in (("num_requests", num_requests), ("isl", isl), ("osl", osl)):
        if v < 1:
            raise bad_value(name, v, "a positive integer is required")
    if max_len is not None and isl + osl > max_len:
        raise bad_value("isl + osl", isl + osl, f"the engine's max_seq_len is {max_len}")
    rng = random.Random(seed)
    cap = 1 << 30 if max_len is None else max_len
    ins = _lengths(rng, num_requests, isl, isl_stdev, cap - 1)
    outs = _lengths(rng, num_requests, osl, osl_stdev, cap - 1)
    reqs = []
    for i, (n_in, n_out) in enumerate(zip(ins, outs, strict=True)):
        n_out = max(1, min(n_out, cap - n_in))
        ids = tuple(rng.randrange(vocab_size) for _ in range(n_in))
        reqs.append(BenchRequest(i, n_out, input_ids=ids))
    return reqs


def from_text_file(
    path: str | Path,
    osl: int,
    count_tokens: Callable[[str], int],
    *,
    num_requests: int | None = None,
    osl_stdev: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """One request per non-empty line of ``path`` (cycled when ``num_requests`` is larger
    than the file); ``count_tokens`` gives each prompt's input length."""
    p = Path(path)
    if not p.is_file():
        raise bad_value("prompts file", str(p), "an existing text file, one prompt per line")
    lines = [ln.strip() for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not lines:
        raise bad_value("prompts file", str(p), "at least one non-empty line")
    n = num_requests or len(lines)
    rng = random.Random(seed)
    outs = _lengths(rng, n, osl, osl_stdev, 1 << 30)
    return [
        BenchRequest(
            i,
            outs[i],
            prompt=lines[i % len(lines)],
            input_tokens=count_tokens(lines[i % len(lines)]),
        )
        for i in range(n)
    ]


def save_jsonl(reqs: list[BenchRequest], path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as f:
        for r in reqs:
            d: dict[str, object] = {"task_id": r.task_id}
            if r.input_ids is not None:
                d["input_ids"] = list(r.input_ids)
            else:
                d["prompt"] = r.prompt
                d["input_tokens"] = r.input_tokens
            d["output_tokens"] = r.output_tokens
            f.write(json.dumps(d) + "\n")


def load_jsonl(path: str | Path) -> list[BenchRequest]:
    """Read a dataset written by ``save_jsonl`` (or TensorRT-LLM's ``prepare_dataset``:
    ``input_ids`` and ``output_tokens`` per line)."""
    p = Path(path)
    if not p.is_file():
        raise bad_value("dataset", str(p), "an existing JSONL file")
    reqs = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            ids = d.get("input_ids")
            reqs.append(
                BenchRequest(
                    int(d.get("task_id", len(reqs))),
                    int(d["output_tokens"]),
                    input_ids=tuple(int(t) for t in ids) if ids is not None else None,
                    prompt=d.get("prompt"),
                    input_tokens=int(d.get("input_tokens", 0)),
                )
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"{p}:{n} is not a dataset line ({e}); expected "
                '{"input_ids": [...] or "prompt": "...", "output_tokens": N}.'
            ) from e
    if not reqs:
        raise bad_value("dataset", str(p), "at least one request")
    return reqs


def describe(reqs: list[BenchRequest]) -> dict[str, float]:
    """Counts and mean lengths, for reports."""
    n = len(reqs)
    return {
        "num_requests": n,
        "input_tokens": sum(r.input_tokens for r in reqs),
        "output_tokens": sum(r.output_tokens for r in reqs),
        "mean_input_len": sum(r.input_tokens for r in reqs) / n,
        "mean_output_len": sum(r.output_tokens for r in reqs) / n,
    }
