"""Experiment (GPU): where the time of a ``kiln bench throughput`` run goes, kernel by
kernel. Runs the CLI with ``torch.profiler`` (CUDA activity only) around the measured
requests and writes the kernels' total device time, largest first. Usage:
``PYTHONPATH=. python scripts/experiments/profile_throughput.py OUT.json <bench args>``."""

import json
import sys

from torch.profiler import ProfilerActivity, profile

from kiln.bench import throughput as tp
from kiln.cli import main

_run = tp.run_requests


def _profiled(*args, **kwargs):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        res = _run(*args, **kwargs)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events)
    rows = [
        {"kernel": e.key[:160], "calls": e.count, "device_ms": e.device_time_total / 1e3,
         "share": e.device_time_total / total}
        for e in sorted(events, key=lambda e: e.device_time_total, reverse=True)
    ]  # fmt: skip
    with open(sys.argv[1], "w") as f:
        json.dump({"args": sys.argv[2:], "device_ms": total / 1e3, "kernels": rows}, f, indent=1)
    print(f"device time {total / 1e6:.2f} s over {len(rows)} kernels")
    for r in rows[:25]:
        print(f"{r['share']:6.1%} {r['device_ms']:10.1f} ms {r['calls']:8d}  {r['kernel'][:90]}")
    return res


tp.run_requests = _profiled
sys.exit(main(["bench", "throughput", *sys.argv[2:]]))
