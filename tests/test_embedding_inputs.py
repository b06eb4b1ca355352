"""The embedding lookup that resolves placeholder ids (overlapped stepping's tokens still on
the device) against its reference, and the CUDA graphs' packed static inputs
(``GraphInputs``), filled on the CPU. The kernel runs under the Triton interpreter here
(tests/conftest.py) and compiled on a GPU; a lookup copies rows, so the results must be
equal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.kernels.embedding import embed, embed_ref, embed_triton, placeholder
from kiln.runtime.cuda_graphs import GraphInputs
from kiln.runtime.scheduler import ScheduledSequence, SchedulerOutput
from kiln.runtime.sequence import PENDING_TOKEN, Sequence
from kiln.sampling_params import SamplingParams

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "t,hidden", [(1, 8), (5, 577), (13, 1000)] + ([(64, 4096)] if DEV == "cuda" else [])
)
def test_embedding_with_placeholders_matches_reference(
    dtype: torch.dtype, t: int, hidden: int
) -> None:
    gen = torch.Generator().manual_seed(t * hidden)
    vocab = 301
    weight = torch.randn(vocab, hidden, generator=gen).to(DEV, dtype)
    ids = torch.randint(0, vocab, (t,), generator=gen)
    prev_all = torch.randint(0, vocab, (t + 9,), generator=gen).to(DEV)
    prev = prev_all[2 : t + 5]  # a view that does not start its buffer
    rows = torch.randperm(prev.numel(), generator=gen)[: (t + 1) // 2]
    at = torch.randperm(t, generator=gen)[: rows.numel()]
    ids[at] = torch.tensor([placeholder(int(r)) for r in rows])
    ids = ids.to(DEV)
    want_ids = ids.clone()
    want_ids[at.to(DEV)] = prev[rows.to(DEV)]
    want = F.embedding(want_ids, weight)
    assert torch.equal(embed_ref(ids, weight, prev), want)
    assert torch.equal(embed_triton(ids, weight, prev), want)
    assert torch.equal(embed(ids, weight, prev), want)  # the dispatcher's pick
    clean = want_ids
    assert torch.equal(embed(clean, weight), want)  # no placeholders: F.embedding
    assert embed_triton(ids[:0], weight, prev).shape == (0, hidden)
    with pytest.raises(ValueError, match="int64"):
        embed_triton(ids.int(), weight, prev)


def test_placeholder_encoding() -> None:
    assert [placeholder(r) for r in (0, 1, 41)] == [-1, -2, -42]
    assert placeholder(0) == PENDING_TOKEN  # a placeholder is always rewritten with its row


def _decode(n_prompt: int, blocks: list[int], pending: bool) -> Sequence:
    seq = Sequence(f"s{n_prompt}", list(range(3, 3 + n_prompt)), SamplingParams(), 999)
    seq.output_token_ids = [PENDING_TOKEN] if pending else [77]
    seq.num_pending = int(pending)
    seq.num_computed = n_prompt
    seq.block_ids = blocks
    return seq


def test_graph_inputs_fill_one_region_per_batch_size() -> None:
    """Three decodes padded to a graph of 4 rows: ids (a placeholder where the token is
    pending), positions, slots and lengths land in batch size 4's region after one copy,
    padding rows in the null block; other sizes' regions stay as they were; the tokens
    are copied into ``prev`` unless they are ``prev``."""
    dev = torch.device("cpu")
    gi = GraphInputs([1, 4, 8], width=5, device=dev)
    null, bs = 9, 4
    gi.reset(null, bs)
    seqs = [_decode(5, [2, 6], True), _decode(2, [1], False), _decode(11, [3, 4, 5], True)]
    step = SchedulerOutput()
    step.scheduled = [ScheduledSequence(s, 1) for s in seqs]
    tokens = torch.tensor([50, 60, 70])
    patch = ([0, 2], [2, 0], tokens)
    width = gi.fill(step, 4, null, bs, patch)
    gi.send(4, width)
    ids, pos, slots, lens = gi.views(4)
    assert width == 3
    assert ids.tolist() == [placeholder(2), 77, placeholder(0), 0]
    assert pos.tolist() == [5, 2, 11, 0]
    assert slots.tolist() == [6 * bs + 1, 1 * bs + 2, 5 * bs + 3, null * bs]
    assert lens.dtype == torch.int32 and lens.tolist() == [6, 3, 12, 1]
    assert gi.tables[:4, :3].tolist() == [[2, 6, 0], [1, 0, 0], [3, 4, 5], [null, 0, 0]]
    assert gi.prev[:3].tolist() == [50, 60, 70]
    for g in (1, 8):  # untouched
        o_ids, o_pos, o_slots, o_lens = gi.views(g)
        assert set(o_slots.tolist()) == {null * bs} and set(o_lens.tolist()) == {1}
        assert not o_ids.any() and not o_pos.any()
    # tokens sampled into prev (the sampler's out=): read in place, nothing copied
    gi.prev[:3] = torch.tensor([1, 2, 3])
    gi.fill(step, 4, null, bs, ([0], [1], gi.prev[:3]))
    assert gi.prev[:3].tolist() == [1, 2, 3]
    # the embedding of a graph's ids resolves through prev
    gi.send(4, width)
    weight = torch.randn(100, 6)
    ids = gi.views(4)[0]
    got = embed(ids, weight, gi.prev)
    assert torch.equal(got[0], weight[2]) and torch.equal(got[1], weight[77])


def test_graph_inputs_table_rows_follow_every_change() -> None:
    """Host table rows are rewritten only when their blocks changed (a list compare), so
    every change must show: a block appended, blocks replaced in place at the same count
    (preemption, copy-on-write), another sequence in the row, a row padded then reused.
    (Columns past a row's blocks are not read: the context length stops before them.)"""
    gi = GraphInputs([2, 4], width=4, device=torch.device("cpu"))
    gi.reset(9, 4)
    a, b = _decode(5, [2, 6], False), _decode(2, [1], False)

    def table(seqs: list[Sequence], g: int) -> list[list[int]]:
        step = SchedulerOutput()
        step.scheduled = [ScheduledSequence(s, 1) for s in seqs]
        gi.send(g, gi.fill(step, g, 9, 4, None))
        rows = gi.tables.tolist()
        return [rows[i][: len(s.block_ids)] for i, s in enumerate(seqs)]

    assert table([a, b], 2) == [[2, 6], [1]]
    a.block_ids.append(7)
    assert table([a, b], 2) == [[2, 6, 7], [1]]
    a.block_ids[:] = [3, 4, 5]  # same count, new blocks
    b.block_ids[0] = 8
    assert table([a, b], 2) == [[3, 4, 5], [8]]
    assert table([b, a], 2) == [[8], [3, 4, 5]]  # swapped rows
    assert table([b], 2) == [[8]] and gi.tables[1, 0] == 9  # row 1 padded: null block
    assert table([b, a], 2) == [[8], [3, 4, 5]]  # row 1 written again


def test_graph_inputs_fields_are_16_byte_aligned() -> None:
    """Every field of every batch size's region starts 16-byte aligned, odd sizes too, as
    the eager steps' fresh tensors do: Triton specializes its kernels on that."""
    gi = GraphInputs([1, 3, 4, 7], width=2, device=torch.device("cpu"))
    for g in (1, 3, 4, 7):
        for t in gi.views(g):
            assert t.data_ptr() % 16 == 0 and t.numel() == g and t.is_contiguous()


def test_graph_inputs_skip_the_table_copy_only_when_the_device_holds_it() -> None:
    """The table's copy is skipped when no host row changed since a copy that covered the
    step's rows and columns. 400 random steps (sequences appended to, replaced in place,
    reordered, dropped; graphs of other sizes): after each send the device rows hold every
    sequence's blocks and the padding rows the null block; most unchanged steps skip."""
    import random

    rng = random.Random(0)
    sizes, null, bs = [1, 2, 4, 8], 99, 4
    gi = GraphInputs(sizes, width=12, device=torch.device("cpu"))
    gi.reset(null, bs)
    seqs = [_decode(3, [rng.randrange(90)], False) for _ in range(8)]

    def send(active: list[Sequence], g: int) -> list[list[int]]:
        step = SchedulerOutput()
        step.scheduled = [ScheduledSequence(s, 1) for s in active]
        gi.send(g, gi.fill(step, g, null, bs, None))
        return gi.tables.tolist()

    send(seqs[:2], 2)
    skips = gi.table_skips
    assert [r[:1] for r in send(seqs[:2], 2)[:2]] == [seqs[0].block_ids, seqs[1].block_ids]
    assert gi.table_skips == skips + 1  # nothing changed: skipped
    assert send(seqs[:1], 2)[1][0] == null  # row 1 now padding: copied
    assert gi.table_skips == skips + 1
    active = seqs[:1]
    for _ in range(400):
        r = rng.random()
        if r < 0.05:
            active = rng.sample(seqs, rng.randint(1, 8))
        elif r < 0.10:
            s = rng.choice(active)
            s.block_ids[:] = [rng.randrange(90) for _ in s.block_ids]
        elif r < 0.25:
            s = rng.choice(active)
            if len(s.block_ids) < 12:
                s.block_ids.append(rng.randrange(90))
        b = len(active)
        g = rng.choice([x for x in sizes if x >= b])
        rows = send(active, g)
        for i, s in enumerate(active):
            assert rows[i][: len(s.block_ids)] == s.block_ids
        assert all(rows[i][0] == null for i in range(b, g))
    assert gi.table_skips > 200 and gi.table_copies > 20, (gi.table_skips, gi.table_copies)
