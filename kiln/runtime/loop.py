"""A simple batching loop: admit requests while their whole generation fits the KV cache
and the batch, run prefill chunks and decode tokens together under ``max_num_tokens``,
sample, stop, free. The in-flight batching scheduler (preemption, prefix reuse) replaces
the admission and scheduling here; runner and sampler stay as they are."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kiln.runtime.kv_cache import KVCache
from kiln.runtime.runner import ModelRunner
from kiln.runtime.sampler import Sampler
from kiln.runtime.sequence import Sequence


class BatchLoop:
    def __init__(
        self,
        runner: ModelRunner,
        kv: KVCache,
        sampler: Sampler,
        max_batch_size: int,
        max_num_tokens: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.runner, self.kv, self.sampler = runner, kv, sampler
        self.max_batch_size, self.max_num_tokens = max_batch_size, max_num_tokens
        self.eos = set(eos_token_ids)

    def run(
        self, seqs: list[Sequence], on_finish: Callable[[Sequence], None] | None = None
    ) -> None:
        waiting = deque(seqs)
        running: list[Sequence] = []
        try:
            while waiting or running:
                while waiting and len(running) < self.max_batch_size:
                    need = self.kv.blocks_for(waiting[0].max_total_len)
                    if need > self.kv.num_free_blocks:
                        break
                    seq = waiting.popleft()
                    seq.block_ids = self.kv.allocate(need)
                    running.append(seq)
                if not running:
                    raise RuntimeError("request does not fit the KV cache; it was not validated")
                batch = self._schedule(running)
                logits = self.runner.execute(batch)
                ready = [(i, s) for i, (s, n) in enumerate(batch) if self._advance(s, n)]
                if ready:
                    rows = logits[[i for i, _ in ready]]
                    for tok, (_, s) in zip(
                        self.sampler(rows, [s for _, s in ready]), ready, strict=True
                    ):
                        self._append(s, tok)
                for s in [s for s in running if s.finished]:
                    running.remove(s)
                    self.kv.free(s.block_ids)
                    if on_finish:
                        on_finish(s)
        finally:  # however the loop ends, every block goes back to the pool
            for s in running:
                self.kv.free(s.block_ids)

    def _schedule(self, running: list[Sequence]) -> list[tuple[Sequence, int]]:
        """Decode tokens first (one each), then prefill chunks while the token budget lasts."""
        budget = self.max_num_tokens
        decode = [s for s in running if s.num_tokens - s.num_computed == 1]
        batch = [(s, 1) for s in decode[:budget]]
        budget -= len(batch)
        for s in running:
            left = s.num_tokens - s.num_computed
            if left > 1 and budget > 0:
                batch.append((s, min(left, budget)))
                budget -= batch[-1][1]
        return batch

    @staticmethod
    def _advance(seq: Sequence, n: int) -> bool:
        """Mark n tokens computed; True when the sequence now needs its next token."""
        seq.num_computed += n
        return seq.num_computed == seq.num_tokens

    def _append(self, seq: Sequence, tok: int) -> None:
        seq.output_token_ids.append(tok)
        p = seq.params
        if tok in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", tok
        elif tok in self.eos and not p.ignore_eos:
            seq.finish_reason = "stop"
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= seq.max_total_len:
            seq.finish_reason = "length"
