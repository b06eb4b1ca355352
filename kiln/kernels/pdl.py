"""Programmatic dependent launch (Hopper and later): a kernel launched as a programmatic
dependent may start while the grid before it in the stream still runs; it must execute
``griddepcontrol.wait`` (which returns once that grid has finished and its writes are
visible) before it reads anything that grid or an earlier one wrote, or writes anything
they read. A grid lets its dependents launch early with ``griddepcontrol.launch_dependents``
(else they launch as its programs exit).

``KILN_PDL``: 0 off; 1 the one-row int4 kernel and the bf16 skinny GEMV launch as
dependents (the int4 one reads its first weights before it waits) and every kernel of a
decode layer lets the next launch early; 2 (default) also every other kernel of a decode
layer (RMSNorm, rotary + KV write, decode attention and its reduction, SiLU-mul, the
split-K reduction) launches as a dependent and waits at its start, or after loading what
no kernel of the step writes (decode attention's first chunk of K and V, see
``kiln.kernels.decode_attention``; its reduction's lengths; rotary's positions and cos /
sin).

Measured (H200, dummy Llama-3.1-8B, batch 1, 128/128 TPOT; 847ba29, before the projections
let the next kernel launch early too): int4-awq with an int4 head 2.43 ms at 0, 2.28 at 1,
2.15 at 2; bf16 4.53 at every level."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kiln.errors import env_int
from kiln.kernels._triton import INTERPRET

LEVEL = env_int(os.environ, "KILN_PDL", 2, range(3))
# steps of more rows (tokens) launch as before: there the kernels are long and launch gaps
# a small share; at 2,048 rows, fp8 128/128 throughput with PDL measured 24,635 and
# 24,322 out tok/s against 24,820 without (c097c1a). 64 is a choice, not a measured edge
MAX_ROWS = 64


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pdl(x: torch.Tensor) -> bool:
    """Whether a kernel on ``x`` (rows first: the step's tokens) uses programmatic
    dependent launch: ``KILN_PDL`` at least 1, at most ``MAX_ROWS`` rows, compiled kernels
    on compute capability 9 or later."""
    if LEVEL < 1 or INTERPRET or not x.is_cuda or x.shape[0] > MAX_ROWS:
        return False
    return _capability_major(x.device.index or 0) >= 9


@triton.jit
def pdl_enter(TRIGGER: tl.constexpr, WAIT: tl.constexpr):
    """A kernel's first statement: let the next grid launch (``TRIGGER``), then wait for
    the grid before (``WAIT``, for a kernel launched with ``launch_pdl``)."""
    if TRIGGER:
        gdc_launch_dependents()
    if WAIT:
        gdc_wait()


def mode(x: torch.Tensor) -> int:
    """A small kernel's ``PDL`` constant for ``pdl_enter``: 0 nothing, 1 trigger, 2 trigger
    and wait (launched with ``launch_pdl`` exactly then)."""
    return min(LEVEL, 2) if pdl(x) else 0


def kwargs(x: torch.Tensor) -> dict[str, int | bool]:
    """A small kernel's launch arguments: its ``PDL`` constant (``mode``) and
    ``launch_pdl``, true exactly when the kernel waits."""
    m = mode(x)
    return {"PDL": m, "launch_pdl": m == 2}


def dependent_kwargs(x: torch.Tensor) -> dict[str, bool]:
    """A projection's launch arguments (``PDL``: trigger at the start and wait before the
    first dependent access), launched as a dependent exactly when it waits."""
    p = pdl(x)
    return {"PDL": p, "launch_pdl": p}
