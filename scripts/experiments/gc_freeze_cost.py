"""What Python's full garbage collections cost a decode step, with and without the start-up
heap frozen (kiln.runtime.heap): ``dummy:tiny`` at 256 rows, greedy and with 20 logprobs a
row, 64 tokens a row. Each mode runs in its own process (a frozen heap cannot be taken back
into account fairly in one), alternating, ``RUNS`` times. A step is a run's wall time less a
1-token run's (the prefill), over 64 steps.

Usage: python scripts/experiments/gc_freeze_cost.py OUT.json   (any device; CPU by default)"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROWS, TOKENS, RUNS = 256, 65, 3


def child(mode: str) -> dict[str, list[float]]:
    import gc

    from kiln import LLM, SamplingParams
    from kiln.runtime import heap

    llm = LLM("dummy:tiny", max_batch_size=ROWS, progress=False)
    frozen = heap.freeze() if mode == "frozen" else 0
    prompts = [[1 + i % 50, 2, 3] for i in range(ROWS)]

    def run(n: int, lp: int | None) -> float:
        p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=lp)
        t = time.perf_counter()
        llm.generate(prompts, [p] * ROWS, use_tqdm=False)
        return time.perf_counter() - t

    run(4, 20)  # warm
    out: dict[str, list[float]] = {"frozen_objects": [frozen], "tracked": [len(gc.get_objects())]}
    for lp in (None, 20):
        out[f"logprobs_{lp}_ms"] = [
            (run(TOKENS, lp) - run(1, lp)) / (TOKENS - 1) * 1e3 for _ in range(RUNS)
        ]
    return out


def main(path: str) -> None:
    modes: dict[str, list[dict[str, list[float]]]] = {"unfrozen": [], "frozen": []}
    for _ in range(2):
        for mode in modes:
            r = subprocess.run([sys.executable, __file__, "--child", mode], check=True,
                               capture_output=True, text=True)  # fmt: skip
            modes[mode].append(json.loads(r.stdout.strip().splitlines()[-1]))
    summary = {}
    for mode, runs in modes.items():
        for key in ("logprobs_None_ms", "logprobs_20_ms"):
            vals = [v for r in runs for v in r[key]]
            summary[f"{mode}_{key}_median"] = round(statistics.median(vals), 2)
        print(mode, {k: v for k, v in summary.items() if k.startswith(mode)})
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    report = {"name": "gc_freeze_cost", "commit": commit, "date": time.strftime("%Y-%m-%d"),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU",
              "python": platform.python_version(), "torch": torch.__version__,
              "rows": ROWS, "tokens": TOKENS, "runs": modes, "summary": summary}  # fmt: skip
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
    else:
        main(sys.argv[1])
