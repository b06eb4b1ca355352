"""Kernel warm-up at load: compile, before the first request, the Triton kernel variants
that eager steps and the sampler can reach, so none is compiled while requests wait.

A Triton kernel compiles one variant per set of ``constexpr`` values and per class of its
integer arguments (equal to 1, a multiple of 16, or neither), and the engine's eager steps
(every step with prompt tokens) pick those from the step's shape: the rows (the tuned
few-row GEMM kernels and their token tiles, programmatic dependent launch at up to 64
rows), the decode sequences (decode attention's small-, medium- and large-batch tiers),
their longest context (split counts, the block table's width) and the prompt chunks
(prefill attention with and without a cached prefix). The sampler's kernel has a variant
per number of vocabulary slices (``kiln.kernels.sampling.sample_splits``). On an H200 a
2048/128 throughput run compiled seven such variants in its timed window, 5.4 s of a 47.8
s run, stalling every sequence while each compiled (``benchmarks/results/2026-12-02-h200-
throughput-2048-128-ab-f03a598.json``).

``warmup_plan`` lists small steps that cover those shapes, ``run_warmup`` runs them through
the model runner before the CUDA graphs are captured. Every sequence of a warm-up step
reads and writes only the KV cache's null block (the padding block of the CUDA graphs),
so no block of the cache is touched and nothing is left behind. With Triton's on-disk
cache warm (``KILN_CACHE_DIR``), a load reads the variants instead of compiling them."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from kiln.errors import env_flag
from kiln.kernels.tuning import tuned
from kiln.runtime.compiles import count_compiles
from kiln.runtime.cuda_graphs import DecodeGraphs
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.runner import ModelRunner
from kiln.runtime.scheduler import ScheduledSequence, SchedulerOutput
from kiln.runtime.sequence import Sequence
from kiln.sampling_params import SamplingParams

ROW_SWEEP = 128
"""Every row count up to this one is warmed (the fused few-row GEMMs reach 96 rows)."""
PDL_ROWS = 64
"""Steps of at most this many rows launch their kernels as programmatic dependents."""


@dataclass(frozen=True)
class WarmStep:
    """One warm-up step: ``decodes`` one-token sequences of context ``context`` (the new
    token included) and, if ``prefill``, one prompt chunk of that many tokens after
    ``prefix`` tokens already cached."""

    decodes: int = 0
    context: int = 2
    prefill: int = 0
    prefix: int = 0

    @property
    def rows(self) -> int:
        return self.decodes + self.prefill


def _decode_tiers(max_batch: int) -> list[int]:
    """One decode count in each of decode attention's tuned tiers (and past the last)."""
    cfg = tuned("decode_attention")
    counts = {1}
    for tier in ("small_batch", "medium_batch"):
        if cfg.get(tier):
            counts.add(cfg[tier]["max_batch"] + 1)
    counts.add(PDL_ROWS + 1)
    return sorted(c for c in counts if c <= max_batch)


def _widths(max_width: int) -> list[int]:
    """Block-table widths: 1, then 2^k and 2^k + 1 up to ``max_width`` (and it)."""
    out = {1, max_width}
    k = 2
    while k <= max_width:
        out |= {k, min(k + 1, max_width)}
        k *= 2
    return sorted(out)


def warmup_plan(
    max_batch: int,
    max_num_tokens: int,
    max_seq_len: int,
    tokens_per_block: int,
    eager_decodes: bool = True,
) -> list[WarmStep]:
    """The warm-up steps for an engine's limits (see the module docstring).
    ``eager_decodes``: steps of decodes alone run eagerly too (no CUDA graphs)."""
    steps: list[WarmStep] = []
    rows = min(ROW_SWEEP, max_num_tokens)
    # every row count, as a step of decodes and one two-token chunk, and as decodes alone
    # when those run eagerly (graphs take them otherwise): GEMMs by rows, decode tiers
    for r in range(1, rows + 1):
        if r >= 3 and r - 2 <= max_batch - 1:
            steps.append(WarmStep(decodes=r - 2, prefill=2))
        if eager_decodes and r <= max_batch:
            steps.append(WarmStep(decodes=r))
    # prompt chunks alone, at integer classes of their length and past the sweep
    for p in (2, 16, 17, rows + 1, rows + 16, max_num_tokens):
        if 2 <= p <= min(max_num_tokens, max_seq_len - 1):
            steps.append(WarmStep(prefill=p))
    # decode attention's splits and block-table widths, in each tier, with the step's
    # rows on both sides of the PDL limit; a chunk after a cached prefix of that length
    bs = tokens_per_block
    max_width = -(-max_seq_len // bs)
    for w in _widths(max_width):
        ctx = min(w * bs, max_seq_len - 1)
        if ctx < 2:
            continue
        for d in _decode_tiers(max_batch - 1):
            for p in (2, max(2, PDL_ROWS + 1 - d)):
                if d + p <= max_num_tokens:
                    steps.append(WarmStep(decodes=d, context=ctx, prefill=p))
        # a chunk after a cached prefix (over the cache; whole prompts read their own K/V),
        # alone and beside a decode, on both sides of the PDL limit
        for p in (17, PDL_ROWS + 16):
            p = min(p, max_seq_len - 1 - ctx)
            if p >= 2 and p + 1 <= max_num_tokens:
                steps.append(WarmStep(prefill=p, prefix=ctx))
                if max_batch >= 2:
                    steps.append(WarmStep(decodes=1, context=ctx, prefill=p, prefix=ctx))
    return list(dict.fromkeys(steps))  # in order, without repeats


def _step(ws: WarmStep, null_block: int, bs: int) -> SchedulerOutput:
    out = SchedulerOutput()
    params = SamplingParams()
    for i in range(ws.decodes):
        seq = Sequence(f"warmup-d{i}", [0] * (ws.context - 1), params, ws.context + 1)
        seq.output_token_ids = [0]
        seq.num_computed = ws.context - 1
        seq.block_ids = [null_block] * -(-ws.context // bs)
        out.scheduled.append(ScheduledSequence(seq, 1))
    if ws.prefill:
        total = ws.prefix + ws.prefill
        seq = Sequence("warmup-p", [0] * total, params, total + 1)
        seq.num_computed = ws.prefix
        seq.block_ids = [null_block] * -(-total // bs)
        out.scheduled.append(ScheduledSequence(seq, ws.prefill))
    return out


@torch.inference_mode()
def run_warmup(runner: ModelRunner, kv: KVCache, plan: list[WarmStep]) -> None:
    """Run ``plan`` eagerly (no CUDA graphs) on the null block; the logits are dropped.
    Steps with decodes take their first one's token as a placeholder (overlapped
    stepping's case: the embedding's kernel with the previous step's tokens)."""
    prev = torch.zeros(1, dtype=torch.int64, device=runner.device)
    for ws in plan:
        patch = ([0], [0], prev) if ws.decodes else None
        runner._eager(_step(ws, kv.null_block, kv.tokens_per_block), patch)


def warm_sampler(device: torch.device, vocab: int, max_rows: int) -> None:
    """The sampling kernel at every vocabulary split a step of up to ``max_rows``
    sequences can take (its logits are float32 whatever the engine's dtype), and the
    sort-free top-p kernel where a step can reach it."""
    from kiln.kernels.sampling import sample_splits, sample_triton

    keys = torch.zeros(1, 3, dtype=torch.int64, device=device)
    x = torch.zeros(1, vocab, dtype=torch.float32, device=device)
    inv_temp = torch.ones(1, device=device)
    thr = torch.full((1,), float("-inf"), device=device)
    for sp in sorted({sample_splits(n, vocab) for n in range(1, max_rows + 1)}):
        sample_triton(x, inv_temp, thr, keys, sp)
    from kiln.kernels import top_p

    if top_p.ENABLED and max_rows >= top_p.MIN_ROWS:  # its row indices 16- and 8-byte aligned
        rows = torch.zeros(2, dtype=torch.int64, device=device)  # as the sampler's views are
        for r in (rows[:1], rows[1:]):
            top_p.top_p_thresholds_triton(x, r, inv_temp, inv_temp, torch.zeros_like(inv_temp))


def warm_up_kernels(
    runner: ModelRunner, kv: KVCache, limits: dict[str, int], vocab: int, eager_decodes: bool
) -> dict[str, Any]:
    """Warm every variant of the engine's limits (CUDA only): the seconds it took, its
    steps, and the Triton variants it loaded (compiled, or read from Triton's cache)."""
    start = time.perf_counter()
    plan = warmup_plan(
        limits["max_batch_size"], limits["max_num_tokens"], limits["max_seq_len"],
        kv.tokens_per_block, eager_decodes,
    )  # fmt: skip
    with count_compiles() as log:
        run_warmup(runner, kv, plan)
        warm_sampler(runner.device, vocab, limits["max_batch_size"])
        torch.cuda.synchronize(runner.device)
    seconds = round(time.perf_counter() - start, 3)
    return {"seconds": seconds, "steps": len(plan), "variants": log.count if log else None,
            "variants_by_kernel": log.by_kernel if log else None}  # fmt: skip


def dry_run_wanted(env: dict[str, str] | None = None) -> bool:
    """``KILN_LOAD_DRY_RUN``: 1 (the default) runs ``dry_run`` before a load's warm-up when
    the engine has no kernel record yet; 0 does not (every variant then compiles when the
    warm-up or the capture first launches it). On an H100 with Triton's cache cold, a
    dummy:tiny load's warm-up took 7.11 s without it and 0.47 + 2.15 + 1.60 s with it
    (dry run, compiles on 16 threads, warm-up; the same greedy tokens:
    ``benchmarks/results/2026-12-06-h100-visit9-a1c1021.json``)."""
    return env_flag(os.environ if env is None else env, "KILN_LOAD_DRY_RUN", True)


@torch.inference_mode()
def dry_run(
    runner: ModelRunner, kv: KVCache, limits: dict[str, int], vocab: int,
    eager_decodes: bool, graph_sizes: list[int], max_seq_len: int,
) -> None:  # fmt: skip
    """The warm-up's steps, the sampler's splits and one uncaptured forward at each CUDA
    graph batch size: the Triton variants a load compiles, for a
    ``KernelRecord.deferring`` block to record (each skipped, neither compiled nor
    launched) and its ``preload`` to compile at once in processes and threads, where the
    warm-up would compile them one after another. Nothing here reads a skipped kernel's
    output on the host: its values are whatever the buffers held, and only the null block
    of the cache is written."""
    plan = warmup_plan(
        limits["max_batch_size"], limits["max_num_tokens"], limits["max_seq_len"],
        kv.tokens_per_block, eager_decodes,
    )  # fmt: skip
    run_warmup(runner, kv, plan)
    if graph_sizes:
        DecodeGraphs(runner.model, kv, runner.device, max_seq_len, graph_sizes).forward_each()
    if runner.device.type == "cuda":  # the CPU samples with torch (and runs no Triton)
        warm_sampler(runner.device, vocab, limits["max_batch_size"])
        torch.cuda.synchronize(runner.device)
