"""Whether Triton kernels can run: on CUDA tensors when triton imports, or anywhere under
the Triton interpreter (``TRITON_INTERPRET=1``, which CI uses to test them on the CPU)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a pinned dependency
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


_reference_only = False


def use_triton(x: torch.Tensor) -> bool:
    """The dispatchers' rule: Triton for CUDA tensors (never for CPU ones outside tests, nor
    inside ``reference_kernels``)."""
    return HAVE_TRITON and x.is_cuda and not INTERPRET and not _reference_only


@contextlib.contextmanager
def reference_kernels() -> Iterator[None]:
    """Every dispatcher takes its torch reference inside this block (on CUDA too): for
    passes that need autograd, which the Triton kernels do not implement."""
    global _reference_only
    before, _reference_only = _reference_only, True
    try:
        yield
    finally:
        _reference_only = before
