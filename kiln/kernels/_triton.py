"""Whether Triton kernels can run: on CUDA tensors when triton imports, or anywhere under
the Triton interpreter (``TRITON_INTERPRET=1``, which CI uses to test them on the CPU)."""

from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a pinned dependency
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(x: torch.Tensor) -> bool:
    """The dispatchers' rule: Triton for CUDA tensors (never for CPU ones outside tests)."""
    return HAVE_TRITON and x.is_cuda and not INTERPRET
