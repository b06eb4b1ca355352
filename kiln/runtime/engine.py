"""The engine loop: requests in, one scheduler step at a time, outputs out.

``EngineCore.step()`` = schedule -> run the model -> sample -> detokenize -> finish. It is
driven synchronously by ``LLM.generate`` and from a worker thread by
``LLM.generate_async``; requests and aborts from other threads enter through an inbox that
the next step drains, so the scheduler is only ever touched by the stepping thread."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import torch

from kiln.config import KvCacheConfig, ModelConfig, SchedulerConfig
from kiln.errors import bad_value
from kiln.kernels.attention import to_device
from kiln.outputs import RequestOutput
from kiln.runtime.block_manager import BlockManager
from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.logprobs import (
    PendingPromptLogprobs,
    prompt_logprob_chunk,
    prompt_logprob_rows,
)
from kiln.runtime.request import InFlight, Request, build_output, sync_text
from kiln.runtime.runner import ModelRunner
from kiln.runtime.sampler import Sampler
from kiln.runtime.scheduler import Scheduler, SchedulerOutput
from kiln.runtime.sequence import PENDING_TOKEN, Sequence
from kiln.runtime.stats import EngineStats, StepRecord
from kiln.sampling_params import SamplingParams


class EngineCore:
    def __init__(
        self,
        model: torch.nn.Module,
        cfg: ModelConfig,
        kv: KVCache,
        tokenizer: Any,
        limits: dict[str, int],
        kv_cache_config: KvCacheConfig,
        scheduler_config: SchedulerConfig,
        seed: int = 0,
    ) -> None:
        self.cfg, self.kv, self.tokenizer = cfg, kv, tokenizer
        self.max_seq_len = limits["max_seq_len"]
        self.blocks = BlockManager(
            kv.num_blocks, kv.tokens_per_block, kv_cache_config.enable_block_reuse
        )
        self.scheduler = Scheduler(
            scheduler_config, self.blocks, limits["max_batch_size"], limits["max_num_tokens"]
        )
        device = kv.layers[0].device
        self.device = device
        self.sampler = Sampler(cfg.eos_token_ids, seed)
        self.runner = ModelRunner(model, kv, device)
        self.prompt_logprob_rows = prompt_logprob_rows(limits["max_batch_size"])
        self.eos = set(cfg.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._inbox: deque[tuple[str, Any]] = deque()
        self._lock = threading.Lock()
        self._next_id = 0
        self.steps = self.prompt_tokens_computed = self.generation_tokens = 0
        self.num_fork_fallbacks = 0  # children that had to compute their own prompt
        self.peak_kv_usage = 0.0
        self.step_log: list[StepRecord] | None = None  # set to [] to record every step
        # overlapped stepping (see step()); the LLM turns it on for CUDA engines
        self.overlap = False
        self._in_flight: InFlight | None = None

    # ---- requests --------------------------------------------------------------------

    def new_request_id(self) -> str:
        with self._lock:
            self._next_id += 1
            return str(self._next_id - 1)

    def make_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> Request:
        """Validate and tokenize; raises ConfigError naming the field."""
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            vocab = self.cfg.vocab_size
            bad = [
                t
                for t in ids
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
            ]
            if bad:
                raise bad_value(
                    "prompt_token_ids", bad[:5], f"token ids must be integers in [0, {vocab})"
                )
        if not ids:
            raise bad_value(
                "prompt", prompt, "an empty prompt cannot be continued; pass at least one token"
            )
        if len(ids) >= self.max_seq_len:
            raise bad_value(
                "prompt",
                f"<{len(ids)} tokens>",
                f"the engine's max_seq_len is {self.max_seq_len}, so a prompt may have at most "
                f"{self.max_seq_len - 1} tokens",
            )
        total = min(len(ids) + params.max_tokens, self.max_seq_len)
        rid = request_id if request_id is not None else self.new_request_id()
        req = Request(rid, text, ids, params)
        if params.prompt_logprobs is not None:  # the first prompt token has no logprob (a
            req.prompt_logprobs = [None]  # one-token prompt has nothing more: no prefill)
        first = self._new_sequence(req, 0, total)
        first.pending_children = params.n - 1
        if not self.scheduler.can_ever_fit(first):
            cap = self.blocks.num_blocks * self.blocks.tokens_per_block
            raise bad_value(
                "max_tokens",
                params.max_tokens,
                f"{params.n} sequence(s) of prompt ({len(ids)} tokens) plus max_tokens need "
                f"more KV cache than the engine's {cap} tokens (or more than max_batch_size "
                f"{self.scheduler.max_batch_size} sequences); lower max_tokens or n, or raise "
                "kv_cache_config.max_tokens",
            )
        req.seqs.append(first)
        return req

    def _new_sequence(self, req: Request, index: int, total: int) -> Sequence:
        p = req.params
        seq = Sequence(req.request_id, req.prompt_token_ids, p, total, index=index)
        seq.sample_seed = self.sampler.sequence_seed(p.seed, index)
        seq.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, p)
        return seq

    def add_request(self, req: Request) -> None:
        """Queue a validated request; safe from any thread."""
        self._inbox.append(("add", req))

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its blocks go back at the next step. Safe from any
        thread; unknown or finished ids are ignored."""
        self._inbox.append(("abort", request_id))

    def has_unfinished(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- the step --------------------------------------------------------------------

    def step(self, only_finished: bool = False) -> list[RequestOutput]:
        """Advance every scheduled sequence by one step; return the requests that changed
        (``only_finished``: just those that finished, which spares building an output per
        request per step when nobody streams them).

        With ``overlap`` on, the step launched here is left running on the GPU and the
        previous one is read back and finished instead, so the host's work for one step
        (scheduling, inputs, outputs, detokenizing) runs while the GPU computes the next."""
        changed: dict[str, Request] = {}
        start = time.perf_counter()
        try:
            self._drain_inbox(changed)
            sched = self.scheduler.schedule()
            self.peak_kv_usage = max(self.peak_kv_usage, self.blocks.usage)
            for seq in sched.refused:
                changed[seq.request_id] = self._fail(seq, "does not fit the KV cache")
            previous, self._in_flight = self._in_flight, None
            if sched.scheduled:
                record = self._record(sched, start) if self.step_log is not None else None
                launched = self._launch(sched, previous)
                if self.overlap and not launched.needs_sync:
                    self._in_flight = launched
                if previous is not None:
                    self._process(previous, changed)
                if self._in_flight is None:
                    self._process(launched, changed)
                if record is not None:
                    record.end = time.perf_counter()
                    self.step_log.append(record)  # type: ignore[union-attr]
            elif previous is not None:
                self._process(previous, changed)
        except BaseException:
            self._in_flight = None  # its sequences are aborted by the caller's clean-up
            raise
        now = time.monotonic()
        outs = []
        for req in changed.values():
            if req.finished and req.finished_time is None:
                req.finished_time = now
                self.requests.pop(req.request_id, None)
            if req.finished or not only_finished:
                outs.append(self.output(req))
        return outs

    @staticmethod
    def _record(sched: SchedulerOutput, start: float) -> StepRecord:
        prefill = sched.num_prefill_tokens
        pairs = 0
        ctx = 0
        for s in sched.scheduled:
            n, done = s.num_new_tokens, s.seq.num_computed
            ctx += done + n
            pairs += n * done + n * (n + 1) // 2  # causal: token i sees done + i + 1 keys
        return StepRecord(
            start, 0.0, len(sched.scheduled), prefill, sched.num_tokens - prefill, ctx, pairs
        )

    def _drain_inbox(self, changed: dict[str, Request]) -> None:
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "add":
                self.requests[item.request_id] = item
                self.scheduler.add(item.seqs[0])
            elif (req := self.requests.get(item)) is not None:
                for seq in req.seqs:
                    if not seq.finished:
                        seq.finish_reason = "abort"
                        seq.pending_children = 0
                        seq.drop_pending()
                        self.scheduler.finish(seq)
                changed[req.request_id] = req

    def _fail(self, seq: Sequence, why: str) -> Request:
        req = self.requests[seq.request_id]
        req.error = f"request {req.request_id} {why}"
        seq.finish_reason = "error"
        seq.pending_children = 0
        seq.drop_pending()
        self.scheduler.finish(seq)
        return req

    def _launch(self, sched: SchedulerOutput, previous: InFlight | None) -> InFlight:
        """Run the model for ``sched`` and start sampling; tokens stay on the device. Each
        sampled sequence gets a placeholder token, so the next schedule sees its length."""
        self.steps += 1
        self.prompt_tokens_computed += sched.num_prefill_tokens
        result = self.runner.execute(sched, previous)
        ready: list[int] = []
        chunks: list[Any] = []
        for i, s in enumerate(sched.scheduled):
            seq = s.seq
            req = self.requests[seq.request_id]
            if i in result.prompt_hidden:
                hidden = result.prompt_hidden[i]
                chunks += self._prompt_logprobs(req, seq, s.num_new_tokens, hidden)
            seq.num_computed += s.num_new_tokens
            self.blocks.commit_full_blocks(seq)
            if seq.num_computed == seq.num_tokens:
                ready.append(i)
        # a request with n > 1 forks once its prompt is in the cache: the children share
        # its blocks (copy-on-write of a partial last block) and sample from the same logits
        rows: list[int] = []
        seqs: list[Sequence] = []
        needs_sync = False
        for i in ready:
            seq = sched.scheduled[i].seq
            rows.append(i)
            seqs.append(seq)
            # penalties need every earlier token on the host; forks happen once
            needs_sync |= seq.params.has_penalties or bool(seq.pending_children)
            if seq.pending_children:
                for child in self._fork(seq):
                    rows.append(i)
                    seqs.append(child)
        pending = None
        if seqs:
            logits = result.last_logits
            if rows != list(range(logits.shape[0])):  # indexing by a list would sync the host
                logits = logits[to_device(rows, torch.int64, logits.device)]
            pending = self.sampler.sample_async(logits, seqs, self.runner.token_buffer(len(seqs)))
        for seq in seqs:
            seq.output_token_ids.append(PENDING_TOKEN)
            seq.num_pending += 1
        row_of = {id(q): k for k, q in enumerate(seqs)}
        prompt_lps = PendingPromptLogprobs(chunks) if chunks else None
        return InFlight(seqs, pending, row_of, needs_sync, prompt_lps)

    def _process(self, flight: InFlight, changed: dict[str, Request]) -> None:
        """Read a launched step's tokens back and put them in place of its placeholders."""
        if flight.prompt_logprobs is not None:  # before the first token's output
            flight.prompt_logprobs.resolve()
        if flight.pending is None:
            return
        sample = flight.pending.result()
        now = time.monotonic()
        for k, seq in enumerate(flight.seqs):
            if seq.finished:  # aborted (or failed) while its token was on the way
                continue
            tok = sample.token_ids[k]
            seq.output_token_ids[len(seq.output_token_ids) - seq.num_pending] = tok
            seq.num_pending -= 1
            self._append(seq, tok, sample.logprobs[k], now)
            if not seq.finished:
                self.blocks.commit_full_blocks(seq)
            changed[seq.request_id] = self.requests[seq.request_id]

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Create the request's other n - 1 sequences sharing ``parent``'s prompt blocks;
        return those that share them now. A child that finds no free block for its copy of
        a partial last block (possible only under max_utilization) queues as a fresh
        sequence instead and computes its prompt itself, mostly from the prefix cache."""
        req = self.requests[parent.request_id]
        forked, queued = [], []
        for index in range(1, parent.pending_children + 1):
            child = self._new_sequence(req, index, parent.max_total_len)
            child.first_scheduled_time = parent.first_scheduled_time
            try:
                copy = self.blocks.fork(parent, child)
            except RuntimeError:
                self.blocks.free_sequence(child)
                child.num_computed = 0
                queued.append(child)
                self.num_fork_fallbacks += 1
                continue
            if copy is not None:
                self.kv.copy_block(*copy)
            forked.append(child)
        parent.pending_children = 0
        req.seqs.extend(forked + queued)
        self.scheduler.add_forked(parent, forked)
        for child in reversed(queued):
            self.scheduler.waiting.appendleft(child)
        return forked

    def _prompt_logprobs(
        self, req: Request, seq: Sequence, n: int, hidden: torch.Tensor
    ) -> list[Any]:
        """Logprobs of the prompt positions this step computed (``hidden``: their final
        hidden states) and no earlier step did, ``prompt_logprob_rows`` positions' logits
        at a time; left on the device (``PromptLogprobChunk``) until the step is read."""
        lo = seq.num_computed
        assert req.prompt_logprobs is not None  # [None, ...] from make_request
        start = max(lo, req.prompt_rows_launched)
        upto = min(lo + n, len(seq.prompt_token_ids) - 1)  # whose next token is in the prompt
        top_n = req.params.prompt_logprobs or 0
        chunks = []
        for a in range(start, upto, self.prompt_logprob_rows):
            b = min(a + self.prompt_logprob_rows, upto)
            logits = self.runner.model.compute_logits(hidden[a - lo : b - lo])
            nxt = seq.prompt_token_ids[a + 1 : b + 1]
            chunks.append(prompt_logprob_chunk(logits, nxt, top_n, req.prompt_logprobs))
            del logits  # freed before the next chunk's are made
        req.prompt_rows_launched = max(req.prompt_rows_launched, upto)
        return chunks

    def _append(self, seq: Sequence, tok: int, logprobs: Any, now: float) -> None:
        """Account for ``tok``, already in place at the end of the known output tokens."""
        self.generation_tokens += 1
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.token_times.append(now)
        p = seq.params
        if p.stop:  # stop strings are matched in the text as it grows
            sync_text(seq)
        if tok in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", tok
        elif tok in self.eos and not p.ignore_eos:
            seq.finish_reason = "stop"
        elif seq.detok.finished:
            seq.finish_reason, seq.stop_reason = "stop", seq.detok.stop_reason
        elif (
            len(seq.output_token_ids) - seq.num_pending >= p.max_tokens
            or seq.num_tokens - seq.num_pending >= seq.max_total_len
        ):
            seq.finish_reason = "length"
        if seq.finished:
            seq.drop_pending()  # a token sampled after this one (overlap) is discarded
            sync_text(seq)
            seq.emitted += seq.detok.flush()
            self.scheduler.finish(seq)

    def output(self, req: Request) -> RequestOutput:
        return build_output(req)

    def stats(self) -> EngineStats:
        s, b = self.scheduler, self.blocks
        return EngineStats(
            num_running=len(s.running),
            # list() copies the inbox atomically: stats() may run while another thread steps
            num_waiting=len(s.waiting) + sum(1 for k, _ in list(self._inbox) if k == "add"),
            kv_cache_usage=b.usage,
            kv_cache_blocks=b.num_blocks,
            prefix_cache_queries=b.prefix_queries,
            prefix_cache_hits=b.prefix_hits,
            num_preemptions=s.num_preemptions,
            peak_kv_cache_usage=self.peak_kv_usage,
            prompt_tokens_computed=self.prompt_tokens_computed,
            generation_tokens=self.generation_tokens,
            steps=self.steps,
        )
