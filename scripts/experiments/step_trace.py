"""Experiment (H200): one decode step, kernel by kernel, in launch order. For each engine
and batch size, ``LLM.generate`` runs b prompts of 128 random tokens for 48 greedy tokens
under ``torch.profiler`` (CUDA activity only); the kernels a CUDA-graph launch ran share
its correlation id, so each graph replay is one step. Of the last 32 steps the median
by span is written: every kernel's name, duration and the idle gap before it; per kernel
name the calls and microseconds of a step; the step's span, busy time and idle time;
and the device time outside the graphs per step (sampling, input copies), and the number
of device operations there (kernels, copies, memsets).

Usage: ``python scripts/experiments/step_trace.py OUT.json ENGINE_DIR [BATCHES] [PROMPT
[TOKENS]]`` (BATCHES: comma-separated, default 1; PROMPT: prompt tokens, default 128;
TOKENS: generated tokens, default 48). The warm-up pass generates 4 tokens from prompts of
the same batch; of the graph replays of all b sequences (decode attention's grid) the last
32 count. The median step period (start to start of consecutive graph replays)
beside the span shows the time the GPU waited on the host."""

import itertools
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kiln.llm import LLM
from kiln.sampling_params import SamplingParams


def _rows(ks: list[dict]) -> int:
    """The sequences a graph replay decoded: its first decode-attention launch's grid."""
    grid = next((k["args"].get("grid", [0]) for k in ks if "decode_partial" in k["name"]), [0])
    return grid[0]


def trace(llm: LLM, b: int, prompt: int = 128, tokens: int = 48) -> dict:
    g = torch.Generator().manual_seed(b)
    prompts = [torch.randint(100, 20000, (prompt,), generator=g).tolist() for _ in range(b)]
    p = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    llm.generate([q[:128] for q in prompts], warm, use_tqdm=False)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, p, use_tqdm=False)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: float(e["ts"]))
    by_corr: dict[int, list[dict]] = defaultdict(list)
    for k in kernels:
        by_corr[k["args"].get("correlation", -1)].append(k)
    steps = [ks for ks in by_corr.values() if len(ks) > 50]  # graph replays
    steps.sort(key=lambda ks: float(ks[0]["ts"]))
    graph_ids = {id(k) for ks in steps for k in ks}
    full = max(map(_rows, steps))
    steps = [ks for ks in steps if _rows(ks) == full][-32:]

    def span(ks: list[dict]) -> float:
        return float(ks[-1]["ts"]) + float(ks[-1]["dur"]) - float(ks[0]["ts"])

    med = sorted(steps, key=span)[len(steps) // 2]
    t0 = float(med[0]["ts"])
    rows, end = [], t0
    per_name: dict[str, list[float]] = defaultdict(list)
    for k in med:
        ts, dur = float(k["ts"]), float(k["dur"])
        rows.append({"kernel": k["name"][:120], "us": round(dur, 2),
                     "gap_us": round(ts - end, 2)})  # fmt: skip
        per_name[k["name"][:120]].append(dur)
        end = max(end, ts + dur)
    busy = sum(float(k["dur"]) for k in med)
    first, last = float(steps[0][0]["ts"]), float(steps[-1][-1]["ts"])
    outside = [k for k in kernels if id(k) not in graph_ids and first <= float(k["ts"]) <= last]
    # every device operation outside the graphs (kernels, copies, memsets) per step
    ops = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ops_out = [e for e in ops if id(e) not in graph_ids and first <= float(e["ts"]) <= last]
    op_names: dict[str, float] = defaultdict(float)
    for e in ops_out:
        op_names[e["name"][:60]] += 1 / (len(steps) - 1)
    out_names: dict[str, float] = defaultdict(float)
    for k in outside:
        out_names[k["name"][:120]] += float(k["dur"]) / (len(steps) - 1)
    spans = [span(ks) for ks in steps]
    starts = [float(ks[0]["ts"]) for ks in steps]
    periods = [b - a for a, b in itertools.pairwise(starts)]
    names = [
        {"kernel": n, "calls": len(d), "us": round(sum(d), 2), "mean_us": round(sum(d) / len(d), 2)}
        for n, d in per_name.items()
    ]
    outside_us = {n: round(v, 2) for n, v in sorted(out_names.items(), key=lambda x: -x[1])}
    res = {
        "batch": b, "steps": len(steps), "kernels_per_step": len(med),
        "span_us": {"median": round(statistics.median(spans), 2), "min": round(min(spans), 2),
                    "max": round(max(spans), 2)},
        "prompt": prompt, "tokens": tokens,
        "period_us": {"median": round(statistics.median(periods), 2), "min": round(min(periods), 2),
                      "max": round(max(periods), 2)},
        "busy_us": round(busy, 2), "idle_us": round(span(med) - busy, 2),
        "by_name": sorted(names, key=lambda r: -r["us"]),
        "outside_graph_us_per_step": outside_us,
        "outside_graph_ops_per_step": round(len(ops_out) / (len(steps) - 1), 2),
        "outside_graph_ops_by_name": {n: round(v, 2) for n, v in op_names.items()},
        "median_step": rows,
    }  # fmt: skip
    head = f"batch {b}: period {res['period_us']} span {res['span_us']} busy {res['busy_us']}"
    print(f"{head} idle {res['idle_us']} kernels {len(med)}", flush=True)
    for r in res["by_name"][:14]:
        print(f"  {r['us']:9.1f} us {r['calls']:4d} x {r['mean_us']:6.2f}  {r['kernel'][:70]}")
    for n, v in list(res["outside_graph_us_per_step"].items())[:4]:
        print(f"  outside {v:7.2f} us  {n[:70]}")
    return res


def main() -> None:
    batches = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "1").split(",")]
    lengths = [int(x) for x in sys.argv[4:6]]
    llm = LLM(sys.argv[2])
    runs = [trace(llm, b, *lengths) for b in batches]
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "engine": sys.argv[2], "batches": runs}  # fmt: skip
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
