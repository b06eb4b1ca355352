"""The Triton paged prefill attention kernel against ``paged_attention_ref``, fresh random
inputs: sequences with different cached prefixes (none, part of a block, several blocks)
and new-token counts (1, odd), scattered blocks, GQA/MQA, sliding windows, odd head sizes.
On the CPU the kernel runs under the Triton interpreter (tests/conftest.py), so sizes are
small there; on a GPU larger sizes and every tuning candidate run too.
Cache slots no sequence owns, and those past a sequence's end, hold NaN: a kernel that
lets one of them into its result fails. Tolerances as in tests/test_triton_kernels.py."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.attention import AttentionMetadata, paged_attention, paged_attention_ref
from kiln.kernels.prefill_attention import prefill_attention_triton, prefill_config_candidates

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 4 * 2**-8, torch.float16: 4 * 2**-8}
# (cached prefix, new tokens) per sequence: one token only; a prompt; prefixes ending inside
# a block, on a block edge, after several blocks; one new token after a prefix
SEQS = [(0, 7), (5, 37), (16, 20), (40, 13), (3, 1), (0, 1)]


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    scale = b.float().abs().max().clamp_min(1e-30)
    rel = float((a.float() - b.float()).abs().max() / scale)
    assert rel <= TOL[dtype], f"relative error {rel:.3e} > {TOL[dtype]:.1e}"


def _case(
    seqs: list[tuple[int, int]],
    hq: int,
    hk: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
    poison: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    ctx = [p + n for p, n in seqs]
    new = [n for _, n in seqs]
    nblocks = sum(-(-c // bs) for c in ctx) + 3
    cache = torch.randn(2, nblocks, bs, hk, d, device=DEV, dtype=dtype)
    perm = torch.randperm(nblocks).tolist()
    tables = [[perm.pop() for _ in range(-(-c // bs))] for c in ctx]
    if poison:
        owned = torch.zeros(nblocks, bs, dtype=torch.bool)
        for c, t in zip(ctx, tables, strict=True):
            owned[t] = True
            owned[t[-1], c - (len(t) - 1) * bs :] = False
        cache[:, ~owned.to(DEV)] = float("nan")
    width = max(map(len, tables))
    starts = [0, *torch.tensor(new).cumsum(0).tolist()]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(ctx, dtype=torch.int32, device=DEV),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEV
        ),
        slot_mapping=torch.zeros(sum(new), dtype=torch.long, device=DEV),
        query_start_loc_cpu=starts,
        seq_lens_cpu=ctx,
    )
    q = torch.randn(sum(new), hq, d, device=DEV, dtype=dtype)
    return q, cache, meta


def _ref(
    q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, window: int | None = None
) -> torch.Tensor:
    """The reference, which reads only owned slots, but also pads with some (batched decode
    masks their scores, not the values): it gets the cache with the NaNs zeroed."""
    return paged_attention_ref(q, cache.nan_to_num(0.0), meta, q.shape[-1] ** -0.5, window)


def _run(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None = None,
    rows: list[int] | None = None,
    **config: int,
) -> torch.Tensor:
    out = torch.zeros_like(q)
    starts = meta.query_start_loc_cpu
    todo = rows if rows is not None else range(meta.num_seqs)
    prefill_attention_triton(
        q,
        cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        out,
        q.shape[-1] ** -0.5,
        max(starts[i + 1] - starts[i] for i in todo),
        window,
        None if rows is None else torch.tensor(rows, dtype=torch.int32, device=DEV),
        **config,
    )
    return out


@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 9])
def test_prefill_kernel_gqa_and_window(hq: int, hk: int, window: int | None) -> None:
    """MHA, GQA with 4 query heads per kv head, MQA with 6 (not a power of two)."""
    torch.manual_seed(hq * 10 + hk)
    q, cache, meta = _case(SEQS, hq, hk, 32, 16, torch.float32)
    out = _run(q, cache, meta, window, BLOCK_M=32, BLOCK_N=16)
    _close(out, _ref(q, cache, meta, window), torch.float32)


@pytest.mark.parametrize(
    "d,bs,config,window",
    [
        (48, 16, {"BLOCK_M": 16, "BLOCK_N": 32}, None),  # D padded; a key tile spans blocks
        (80, 32, {"BLOCK_M": 64, "BLOCK_N": 16}, 20),  # a block holds two key tiles
        (64, 8, {"BLOCK_M": 32, "BLOCK_N": 64}, 20),  # eight blocks per key tile
        (32, 24, {"BLOCK_M": 32, "BLOCK_N": 16}, 30),  # tiles straddle 24-token blocks
    ],
)
def test_prefill_kernel_head_sizes_and_tiles(
    d: int, bs: int, config: dict[str, int], window: int | None
) -> None:
    torch.manual_seed(d)
    q, cache, meta = _case(SEQS[:4], 8, 2, d, bs, torch.float32)
    out = _run(q, cache, meta, window, **config)
    _close(out, _ref(q, cache, meta, window), torch.float32)


def test_prefill_kernel_splits_query_heads_of_a_kv_head() -> None:
    """MQA with more query heads than a tile has rows: the heads split over programs."""
    torch.manual_seed(1)
    q, cache, meta = _case([(9, 5), (0, 3)], 32, 1, 16, 16, torch.float32)
    out = _run(q, cache, meta, BLOCK_M=16, BLOCK_N=16)
    _close(out, _ref(q, cache, meta), torch.float32)


@pytest.mark.parametrize("dtype,window", [(torch.bfloat16, 12), (torch.float16, None)])
def test_prefill_kernel_half_precision(dtype: torch.dtype, window: int | None) -> None:
    torch.manual_seed(2)
    q, cache, meta = _case(SEQS, 8, 2, 64, 16, dtype)
    out = _run(q, cache, meta, window, BLOCK_M=64, BLOCK_N=32)
    _close(out, _ref(q, cache, meta, window), dtype)


def test_prefill_kernel_rows_subset_leaves_other_rows_alone() -> None:
    torch.manual_seed(4)
    q, cache, meta = _case(SEQS, 8, 2, 32, 16, torch.float32)
    rows = [1, 3, 4]
    out = _run(q, cache, meta, rows=rows, BLOCK_M=32, BLOCK_N=32)
    ref = _ref(q, cache, meta)
    starts = meta.query_start_loc_cpu
    for i in range(meta.num_seqs):
        got, want = out[starts[i] : starts[i + 1]], ref[starts[i] : starts[i + 1]]
        if i in rows:
            _close(got, want, torch.float32)
        else:
            assert not got.any()


def test_prefill_kernel_default_config() -> None:
    """The default launch (the first candidate) of the model dtypes, Llama's head shape."""
    torch.manual_seed(5)
    q, cache, meta = _case([(40, 13), (0, 9)], 8, 2, 128, 32, torch.bfloat16)
    assert prefill_config_candidates(128, torch.bfloat16)[0]["BLOCK_M"] == 128
    _close(_run(q, cache, meta), _ref(q, cache, meta), torch.bfloat16)


def test_config_candidates_fit_every_head_size() -> None:
    for d in (48, 64, 80, 128, 256):
        for dtype in (torch.float32, torch.bfloat16):
            configs = prefill_config_candidates(d, dtype)
            assert configs and all(
                c.keys() == {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"} for c in configs
            )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 700])
def test_prefill_kernel_llama_sizes_on_gpu(dtype: torch.dtype, window: int | None) -> None:
    """Four sequences of about 1000 new tokens, Llama-3.1-8B's heads (32/8, D=128)."""
    torch.manual_seed(6)
    seqs = [(0, 1000), (77, 1001), (2048, 999), (500, 1024)]
    q, cache, meta = _case(seqs, 32, 8, 128, 32, dtype)
    out = _run(q, cache, meta, window)
    _close(out, _ref(q, cache, meta, window), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("config", prefill_config_candidates(128, torch.bfloat16))
def test_prefill_kernel_every_candidate_on_gpu(config: dict[str, int]) -> None:
    torch.manual_seed(7)
    q, cache, meta = _case([(0, 333), (100, 257), (31, 1)], 32, 8, 128, 32, torch.bfloat16)
    out = _run(q, cache, meta, **config)
    _close(out, _ref(q, cache, meta), torch.bfloat16)


@pytest.mark.gpu
def test_attention_dispatcher_prefill_with_window_on_gpu() -> None:
    """A mixed step through the dispatcher with a sliding window (bf16), no NaN slots."""
    torch.manual_seed(8)
    seqs = [(699, 1), (0, 300), (32, 1), (3999, 1), (70, 20), (0, 513)]
    q, cache, meta = _case(seqs, 32, 8, 128, 32, torch.bfloat16, poison=False)
    for window in (None, 128):
        _close(
            paged_attention(q, cache, meta, 128**-0.5, window),
            _ref(q, cache, meta, window),
            torch.bfloat16,
        )


def test_attention_dispatcher_mixed_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatcher's Triton route (decode and prefill kernels for one step) equals the
    reference, the window passed to both; on the CPU it is forced onto the interpreter."""
    import kiln.kernels.attention as attention

    monkeypatch.setattr(attention, "use_triton", lambda x: True)
    torch.manual_seed(9)
    q, cache, meta = _case([*SEQS, (20, 1)], 8, 2, 32, 16, torch.float32, poison=False)
    out = paged_attention(q, cache, meta, 32**-0.5, 10)
    _close(out, _ref(q, cache, meta, 10), torch.float32)
    # the split into decode and prefill sequences is made once per step (every layer asks)
    split = meta.split_rows()
    assert paged_attention(q, cache, meta, 32**-0.5, 10) is not out and meta.split_rows() is split
    starts = meta.query_start_loc_cpu
    n_new = [starts[i + 1] - starts[i] for i in range(meta.num_seqs)]
    assert split.decode == [i for i, n in enumerate(n_new) if n == 1]
    assert split.prefill == [i for i, n in enumerate(n_new) if n > 1]
    assert split.decode_lens.tolist() == [meta.seq_lens_cpu[i] for i in split.decode]
    assert split.decode_first.tolist() == [starts[i] for i in split.decode]
    assert split.prefill_rows.tolist() == split.prefill
    assert split.prefill_max_new == max(n_new)


@pytest.mark.parametrize(
    "seqs",
    [
        [(0, 5), (3, 7)],  # prompts only: every sequence is processed, no row list
        [(9, 1), (4, 1)],  # decode only
        [(9, 1), (0, 6), (4, 1)],  # mixed
    ],
)
def test_split_rows_by_kind(seqs: list[tuple[int, int]]) -> None:
    """``AttentionMetadata.split_rows``: decode sequences' block-table rows, lengths, token
    starts and longest context; prefill sequences, with a device row list only when some
    sequences are left out; made once and kept."""
    _, _, meta = _case(seqs, 4, 2, 16, 4, torch.float32, poison=False)
    split = meta.split_rows()
    starts = meta.query_start_loc_cpu
    decode = [i for i, (_, n) in enumerate(seqs) if n == 1]
    prefill = [i for i, (_, n) in enumerate(seqs) if n > 1]
    assert (split.decode, split.prefill) == (decode, prefill)
    if decode:
        assert torch.equal(split.decode_tables, meta.block_tables[decode])
        assert split.decode_lens.tolist() == [meta.seq_lens_cpu[i] for i in decode]
        assert split.decode_first.tolist() == [starts[i] for i in decode]
        assert split.decode_max_ctx == max(p + n for p, n in (seqs[i] for i in decode))
    else:
        assert split.decode_tables is None and split.decode_max_ctx == 0
    if prefill and decode:
        assert split.prefill_rows.dtype == torch.int32 and split.prefill_rows.tolist() == prefill
    else:
        assert split.prefill_rows is None
    assert split.prefill_max_new == max((seqs[i][1] for i in prefill), default=0)
    assert meta.split_rows() is split
