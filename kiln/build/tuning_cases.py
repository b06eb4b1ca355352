"""The attention cases the build's tuner times (``kiln.build.tuning``): decode attention
per batch tier (its cases, candidates and tier bounds) and prefill attention, each over a
random paged cache of the engine's KV dtype."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from kiln.config import ModelConfig, QuantConfig
from kiln.kernels.prefill_attention import prefill_attention_triton


def _random_cache(
    blocks: int, bs: int, hk: int, d: int, dtype: torch.dtype, kv_fp8: bool, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A random paged cache of ``dtype``, or of fp8 with unit (k, v) scales."""
    kv = torch.randn(2, blocks, bs, hk, d, device=dev, dtype=dtype)
    if not kv_fp8:
        return kv, None
    return kv.to(torch.float8_e4m3fn), torch.ones(2, device=dev)


def _decode_case(
    cfg: ModelConfig,
    dtype: torch.dtype,
    batch: int,
    ctx: int,
    bs: int,
    kv_fp8: bool = False,
    device: str = "cuda",
    limit: int | None = None,
) -> Callable[[dict[str, Any]], torch.Tensor]:
    """Decode attention at ``batch`` sequences of ``ctx`` tokens, over an fp8 cache (with
    scales) for engines that keep one, else a cache of the engine's dtype; the returned
    function runs one candidate configuration and returns the attention output (``device``
    "cpu": under the interpreter, for tests). With ``limit`` the kernel is called as the
    engine's CUDA graphs call it: ``max_seq_len`` the engine's limit (it caps how many
    splits are launched) and the splits the launcher derives from ``target_programs``
    (rounded to a power of two), as every tier's build cases are; without (experiments,
    tests), ``max_seq_len`` is ``ctx`` and the splits ``target_programs // (batch * kv
    heads)``."""
    from kiln.kernels.decode_attention import decode_attention_triton, default_splits

    dev = torch.device(device)
    hk, d, hq = cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads
    nb = -(-ctx // bs)
    kv, scales = _random_cache(batch * nb, bs, hk, d, dtype, kv_fp8, dev)
    tables = torch.randperm(batch * nb, device=dev, dtype=torch.int32).view(batch, nb)
    lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    tok = torch.arange(batch, device=dev)
    q = torch.randn(batch, hq, d, device=dev, dtype=dtype)
    out = torch.empty_like(q)

    def run(c: dict[str, Any]) -> torch.Tensor:
        decode_attention_triton(
            q,
            kv,
            tables,
            lens,
            tok,
            out,
            d**-0.5,
            limit or ctx,
            None,
            num_warps=c["num_warps"],
            num_splits=default_splits(c["target_programs"], batch, hk)
            if limit
            else max(1, c["target_programs"] // (batch * hk)),
            kv_scale=scales,
            blocks_per_step=c.get("blocks_per_step", 1),
        )
        return out

    return run


def _prefill_case(
    cfg: ModelConfig, dtype: torch.dtype, seqs: int, length: int, bs: int, kv_fp8: bool = False
) -> Callable[[dict[str, Any]], None]:
    """Prefill attention of ``seqs`` whole prompts of ``length`` tokens, over an fp8 cache
    (with scales) for engines that keep one, else a cache of the engine's dtype."""
    dev = torch.device("cuda")
    hk, d, hq = cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads
    length = max(2, length)
    nb = -(-length // bs)
    kv, scales = _random_cache(seqs * nb, bs, hk, d, dtype, kv_fp8, dev)
    tables = torch.randperm(seqs * nb, device=dev, dtype=torch.int32).view(seqs, nb)
    lens = torch.full((seqs,), length, device=dev, dtype=torch.int32)
    starts = torch.arange(seqs + 1, device=dev, dtype=torch.int32) * length
    q = torch.randn(seqs * length, hq, d, device=dev, dtype=dtype)
    out = torch.empty_like(q)

    def run(c: dict[str, Any]) -> None:
        prefill_attention_triton(
            q, kv, tables, lens, starts, out, d**-0.5, length, cfg.sliding_window, None,
            kv_scale=scales, **c,
        )  # fmt: skip

    return run


DECODE_CASES = ((96, 2048), (256, 1024), (896, 1536), (2048, 256))
"""Decode attention's main-tier cases (sequences, context), in the tier's range (steps of
more than ``MEDIUM_BATCH`` sequences) and near the throughput shapes' decode steps (96
sequences, where models of few KV heads still split, so that ``target_programs`` is timed
too); capped at the engine's limits and at ``CASE_CACHE_BYTES`` of cache each, called as
the graphs call the kernel (``max_seq_len`` the engine's limit), timed by single calls.
They were 1 x 4,096, 64 x 1,024 and 512 x 256 (two below the range, no limit) until
2026-12-04: on an H200 those picked 2 blocks a step, which ran ``_decode_partial`` at
673.6 us a layer for 882 sequences of ~1,050 tokens (fp8 cache) against 537.5 in
f03a598's engine (4 blocks); at 896 x 1,100 tokens 4 warps took 861.6 us with 2 blocks,
643.9 with 4 (``results/2026-12-04-h200-decode-large-batch-b325f4d.json``)."""
CASE_CACHE_BYTES = 4 << 30
"""The most cache one main-tier case allocates (its sequences are cut to fit)."""
DECODE_CANDIDATES = tuple(
    {"target_programs": p, "num_warps": w, "blocks_per_step": n}
    for p, w, n in itertools.product((264, 528, 1056), (4, 8), (1, 2, 4))
)
"""Decode attention's candidate configurations, for every tier."""


def main_decode_cases(
    cfg: ModelConfig,
    dtype: torch.dtype,
    limits: dict[str, int],
    kv_fp8: bool,
    budget: int = CASE_CACHE_BYTES,
) -> list[tuple[int, int]]:
    """``DECODE_CASES`` within the engine's limits and ``budget`` bytes of cache each (the
    build passes the least of ``CASE_CACHE_BYTES`` and a quarter of the free memory)."""
    item = 1 if kv_fp8 else torch.empty((), dtype=dtype).element_size()
    token = 2 * cfg.num_key_value_heads * cfg.head_dim * item  # a token's K and V
    out = []
    for b, c in DECODE_CASES:
        c = min(c, limits["max_seq_len"])
        out.append((max(1, min(b, limits["max_batch_size"], budget // (token * c))), c))
    return out


SMALL_BATCH = 8
"""Decode steps of at most this many sequences take decode attention's ``small_batch``
configuration, tuned on ``SMALL_BATCH_CASES`` (sequences, context)."""
SMALL_BATCH_CASES = ((1, 256), (1, 2048), (8, 512))
SMALL_BATCH_BLOCKS_PER_STEP = (1,)
"""The ``blocks_per_step`` values the small-batch tier may pick. On an H200 (2026-12-02,
``results/2026-12-02-h200-small-batch-bps-1034885.json``) the graph-timed cases put 4
first (1,056 / 4 / 4 at 21.9 µs for the three cases, 1 at 24.4), yet in the engine that
choice cost int4-awq + int4 head 2.55 / 2.99 / 3.42 ms TPOT at 1 / 4 / 8 sequences
against 1.97 / 2.22 / 2.53 with 1,056 / 4 / 1, the rest of the tuning the same (fp8 +
fp8 KV: 4.67 / 5.24 / 6.09 against 4.63 / 5.23 / 5.87). The cases time each candidate
alone, not behind the step's other kernels as the engine's PDL chain runs it; until they
do, the tier takes one block a step."""
MEDIUM_BATCH = 64
"""Steps of more sequences than ``SMALL_BATCH``, up to this many, take ``medium_batch``,
tuned on ``MEDIUM_BATCH_CASES`` the same way (graph-timed, the engine's limit as
``max_seq_len``). On an H200 the candidates spread 10.9-16.1 µs a call at 16 sequences of
200 tokens and 14.8-23.7 at 32 (``results/2026-12-01-h200-decode-configs-1-16-32-780f028
.json``), where the single-call throughput cases had picked 528/4/1, 1,056/4/4 and
264/4/2 in three builds of the same model."""
MEDIUM_BATCH_CASES = ((16, 256), (32, 1024), (64, 512))


def projection_shapes(cfg: ModelConfig) -> set[tuple[int, int]]:
    """(N, K) of a layer's four projections: qkv, o, gate_up, down."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {(cfg.q_size + 2 * cfg.kv_size, h), (h, cfg.q_size), (2 * i, h), (h, i)}


def skinny_shapes(cfg: ModelConfig, quant: QuantConfig | None,
                  dense_layers: bool = True) -> set[tuple[int, int]]:  # fmt: skip
    """The (N, K) of the projections left in the engine's dtype, which the skinny matmul
    serves: a layer's four where some layer may keep them (``dense_layers``: no
    quantization, excluded modules, the quality gate's auto-exclusion, or a pre-quantized
    checkpoint's unconverted modules, which the builder cannot see here), and the head's
    unless it is quantized."""
    shapes = projection_shapes(cfg) if dense_layers or quant is None or not quant.algo else set()
    if quant is None or not quant.algo or not quant.quantize_lm_head:
        shapes.add((cfg.vocab_size, cfg.hidden_size))
    return shapes
