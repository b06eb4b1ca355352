"""GPU memory planning: measure what one full step allocates, so the KV cache can take
the rest (``KvCacheConfig.free_gpu_memory_fraction`` of it)."""

from __future__ import annotations

import torch
from torch import nn

from kiln.config import KvCacheConfig, ModelConfig
from kiln.errors import ConfigError
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.logprobs import prompt_logprob_rows
from kiln.runtime.runner import ModelRunner
from kiln.runtime.scheduler import ScheduledSequence, SchedulerOutput
from kiln.runtime.sequence import Sequence
from kiln.sampling_params import SamplingParams


def kv_budget_bytes(free: int, reserved: int, allocated: int, peak: int, fraction: float) -> int:
    """The bytes a GPU KV cache may take: ``fraction`` of the room left for it, never more
    than leaves a whole step's ``peak`` free on the device.

    The room is the device's ``free`` bytes plus the blocks torch holds cached but unused
    (``reserved - allocated``: segments the measured step left pinned by a tensor that lives
    on, which serve the next steps' activations again) less the measured ``peak``. A first
    load's measurement left 1.0 GiB more of them cached than a later one's, and without them
    it sized a 1.6 % smaller cache (an H100, 2026-12-07). Whether the next steps reuse them
    depends on their sizes, so the cap keeps ``peak`` free even if none are reused; at the
    default fraction 0.9 it binds only when the cached bytes pass about a ninth of what is
    free."""
    room = free + reserved - allocated - peak
    return max(0, min(int(room * fraction), free - peak))


def measure_activation_peak(
    model: nn.Module,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    limits: dict[str, int],
    tokens_per_block: int,
    kv_dtype: str | None = None,
) -> int:
    """Bytes allocated at the peak of one step of ``max_num_tokens`` prompt tokens (split
    into sequences of at most ``max_seq_len - 1``), beyond the weights and a scratch KV
    cache, plus room for the sampler's (max_batch_size, vocab) float32 temporaries, which
    also holds prompt logprobs' (``prompt_logprob_rows``, vocab) ones."""
    n, longest = limits["max_num_tokens"], max(1, limits["max_seq_len"] - 1)
    lens = [longest] * (n // longest) + ([n % longest] if n % longest else [])
    lens = lens[: limits["max_batch_size"]]
    nblocks = sum(-(-ln // tokens_per_block) for ln in lens)
    kv = KVCache(cfg, nblocks, tokens_per_block, dtype, device, kv_dtype)
    step = SchedulerOutput()
    first = 0
    for i, ln in enumerate(lens):
        seq = Sequence(f"profile-{i}", [0] * ln, SamplingParams(), ln + 1)
        nb = -(-ln // tokens_per_block)
        seq.block_ids = list(range(first, first + nb))
        first += nb
        step.scheduled.append(ScheduledSequence(seq, ln))
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    ModelRunner(model, kv, device).execute(step)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del kv, step
    torch.cuda.empty_cache()
    sampler = prompt_logprob_rows(limits["max_batch_size"]) * cfg.vocab_size * 4 * 8
    return peak + sampler


def load_out_of_memory(stage: str, kv: KVCache, kc: KvCacheConfig, device: torch.device,
                       largest_batch: int) -> ConfigError:  # fmt: skip
    """The error for a load that ran out of GPU memory in ``stage`` (the kernel warm-up or
    the CUDA graph capture, after the KV cache took its share): what was free, what the
    cache holds, and the settings that leave more room."""
    free, total = torch.cuda.mem_get_info(device)
    cache = kv.nbytes
    cap = (
        f"kv_cache_config.max_tokens={kc.max_tokens}"
        if kc.max_tokens is not None
        else f"kv_cache_config.free_gpu_memory_fraction={kc.free_gpu_memory_fraction}"
    )
    return ConfigError(
        f"{stage} (batches of up to {largest_batch} sequences) ran out of GPU memory: "
        f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free, the KV cache holding "
        f"{cache / 2**30:.1f} GiB ({cap}). Leave more room: a smaller KV cache "
        "(kv_cache_config.max_tokens, --kv-cache-max-tokens; or a lower "
        "kv_cache_config.free_gpu_memory_fraction), a smaller max_batch_size or "
        "cuda_graph_batch_sizes, or no CUDA graphs (enforce_eager=True, --enforce-eager)."
    )
