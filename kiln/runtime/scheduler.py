"""The in-flight batching scheduler. Each step it decides which sequences advance by how
many tokens ("sequence -> number of new tokens"), mixing decode tokens with chunks of
prefill under ``max_num_tokens`` and ``max_batch_size``, and hands the model runner one
``SchedulerOutput`` and nothing else. Pure Python: it never touches a tensor."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kiln.config import SchedulerConfig
from kiln.runtime.block_manager import BlockManager
from kiln.runtime.sequence import Sequence


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    """Tokens computed this step, starting at ``seq.num_computed`` (1 for a decode)."""

    @property
    def is_decode(self) -> bool:
        """One new token, the latest sampled one."""
        seq = self.seq
        return (
            self.num_new_tokens == 1
            and bool(seq.output_token_ids)
            and seq.num_computed == seq.num_tokens - 1
        )

    @property
    def completes(self) -> bool:
        """True when this step computes the sequence's last known token, so its logits
        give the next token (a decode, or the last chunk of a prefill)."""
        return self.seq.num_computed + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """One step, as the model runner receives it."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    """In batch order; their tokens are concatenated in this order."""
    preempted: list[Sequence] = field(default_factory=list)
    """Sequences that lost their blocks this step (they will recompute later)."""
    refused: list[Sequence] = field(default_factory=list)
    """Sequences ended with ``finish_reason="error"``: they can never fit the cache."""

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens computed for prompts (and recomputed after preemption), not decodes."""
        return sum(s.num_new_tokens for s in self.scheduled if not s.is_decode)


class Scheduler:
    def __init__(
        self, cfg: SchedulerConfig, blocks: BlockManager, max_batch_size: int, max_num_tokens: int
    ) -> None:
        self.cfg, self.blocks = cfg, blocks
        self.max_batch_size, self.max_num_tokens = max_batch_size, max_num_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- bookkeeping -----------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_for_whole_request(self, seq: Sequence, matched: int = 0) -> int:
        """Blocks ``seq`` (with its pending forks) may hold at most, beyond ``matched``
        blocks it already shares."""
        full = self.blocks.blocks_for(seq.max_total_len)
        shared = len(seq.prompt_token_ids) // self.blocks.tokens_per_block
        return full - matched + seq.pending_children * (full - shared)

    def can_ever_fit(self, seq: Sequence) -> bool:
        return (
            self.blocks_for_whole_request(seq) <= self.blocks.num_blocks
            and 1 + seq.pending_children <= self.max_batch_size
        )

    def _future_need(self, seq: Sequence) -> int:
        """Blocks a running sequence may still take (guaranteed_no_evict reserves them)."""
        return self.blocks_for_whole_request(seq) - len(seq.block_ids) if seq.block_ids else 0

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted) sequence and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_sequence(seq)

    def add_forked(self, parent: Sequence, children: list[Sequence]) -> None:
        i = self.running.index(parent)
        self.running[i + 1 : i + 1] = children

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.blocks.free_sequence(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    # ---- the step --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_tokens
        # 1. running sequences, oldest first: decodes and ongoing prefill chunks
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.awaiting_last_token:  # overlapped stepping: it ends when its token is read
                i += 1
                continue
            n = min(seq.num_tokens - seq.num_computed, budget)
            if n > 1:  # a prefill chunk shrinks to the blocks there are before anyone is preempted
                room = (
                    len(seq.block_ids) + self.blocks.num_free_blocks
                ) * self.blocks.tokens_per_block
                n = max(1, min(n, room - seq.num_computed))
            while not self.blocks.grow(seq, seq.num_computed + n):
                # only max_utilization runs short: the newest request gives its blocks back
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSequence(seq, n))
                budget -= n
                i += 1
        # 2. admit waiting requests (not in a step that had to preempt)
        guaranteed = self.cfg.capacity_scheduler_policy == "guaranteed_no_evict"
        # blocks running sequences may still take; kept up to date as requests are admitted
        reserved = sum(self._future_need(s) for s in self.running) if guaranteed else 0
        while self.waiting and budget > 0 and not out.preempted:
            seq = self.waiting[0]
            if not self.can_ever_fit(seq):
                self.waiting.popleft()
                seq.finish_reason = "error"
                out.refused.append(seq)
                continue
            if len(self.running) + 1 + seq.pending_children > self.max_batch_size:
                break
            matched = (
                [] if seq.params.prompt_logprobs is not None else self.blocks.match_prefix(seq)
            )
            revived = sum(1 for b in matched if self.blocks.ref[b] == 0)
            free = self.blocks.num_free_blocks - revived
            bs = self.blocks.tokens_per_block
            n = min(seq.num_tokens - len(matched) * bs, budget)
            if guaranteed:
                fits = self.blocks_for_whole_request(seq, len(matched)) <= free - reserved
            else:
                fits = self.blocks.blocks_for(len(matched) * bs + n) - len(matched) <= free
            if not fits:
                break
            self.waiting.popleft()
            self.blocks.start(seq, matched)
            grown = self.blocks.grow(seq, seq.num_computed + n)
            assert grown, "admission checked the free blocks"
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            reserved += self._future_need(seq) if guaranteed else 0
            out.scheduled.append(ScheduledSequence(seq, n))
            budget -= n
        return out
