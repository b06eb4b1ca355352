"""Paged attention over a block-table KV cache: the reference implementation.

The KV cache of one layer is a tensor of shape (2, num_blocks, tokens_per_block, Hk, D):
index 0 holds keys, 1 values. A sequence's tokens live in the blocks its row of
``block_tables`` lists, in order. Every step's new tokens are first written at
``slot_mapping`` (flat index ``block * tokens_per_block + offset``), then each query attends
causally to all cached tokens of its sequence, including the ones just written.

An fp8 cache (dtype ``KV_FP8``, float8 e4m3) comes with the layer's ``kv_scale``: a (2,)
float32 tensor (or pair of floats) of the (k, v) scales, a value being ``stored * scale``.
Writes divide by the scale, saturate to +-448 and round to e4m3; reads dequantize to float32
before the dot products. Without ``kv_scale`` an fp8 cache uses the scales 1.0.

An fp8 cache also stores its values transposed within each block: block b's values of kv
head h are one contiguous (D, tokens_per_block) tile, so that the fp8 operand of the P @ V
dot is contiguous along its reduction (the tokens), as the keys are along D for Q @ K^T.
With token-major values Triton reads that operand from shared memory one byte at a time
on Hopper; transposed, decode attention over an fp8 cache ran 23-33 % faster (H200,
``scripts/experiments/fp8kv_decode_vt.py``). The tensor's shape is the same either way;
``cache_values`` gives the values in (blocks, tokens_per_block, Hk, D) order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from kiln.kernels._triton import use_triton
from kiln.kernels.tuning import tuned

KV_FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
KvScale = tuple[float, float] | torch.Tensor | None


def fp8_scales(kv_cache: torch.Tensor, kv_scale: KvScale) -> torch.Tensor | None:
    """The (2,) float32 (k, v) scales of an fp8 cache on its device (1.0 when none are
    given); None for a cache in another dtype, whose path stays as it was."""
    if kv_cache.dtype != KV_FP8:
        return None
    if not kv_cache.is_contiguous():  # the transposed values are addressed per block
        raise ValueError(
            f"an fp8 KV cache's values must be contiguous, got strides {kv_cache.stride()}"
        )
    if kv_scale is None:
        return torch.ones(2, dtype=torch.float32, device=kv_cache.device)
    return torch.as_tensor(kv_scale, dtype=torch.float32, device=kv_cache.device)


def values_transposed(kv_cache: torch.Tensor) -> bool:
    """Whether the cache stores values transposed per (block, kv head): fp8 caches do."""
    return kv_cache.dtype == KV_FP8


def cache_values(kv_cache: torch.Tensor) -> torch.Tensor:
    """The values of a (2, num_blocks, tokens_per_block, Hk, D) cache as a (num_blocks,
    tokens_per_block, Hk, D) view, whichever way they are stored."""
    if not values_transposed(kv_cache):
        return kv_cache[1]
    _, nb, bs, hk, d = kv_cache.shape
    return kv_cache[1].view(nb, hk, d, bs).permute(0, 3, 1, 2)


def dequantize_cache(kv_cache: torch.Tensor, kv_scale: KvScale = None) -> torch.Tensor:
    """A float32 copy of the cache in the token-major layout (values as ``cache_values``
    orders them), an fp8 cache's entries times their scales: attention over it equals
    attention over the cache."""
    s = fp8_scales(kv_cache, kv_scale)
    out = torch.stack((kv_cache[0].float(), cache_values(kv_cache).float()))
    return out if s is None else out * s.view(2, 1, 1, 1, 1)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in float32, saturated to +-448, rounded to e4m3 (nearest, ties to even)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(KV_FP8)


@dataclass
class AttentionMetadata:
    """How one step's flattened tokens split into sequences. Built by the model runner."""

    query_start_loc: torch.Tensor
    """(num_seqs + 1,) int32: start of each sequence's new tokens in the step's tokens."""
    seq_lens: torch.Tensor
    """(num_seqs,) int32: each sequence's context length after this step (cached + new)."""
    block_tables: torch.Tensor
    """(num_seqs, max_blocks_per_seq) int32: KV block ids of each sequence, padded with 0."""
    slot_mapping: torch.Tensor
    """(num_tokens,) int64: cache slot each new token's K/V is written to."""
    query_start_loc_cpu: list[int]
    """Host copy of ``query_start_loc`` (the reference path loops over sequences)."""
    seq_lens_cpu: list[int]
    """Host copy of ``seq_lens``."""
    decode_only: bool = False
    """Every sequence has exactly one new token (a CUDA-graph decode step): the dispatcher
    then reads neither host list, and nothing it launches depends on them."""
    max_seq_len: int = 0
    """With ``decode_only``: an upper bound of every ``seq_lens`` entry (the engine's limit)."""
    fresh_prefill: bool = True
    """Whole prompts (nothing cached before the step) may attend over their own keys and
    values as computed rather than as the cache holds them (an fp8 cache, on the GPU);
    the quality measurement turns this off, so that it sees every read through the cache."""

    _split: StepRows | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def split_rows(self) -> StepRows:
        """The step's decode and prefill sequences (``StepRows``), made once per step (every
        layer asks). The indices are copied without waiting for the device's queued work
        (pinned memory, asynchronous): a plain host-to-device copy of a list waits for the
        queued kernels, which stalled every layer's launches in mixed steps."""
        if self._split is None:
            starts = self.query_start_loc_cpu
            n = self.num_seqs
            decode = [i for i in range(n) if starts[i + 1] - starts[i] == 1]
            prefill = [i for i in range(n) if starts[i + 1] - starts[i] > 1]
            dev = self.seq_lens.device
            tables = lens = first = None
            lens_cpu = self.seq_lens_cpu
            whole = [i for i in prefill if lens_cpu[i] == starts[i + 1] - starts[i]]
            rest = [i for i in prefill if lens_cpu[i] != starts[i + 1] - starts[i]]
            if decode:
                idx = to_device(decode, torch.int64, dev)
                tables, lens = self.block_tables[idx], self.seq_lens[idx]
                first = self.query_start_loc[idx]
            self._split = StepRows(
                decode,
                tables,
                lens,
                first,
                max((self.seq_lens_cpu[i] for i in decode), default=0),
                prefill,
                to_device(prefill, torch.int32, dev) if 0 < len(prefill) < n else None,
                max((starts[i + 1] - starts[i] for i in prefill), default=0),
                whole,
                to_device(whole, torch.int32, dev) if 0 < len(whole) < n else None,
                to_device(rest, torch.int32, dev) if whole and rest else None,
                max((starts[i + 1] - starts[i] for i in whole), default=0),
                max((starts[i + 1] - starts[i] for i in rest), default=0),
            )
        return self._split


class StepRows(NamedTuple):
    """One step's sequences split by kind, for the attention dispatcher."""

    decode: list[int]
    """Sequences of one new token."""
    decode_tables: torch.Tensor | None
    """Their block-table rows, context lengths and token indices on the device (None if no
    decode sequence)."""
    decode_lens: torch.Tensor | None
    decode_first: torch.Tensor | None
    decode_max_ctx: int
    prefill: list[int]
    """Sequences of several new tokens."""
    prefill_rows: torch.Tensor | None
    """Their indices on the device; None when there are none or when all sequences are."""
    prefill_max_new: int
    whole: list[int]
    """Of the prefill sequences, those with nothing cached before this step."""
    whole_rows: torch.Tensor | None
    """``whole`` on the device (None when there are none or when all sequences are), and
    the other prefill sequences (None when there are none, or when no sequence is whole),
    with their most new tokens."""
    rest_rows: torch.Tensor | None
    whole_max_new: int
    rest_max_new: int


def to_device(data: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without waiting for the device: through pinned memory
    and an asynchronous copy on CUDA (a pageable copy would wait for the queued work)."""
    t = torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def write_kv_ref(
    k: torch.Tensor,  # (T, Hk, D)
    v: torch.Tensor,  # (T, Hk, D)
    kv_cache: torch.Tensor,  # (2, num_blocks, tokens_per_block, Hk, D)
    slot_mapping: torch.Tensor,  # (T,) int64
    kv_scale: KvScale = None,  # an fp8 cache's (k, v) scales
) -> None:
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
    s = fp8_scales(kv_cache, kv_scale)
    if s is not None:
        flat[0, slot_mapping] = quantize_fp8(k, s[0])
        bs = kv_cache.shape[2]  # values transposed per block: index (block, offset)
        cache_values(kv_cache)[slot_mapping // bs, slot_mapping % bs] = quantize_fp8(v, s[1])
        return
    flat[0, slot_mapping] = k.to(kv_cache.dtype)
    flat[1, slot_mapping] = v.to(kv_cache.dtype)


def paged_attention_ref(
    q: torch.Tensor,  # (T, Hq, D)
    kv_cache: torch.Tensor,  # (2, num_blocks, tokens_per_block, Hk, D)
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    kv_scale: KvScale = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context.
    Returns (T, Hq, D) in q's dtype. Softmax in float32. An fp8 cache is dequantized
    (``stored.float() * scale``) before the dot products."""
    out = torch.empty_like(q)
    s = fp8_scales(kv_cache, kv_scale)
    starts = meta.query_start_loc_cpu
    decode = [i for i in range(meta.num_seqs) if starts[i + 1] - starts[i] == 1]
    if len(decode) > 1:
        _decode_batched(q, kv_cache, meta, scale, sliding_window, decode, out, s)
    else:
        decode = []
    _per_sequence(q, kv_cache, meta, scale, sliding_window, set(decode), out, s)
    return out


def _per_sequence(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    skip: set[int],
    out: torch.Tensor,
    s: torch.Tensor | None = None,  # fp8 (k, v) scales
) -> None:
    """The reference loop over sequences (all but those in ``skip``)."""
    _, _, bs, hk, d = kv_cache.shape
    hq = q.shape[1]
    starts = meta.query_start_loc_cpu
    for i, ctx in enumerate(meta.seq_lens_cpu):
        if i in skip:
            continue
        qs, qe = starts[i], starts[i + 1]
        n_blocks = -(-ctx // bs)
        blocks = meta.block_tables[i, :n_blocks].long()
        k = kv_cache[0, blocks].reshape(-1, hk, d)[:ctx]  # (ctx, Hk, D)
        v = cache_values(kv_cache)[blocks].reshape(-1, hk, d)[:ctx]
        if s is not None:
            k, v = k.float() * s[0], v.float() * s[1]
        if q.is_cuda and ctx == qe - qs and sliding_window is None:
            # a whole prompt at once: torch's fused causal kernel in the model dtype (flash
            # attention for half precision: fp32 accumulation, no (L, ctx) score matrix)
            o = F.scaled_dot_product_attention(
                q[qs:qe].transpose(0, 1),
                k.transpose(0, 1).to(q.dtype),
                v.transpose(0, 1).to(q.dtype),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
        else:
            qi = q[qs:qe].transpose(0, 1).float()  # (Hq, L, D)
            ki = k.transpose(0, 1).float().repeat_interleave(hq // hk, dim=0)  # (Hq, ctx, D)
            vi = v.transpose(0, 1).float().repeat_interleave(hq // hk, dim=0)
            q_pos = torch.arange(ctx - (qe - qs), ctx, device=q.device).unsqueeze(1)  # (L, 1)
            k_pos = torch.arange(ctx, device=q.device).unsqueeze(0)  # (1, ctx)
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
            scores = (qi @ ki.transpose(1, 2)) * scale  # (Hq, L, ctx)
            o = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vi
        out[qs:qe] = o.transpose(0, 1).to(q.dtype)


def _decode_batched(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    rows: list[int],
    out: torch.Tensor,
    s: torch.Tensor | None = None,  # fp8 (k, v) scales
) -> None:
    """All single-token (decode) sequences at once: gather their blocks padded to the longest
    context, mask the padding. Same math as the per-sequence loop, batched."""
    _, _, bs, hk, d = kv_cache.shape
    b = len(rows)
    idx = torch.tensor(rows, device=q.device)
    tok = torch.tensor([meta.query_start_loc_cpu[i] for i in rows], device=q.device)
    lens = meta.seq_lens[idx].long()  # (B,)
    n_blocks = -(-max(meta.seq_lens_cpu[i] for i in rows) // bs)
    tables = meta.block_tables[idx, :n_blocks].long()  # (B, n_blocks)
    k = kv_cache[0][tables].reshape(b, n_blocks * bs, hk, d).float()  # (B, S, Hk, D)
    v = cache_values(kv_cache)[tables].reshape(b, n_blocks * bs, hk, d).float()
    if s is not None:
        k, v = k * s[0], v * s[1]
    qd = q[tok].reshape(b, hk, -1, d).float()  # (B, Hk, G, D): G query heads per kv head
    scores = torch.einsum("bhgd,bshd->bhgs", qd, k) * scale  # (B, Hk, G, S)
    pos = torch.arange(n_blocks * bs, device=q.device)[None, :]  # (1, S)
    valid = pos < lens[:, None]  # (B, S)
    if sliding_window is not None:
        valid &= pos > lens[:, None] - 1 - sliding_window
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    o = torch.einsum("bhgs,bshd->bhgd", scores.softmax(-1), v)  # (B, Hk, G, D)
    out[tok] = o.reshape(b, -1, d).to(q.dtype)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    kv_scale: KvScale = None,
    fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Dispatcher: on CUDA, decode tokens go to the Triton flash-decoding kernel and
    multi-token (prefill) sequences to the Triton prefill kernel; elsewhere the reference
    does all. ``fresh_kv``: the step's own (T, Hk, D) keys (rotated as q is) and values;
    whole prompts (``StepRows.whole``) then attend over these instead of the cache."""
    if not use_triton(q):
        return paged_attention_ref(q, kv_cache, meta, scale, sliding_window, kv_scale)
    s = fp8_scales(kv_cache, kv_scale)
    from kiln.kernels.decode_attention import decode_attention_triton

    if meta.decode_only:
        out = torch.empty_like(q)
        decode_attention_triton(
            q,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc[:-1],
            out,
            scale,
            meta.max_seq_len,
            sliding_window,
            kv_scale=s,
        )
        return out
    split = meta.split_rows()
    out = torch.empty_like(q)
    if split.decode:
        decode_attention_triton(
            q,
            kv_cache,
            split.decode_tables,
            split.decode_lens,
            split.decode_first,
            out,
            scale,
            split.decode_max_ctx,
            sliding_window,
            kv_scale=s,
        )
    if split.prefill:
        from kiln.kernels.prefill_attention import prefill_attention_triton

        cfg = tuned("prefill_attention")
        args = (q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out, scale)
        if fresh_kv is not None and split.whole:
            prefill_attention_triton(*args, split.whole_max_new, sliding_window,
                                     split.whole_rows, kv_scale=s, fresh_kv=fresh_kv,
                                     **cfg)  # fmt: skip
            if split.rest_rows is not None:
                prefill_attention_triton(*args, split.rest_max_new, sliding_window,
                                         split.rest_rows, kv_scale=s, **cfg)  # fmt: skip
        else:
            prefill_attention_triton(*args, split.prefill_max_new, sliding_window,
                                     split.prefill_rows, kv_scale=s, **cfg)  # fmt: skip
    return out


write_kv = write_kv_ref
