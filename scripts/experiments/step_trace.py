"""Experiment (H200): one decode step, kernel by kernel, in launch order. For each engine
and batch size, ``LLM.generate`` runs b prompts of 128 random tokens for 48 greedy tokens
under ``torch.profiler`` (CUDA activity only); the kernels a CUDA-graph launch ran share
its correlation id, so each graph replay is one step. Of the last 32 steps the median
by span is written: every kernel's name, duration and the idle gap before it; per kernel
name the calls and microseconds of a step; the step's span, busy time and idle time;
and the device time outside the graphs per step (sampling, input copies).

Usage: ``python scripts/experiments/step_trace.py OUT.json ENGINE_DIR [BATCHES]``
(BATCHES: comma-separated, default 1)."""

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


def trace(llm: LLM, b: int) -> dict:
    g = torch.Generator().manual_seed(b)
    prompts = [torch.randint(100, 20000, (128,), generator=g).tolist() for _ in range(b)]
    p = SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.0)
    llm.generate(prompts, p, use_tqdm=False)  # warm
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
    steps = steps[-32:]

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
    out_names: dict[str, float] = defaultdict(float)
    for k in outside:
        out_names[k["name"][:120]] += float(k["dur"]) / (len(steps) - 1)
    spans = [span(ks) for ks in steps]
    names = [
        {"kernel": n, "calls": len(d), "us": round(sum(d), 2), "mean_us": round(sum(d) / len(d), 2)}
        for n, d in per_name.items()
    ]
    outside_us = {n: round(v, 2) for n, v in sorted(out_names.items(), key=lambda x: -x[1])}
    res = {
        "batch": b, "steps": len(steps), "kernels_per_step": len(med),
        "span_us": {"median": round(statistics.median(spans), 2), "min": round(min(spans), 2),
                    "max": round(max(spans), 2)},
        "busy_us": round(busy, 2), "idle_us": round(span(med) - busy, 2),
        "by_name": sorted(names, key=lambda r: -r["us"]),
        "outside_graph_us_per_step": outside_us,
        "median_step": rows,
    }  # fmt: skip
    print(f"batch {b}: span {res['span_us']} busy {res['busy_us']} idle {res['idle_us']} "
          f"kernels {len(med)}", flush=True)  # fmt: skip
    for r in res["by_name"][:14]:
        print(f"  {r['us']:9.1f} us {r['calls']:4d} x {r['mean_us']:6.2f}  {r['kernel'][:70]}")
    for n, v in list(res["outside_graph_us_per_step"].items())[:4]:
        print(f"  outside {v:7.2f} us  {n[:70]}")
    return res


def main() -> None:
    batches = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "1").split(",")]
    llm = LLM(sys.argv[2])
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "engine": sys.argv[2], "batches": [trace(llm, b) for b in batches]}  # fmt: skip
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
