"""Offline throughput: every request submitted at once (or at capped concurrency) to an
``LLM``'s engine, output length forced, each model step recorded for the roofline.

The engine is stepped directly (as ``LLM.generate`` does) so that requests can be fed as
others finish when ``concurrency`` caps the requests in flight. Every request samples
greedily with ``ignore_eos`` and ``max_tokens`` = its output length, so each generates
exactly the tokens asked for; the report counts them and says whether they match.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from kiln.bench import ceilings as ceil
from kiln.bench.datasets import BenchRequest, synthetic
from kiln.bench.metrics import RequestTiming, aggregate
from kiln.bench.roofline import QuantCosts, roofline
from kiln.errors import KilnError, bad_value
from kiln.llm import LLM
from kiln.runtime.stats import StepRecord
from kiln.sampling_params import SamplingParams


@dataclass
class RunResult:
    """What one measured run of a dataset produced."""

    timings: list[RequestTiming]
    wall_time_s: float
    steps: list[StepRecord]
    peak_kv_cache_usage: float
    num_preemptions: int


def forced_params(output_tokens: int) -> SamplingParams:
    """Greedy, exactly ``output_tokens`` tokens whatever the model samples."""
    return SamplingParams(
        max_tokens=output_tokens, temperature=0.0, ignore_eos=True, min_tokens=output_tokens
    )


def check_fits(llm: LLM, reqs: list[BenchRequest]) -> None:
    """Refuse a dataset whose requests do not fit the engine's ``max_seq_len``."""
    worst = max(reqs, key=lambda r: r.input_tokens + r.output_tokens)
    if worst.input_tokens + worst.output_tokens > llm.max_seq_len:
        raise bad_value(
            "input + output tokens",
            worst.input_tokens + worst.output_tokens,
            f"the engine's max_seq_len is {llm.max_seq_len}; rebuild with a larger --max-seq-len",
        )


def run_requests(
    llm: LLM,
    reqs: list[BenchRequest],
    *,
    concurrency: int | None = None,
    progress: bool = True,
    desc: str = "benchmark",
) -> RunResult:
    """Run ``reqs`` through ``llm``'s engine; at most ``concurrency`` in flight (None: all
    submitted at once). Steps are bounded: a run that stops making progress raises."""
    check_fits(llm, reqs)
    core = llm.core
    if core.has_unfinished():
        raise KilnError("the engine has requests in flight; a benchmark needs it idle.")
    core.step_log = []
    core.peak_kv_usage = 0.0
    preempt0 = llm.stats().num_preemptions
    cap = concurrency or len(reqs)
    pending = deque(reqs)
    inflight: dict[str, BenchRequest] = {}
    timings: list[RequestTiming] = []
    max_steps = 4 * sum(r.input_tokens + r.output_tokens for r in reqs) + 1000
    bar = tqdm(total=len(reqs), desc=desc, unit="req", disable=not progress, mininterval=0.5)
    out_tokens = 0
    t0 = time.monotonic()
    try:
        for _ in range(max_steps):
            while pending and len(inflight) < cap:
                r = pending.popleft()
                kreq = core.make_request(r.payload, forced_params(r.output_tokens))
                inflight[kreq.request_id] = r
                core.add_request(kreq)
            if not core.has_unfinished():
                break
            for out in core.step(only_finished=True):
                if not out.finished:
                    continue
                r = inflight.pop(out.request_id)
                comp = out.outputs[0]
                m = out.metrics
                assert m is not None
                timings.append(
                    RequestTiming(
                        input_tokens=len(out.prompt_token_ids),
                        output_tokens=len(comp.token_ids),
                        requested_output_tokens=r.output_tokens,
                        submitted=m.arrival_time,
                        token_times=list(m.token_times),
                        ok=comp.finish_reason == "length" and out.error is None,
                        error=out.error,
                    )
                )
                out_tokens += len(comp.token_ids)
                bar.update()
                el = time.monotonic() - t0
                bar.set_postfix_str(f"{out_tokens / el:,.0f} out tok/s", refresh=False)
        else:
            raise KilnError(f"the benchmark made no progress in {max_steps} engine steps.")
    except BaseException:
        for rid in inflight:
            core.abort(rid)
        core.step()
        raise
    finally:
        bar.close()
    wall = time.monotonic() - t0
    steps = core.step_log or []
    core.step_log = None
    return RunResult(
        timings, wall, steps, core.peak_kv_usage, llm.stats().num_preemptions - preempt0
    )


def warm_up(llm: LLM, reqs: list[BenchRequest], n: int) -> None:
    """Run ``n`` short requests (first kernels, allocator) before measuring. Their prompts
    are fresh random ids, so the measured requests find nothing of them in the prefix
    cache."""
    if n > 0:
        isl = min(max(r.input_tokens for r in reqs), llm.max_seq_len - 4)
        warm = synthetic(n, isl, 4, llm.config.vocab_size, seed=0x5EED)
        run_requests(llm, warm, progress=False)


def figures(llm: LLM, result: RunResult, ceilings: dict[str, Any]) -> dict[str, Any]:
    """Every figure of a throughput run: ``aggregate``'s, KV usage, preemptions, roofline."""
    fig = aggregate(result.timings, result.wall_time_s)
    fig["peak_kv_cache_usage"] = result.peak_kv_cache_usage
    fig["num_preemptions"] = result.num_preemptions
    fig["engine_steps"] = len(result.steps)
    fig["max_seqs_per_step"] = max((r.num_seqs for r in result.steps), default=0)
    dtype = llm.engine.dtype
    rate = ceil.rate_for(ceilings, dtype)
    fig["roofline"] = roofline(
        llm.config,
        result.steps,
        dtype.itemsize,
        ceilings["copy_bandwidth_bytes_per_s"],
        rate,
        quant_costs(llm, ceilings, rate),
    )
    return fig


def quant_costs(llm: LLM, ceilings: dict[str, Any], rate: float) -> QuantCosts | None:
    """The roofline's view of a quantized engine (None when nothing is quantized): the bytes
    of every weight it holds (an untied input embedding excluded, as the model reads only
    its looked-up rows), the KV cache's element size, and for fp8 the measured fp8 matmul
    rate over the engine dtype's (1 when fp8 was not measured)."""
    label = _quant_label(llm)
    if label is None:
        return None
    model = llm.engine.model
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if not llm.config.tie_word_embeddings:
        nbytes -= llm.config.vocab_size * llm.config.hidden_size * llm.engine.dtype.itemsize
    q = llm.engine.manifest.get("quant") or {}
    fp8_rate = ceilings["matmul_flops_per_s"].get("float8_e4m3")
    factor = fp8_rate / rate if q.get("algo") == "fp8" and fp8_rate else 1.0
    return QuantCosts(nbytes, llm.kv.layers[0].element_size(), factor, label)


def _quant_label(llm: LLM) -> str | None:
    """E.g. "fp8 + fp8 KV", "int4-awq g128", "fp8 KV"; None when nothing is quantized."""
    q = llm.engine.manifest.get("quant") or {}
    parts = []
    if q.get("algo"):
        parts.append(q["algo"] + (f" g{q['group_size']}" if q.get("group_size") else ""))
    if llm.kv_cache_dtype == "fp8":
        parts.append("fp8 KV")
    return " + ".join(parts) or None


def engine_settings(llm: LLM) -> dict[str, Any]:
    """The engine facts a report needs to be reproduced."""
    m = llm.engine.manifest
    return {
        "model": m["source"]["model"],
        "source_kind": m["source"]["kind"],
        "architecture": llm.config.architecture,
        "num_params": llm.config.num_params(),
        "dtype": m["dtype"],
        "quant": _quant_label(llm),
        "device": str(llm.engine.device),
        "limits": dict(m["limits"]),
        "kv_cache_tokens": llm.kv_capacity_tokens,
        "tokens_per_block": llm.kv.tokens_per_block,
        # how the cache was sized (GPU, unless kv_cache_config.max_tokens set it): what was
        # free then, and the one full step's peak (with the sampler's reserve) held back
        "memory_plan": {
            "free_bytes_at_kv_sizing": llm.free_bytes_at_kv_sizing,
            "activation_peak_bytes": llm.activation_peak_bytes,
            "kv_cache_bytes": llm.kv.nbytes,
            "torch_reserved_bytes_at_kv_sizing": llm.torch_bytes_at_kv_sizing["reserved"],
            "torch_allocated_bytes_at_kv_sizing": llm.torch_bytes_at_kv_sizing["allocated"],
            "free_gpu_memory_fraction": llm.kv_cache_config.free_gpu_memory_fraction,
        },
        "kv_cache_dtype": llm.kv_cache_dtype or str(llm.kv.dtype).removeprefix("torch."),
        "scheduler_policy": llm.core.scheduler.cfg.capacity_scheduler_policy,
        "sampling": "greedy, ignore_eos, max_tokens = min_tokens = output length",
        "cuda_graphs": llm.core.runner.graphs.batch_sizes if llm.core.runner.graphs else None,
        "cuda_graph_capture_s": llm.cuda_graph_capture_s,
        "kernel_warmup": llm.kernel_warmup,
        "graph_steps": llm.core.runner.graph_steps,
        "eager_steps": llm.core.runner.eager_steps,
        "kernel_tuning": (llm.engine.tuning or {}).get("kernels"),
    }
