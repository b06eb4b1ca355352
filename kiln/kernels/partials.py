"""Split-K sums left to the next kernel.

A projection split along K writes float32 partial sums and normally launches
``gemv.split_k_reduce`` to add them. Inside ``split_sums_deferred()`` (the decode steps'
CUDA graphs: their warm-up and capture) a projection whose caller accepts it returns the
partials instead (``SplitPartials``), and the kernel that consumes the output (SiLU·mul,
the residual add + RMSNorm) adds them itself: one launch less per projection. The
consumer adds them in split order and rounds to the output dtype exactly as the reduction
kernel does, so that the results are the same bits with and without (checked under the
CPU interpreter: ``tests/test_partials.py``).

On by default; ``KILN_DEFER_SPLIT=0`` turns it off. On the H200 (2026-12-01, int4-awq +
int4 head, one engine, one visit) it ran 2.002 / 2.607 / 3.758 ms a step at 1 / 8 / 16
sequences against 2.029 / 2.643 / 3.780 without (a later visit: 2.07 / 2.61 / 3.75 /
14.08 at 1 / 8 / 16 / 32 against 2.08 / 2.64 / 3.77 / 14.14). The same bits on the GPU
too: ``scripts/experiments/defer_split_check.py`` gave the same greedy tokens for three
prompts of 64 tokens with and without, and the kernel tests of ``tests/test_partials.py``
passed there."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from kiln.errors import env_flag


def enabled_by(env: Mapping[str, str]) -> bool:
    """Whether deferral is on for these environment variables: unless KILN_DEFER_SPLIT=0
    (0 or 1; anything else a ``ConfigError`` naming it)."""
    return env_flag(env, "KILN_DEFER_SPLIT", True)


ENABLED = enabled_by(os.environ)
_deferred = False


@dataclass
class SplitPartials:
    """A projection's output as its split-K partial sums, not yet added up."""

    part: torch.Tensor
    """(SPLIT_K, T, N) float32, contiguous."""
    dtype: torch.dtype
    """The output's dtype (the sum is rounded to it)."""

    @property
    def shape(self) -> torch.Size:
        return self.part.shape[1:]

    def finish(self) -> torch.Tensor:
        """The (T, N) output, as the projection would have returned it."""
        from kiln.kernels.gemv import split_k_reduce

        out = torch.empty(self.shape, dtype=self.dtype, device=self.part.device)
        split_k_reduce(self.part, out, None)
        return out


def finished(x: torch.Tensor | SplitPartials) -> torch.Tensor:
    """``x`` itself, or the sum of its partials."""
    return x.finish() if isinstance(x, SplitPartials) else x


def buffer(x: torch.Tensor | SplitPartials) -> tuple[torch.Tensor, int]:
    """What a consuming kernel reads: (the partials, their split count), or (x, 0)."""
    return (x.part, x.part.shape[0]) if isinstance(x, SplitPartials) else (x, 0)


@contextlib.contextmanager
def split_sums_deferred() -> Iterator[None]:
    """Let projections called with ``partials=True`` return ``SplitPartials`` here."""
    global _deferred
    before, _deferred = _deferred, ENABLED
    try:
        yield
    finally:
        _deferred = before


def deferring() -> bool:
    return _deferred
