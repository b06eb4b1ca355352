"""Engine-level counters: a snapshot for users, and per-step records for benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """A snapshot of the engine (``LLM.stats()``)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by sequences
    kv_cache_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens reused
    num_preemptions: int
    peak_kv_cache_usage: float
    prompt_tokens_computed: int  # prefill tokens actually run through the model
    generation_tokens: int
    steps: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


@dataclass
class StepRecord:
    """What one model step did, for benchmarks' roofline accounting (``record_steps``)."""

    start: float  # time.perf_counter() before scheduling
    end: float  # after sampling (the host has the tokens: the GPU work is done)
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    context_tokens: int  # sum over scheduled sequences of their context after the step
    attention_pairs: int  # (query, key) pairs attended this step, summed over sequences
