"""Split-K without a second kernel: each program of a split tile writes its float32 partial,
then takes a ticket from the tile's counter; the program that arrives last sums the tile's
partials in split order (the order ``gemv.split_k_reduce`` uses, so the result is the same
to the bit), writes the output and sets the counter back to zero for the next launch.

Why: at batch 1 the int4 engine's gate_up and down projections split K, and each split
launch was followed by a reduction kernel, two more kernel boundaries per layer on the
critical path of a decode step.

Ordering (the PTX memory model, as CUDA's threadfence-reduction sample does it): every
thread fences (``fence.acq_rel.gpu``) after its partial stores, the block synchronizes,
one thread takes the ticket (``atom.acq_rel.gpu``, Triton's scalar atomic: thread 0, the
old value broadcast through shared memory), and the last program fences again and reads
the partials through L2 (``.cg``) only.

Counters: one int32 array per device (``MAX_TILES``), allocated zeroed outside CUDA-graph
capture (the engine's eager warm-up runs before it captures); every use leaves them zero.
Kernels on one stream take turns, so launches never share a counter at once.
``KILN_SPLITK_FIXUP=0`` turns it off (the reduction kernel again)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

ENABLED = os.environ.get("KILN_SPLITK_FIXUP", "1") != "0"
MAX_TILES = 1 << 18
_COUNTERS: dict[int, torch.Tensor] = {}


def tile_counters(x: torch.Tensor, tiles: int) -> torch.Tensor | None:
    """The device's zeroed tile counters for a launch of ``tiles`` split tiles, or None
    (use the reduction kernel): turned off, too many tiles, not CUDA, or first asked for
    while a CUDA graph is being captured (the array must outlive the graph's pool)."""
    if not ENABLED or tiles > MAX_TILES or not x.is_cuda:
        return None
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    counters = _COUNTERS.get(index)
    if counters is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        counters = torch.zeros(MAX_TILES, dtype=torch.int32, device=x.device)
        _COUNTERS[index] = counters
    return counters


@gluon.jit
def _fence():
    gl.inline_asm_elementwise("fence.acq_rel.gpu; // $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def last_arrival(cnt_ptr, SPLIT_K: gl.constexpr):
    """After this program's partial stores: whether it is the tile's last (of ``SPLIT_K``)
    to arrive; that one may then read every split's partial with ``cache_modifier=".cg"``
    and must reset the counter (``reset``)."""
    _fence()
    gl.thread_barrier()
    last = gl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
    _fence()
    return last


@gluon.jit
def reset(cnt_ptr):
    gl.store(cnt_ptr, 0)


@triton.jit
def _fence_tl():
    tl.inline_asm_elementwise("fence.acq_rel.gpu; // $0", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@triton.jit
def last_arrival_tl(cnt_ptr, SPLITS):
    """``last_arrival`` for Triton kernels (``SPLITS`` may be a run-time value)."""
    _fence_tl()
    tl.debug_barrier()
    last = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == SPLITS - 1
    _fence_tl()
    return last
