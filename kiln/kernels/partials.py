"""Split-K sums left to the next kernel.

A projection split along K writes float32 partial sums and normally launches
``gemv.split_k_reduce`` to add them. Inside ``split_sums_deferred()`` (the decode steps'
CUDA graphs: their warm-up and capture) a projection whose caller accepts it returns the
partials instead (``SplitPartials``), and the kernel that consumes the output (SiLU·mul,
the residual add + RMSNorm) adds them itself: one launch less per projection. The
consumer adds them in split order and rounds to the output dtype exactly as the reduction
kernel does, so that the results are the same bits with and without (checked under the
CPU interpreter: ``tests/test_partials.py``).

Off by default: ``KILN_DEFER_SPLIT=1`` turns it on. On the H200 (2026-12-01, int4-awq +
int4 head, one engine, one visit) it ran 2.002 / 2.607 / 3.758 ms a step at 1 / 8 / 16
sequences against 2.029 / 2.643 / 3.780 without; its bit-identity there (the GPU test
in ``tests/test_partials.py`` and ``scripts/experiments/defer_split_check.py``) has not
run yet, only the same Triton kernels under the CPU interpreter."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

ENABLED = os.environ.get("KILN_DEFER_SPLIT", "0") == "1"
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
