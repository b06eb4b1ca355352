"""The sampler's two transfers of a step on a side stream, off the compute stream.

Between two decode graphs the compute stream used to run six operations (H200, batch 1,
int4h: 26.5 µs between graphs; ``benchmarks/results/2026-12-05-h200-input-path-ab-c445080.json``):
the sampler's parameter upload, its two kernels, the tokens' read-back, then the next
step's two input copies. Each costs its own latency in stream order. Here the upload of
step k's parameters runs on a side stream as soon as it is issued, while step k's graph
still computes, and the compute stream only waits for it (already done) before the
sampler's kernels; the read-back waits for the sampler on the side stream, so the next
step's copies and graph do not queue behind it.

Memory: a tensor a stream other than its allocating one uses is marked
(``record_stream``) so that the caching allocator does not hand it out again before that
use is done; the upload's device buffer is allocated on the side stream.

A step's prompt logprobs go to the host the same way (``start_host_copy``), started when
the step is launched and read when it is processed.

``KILN_SIDE_COPIES=0`` keeps the transfers on the compute stream (as before 2026-12-06,
for A/B measurements)."""

from __future__ import annotations

import os

import torch

from kiln.errors import env_flag

ENABLED = env_flag(os.environ, "KILN_SIDE_COPIES", True)
_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of a CUDA device (one per device, made on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _STREAMS.get(index)
    if stream is None:
        stream = _STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (pinned) on ``device``: copied on the side stream, which the current
    stream then waits for (on a CUDA device with ``ENABLED``; else an ordinary copy)."""
    if device.type != "cuda" or not ENABLED:
        return host.to(device, non_blocking=True)
    main = torch.cuda.current_stream(device)
    side = side_stream(device)
    with torch.cuda.stream(side):
        dev = host.to(device, non_blocking=True)
    main.wait_stream(side)
    dev.record_stream(main)
    return dev


def read_back(packed: torch.Tensor, host: torch.Tensor) -> torch.cuda.Event:
    """Copy ``packed`` (on a CUDA device) into pinned ``host`` once the current stream's
    work so far is done, on the side stream with ``ENABLED``: the event that marks the
    copy done."""
    event = torch.cuda.Event()
    if not ENABLED:
        host.copy_(packed, non_blocking=True)
        event.record()
        return event
    side = side_stream(packed.device)
    side.wait_stream(torch.cuda.current_stream(packed.device))
    with torch.cuda.stream(side):
        host.copy_(packed, non_blocking=True)
        event.record(side)
    packed.record_stream(side)
    return event


def start_host_copy(packed: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """``packed`` on its way to the host: on a CUDA device a pinned buffer and the event of
    its ``read_back`` (wait for it before reading); on the CPU a copy (the source may be a
    buffer the next step reuses) and None."""
    if not packed.is_cuda:
        return packed.clone(), None
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    return host, read_back(packed, host)
