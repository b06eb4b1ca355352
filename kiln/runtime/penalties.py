"""Per-sequence penalty state for the sampler, kept on the logits' device.

Each live sequence with a penalty owns a row (a "slot") of two pooled (capacity, V) tensors:
which tokens its prompt holds, and how often each token occurs in its output. The rows are
updated in O(new tokens) per step instead of being rebuilt from the whole history, and
every sequence's update of one step is a single scatter: the host only plans it
(``PenaltyCounts.plan`` returns index lists that the sampler ships with its other per-step
data in one transfer), the device applies it (``PenaltyCounts.apply``)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from kiln.runtime.sequence import Sequence


@dataclass
class _Slot:
    ref: weakref.ref[Sequence]
    slot: int
    prompt_len: int
    num_counted: int = 0
    last_counted: int = -1  # the output token at num_counted - 1, to detect a rewrite


@dataclass
class PenaltyPlan:
    """Index lists of one step: ``slots[r]`` is the slot of the r-th penalized row; the
    slots in ``fresh`` are cleared first, then ``(seen_slots, seen_tokens)`` are marked as
    prompt tokens and ``(count_slots, count_tokens)`` each add one to the output counts."""

    slots: list[int] = field(default_factory=list)
    fresh: list[int] = field(default_factory=list)
    seen_slots: list[int] = field(default_factory=list)
    seen_tokens: list[int] = field(default_factory=list)
    count_slots: list[int] = field(default_factory=list)
    count_tokens: list[int] = field(default_factory=list)


class PenaltyCounts:
    """The slots and pooled tensors; see the module docstring."""

    def __init__(self) -> None:
        self._slots: dict[int, _Slot] = {}  # by id(seq); entries leave with their seq
        self._free: list[int] = []
        self.seen: torch.Tensor | None = None  # (capacity, V) bool: token in the prompt
        self.counts: torch.Tensor | None = None  # (capacity, V) float32: output counts

    def plan(self, seqs: list[Sequence], vocab: int, device: torch.device) -> PenaltyPlan:
        """Bring the slots of ``seqs`` up to date with their tokens (host side; the pool
        grows here if needed). A slot is rebuilt when the cached one belongs to another
        object or prompt, or the output was rewritten (e.g. a preempted sequence)."""
        if self.counts is None or self.counts.shape[1] != vocab or self.counts.device != device:
            self._reset(vocab, device)
        out = PenaltyPlan()
        for seq in seqs:
            key, toks = id(seq), seq.output_token_ids
            st = self._slots.get(key)
            if (
                st is None
                or st.ref() is not seq
                or st.prompt_len != len(seq.prompt_token_ids)
                or st.num_counted > len(toks)
                or (st.num_counted > 0 and toks[st.num_counted - 1] != st.last_counted)
            ):
                st = self._claim(seq, st)
                out.fresh.append(st.slot)
                prompt = {t for t in seq.prompt_token_ids if 0 <= t < vocab}
                out.seen_slots.extend([st.slot] * len(prompt))
                out.seen_tokens.extend(prompt)
            new = [t for t in toks[st.num_counted :] if 0 <= t < vocab]
            out.count_slots.extend([st.slot] * len(new))
            out.count_tokens.extend(new)
            if len(toks) > st.num_counted:
                st.num_counted, st.last_counted = len(toks), toks[-1]
            out.slots.append(st.slot)
        return out

    def update(self, idx: dict[str, torch.Tensor]) -> None:
        """Run a plan's updates of the pool on the device (its lists as int64 tensors, by
        field name); ``rows`` then reads its rows."""
        assert self.seen is not None and self.counts is not None
        if idx["fresh"].numel():
            self.seen[idx["fresh"]] = False
            self.counts[idx["fresh"]] = 0.0
        if idx["seen_slots"].numel():
            self.seen[idx["seen_slots"], idx["seen_tokens"]] = True
        if idx["count_slots"].numel():  # index_add_: atomics, no sort, no synchronization
            flat = idx["count_slots"] * self.counts.shape[1] + idx["count_tokens"]
            ones = torch.ones(flat.shape, device=self.counts.device)
            self.counts.view(-1).index_add_(0, flat, ones)

    def rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (R, V) output counts and the (R, V) "seen in prompt or output" mask of the
        pool's rows ``slots`` (a plan's ``slots``, or a chunk of them)."""
        assert self.seen is not None and self.counts is not None
        counts = self.counts[slots]
        return counts, self.seen[slots] | (counts > 0)

    def _reset(self, vocab: int, device: torch.device) -> None:
        self._slots.clear()
        self._free.clear()
        self.seen = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(0, vocab, dtype=torch.float32, device=device)

    def _claim(self, seq: Sequence, old: _Slot | None) -> _Slot:
        """A slot for ``seq``: its old one when it had one, else a free or a new one."""
        if old is not None and old.ref() is seq:
            slot = old.slot
        else:
            if old is not None:  # a dead sequence's entry under a reused id
                self._free.append(old.slot)
            slot = self._free.pop() if self._free else self._grow()
        key, slots, free = id(seq), self._slots, self._free

        def release(r: weakref.ref[Sequence]) -> None:
            st = slots.get(key)
            if st is not None and st.ref is r:
                del slots[key]
                free.append(st.slot)

        st = _Slot(weakref.ref(seq, release), slot, len(seq.prompt_token_ids))
        self._slots[key] = st
        return st

    def _grow(self) -> int:
        """Double the pool; return the first new slot (the others join the free list)."""
        assert self.seen is not None and self.counts is not None
        cap = self.seen.shape[0]
        new = max(8, 2 * cap)
        pad = (new - cap, self.seen.shape[1])
        dev = self.seen.device
        self.seen = torch.cat([self.seen, torch.zeros(pad, dtype=torch.bool, device=dev)])
        self.counts = torch.cat([self.counts, torch.zeros(pad, device=dev)])
        self._free.extend(range(new - 1, cap, -1))
        return cap
