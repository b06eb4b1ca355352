"""Benchmark reports: the environment (commit, device, versions), JSON files, a one-line
markdown row for ``benchmarks/README.md``, a terminal summary, and the serve sweep's plot
(matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

import kiln
from kiln.errors import KilnError


def git_commit() -> str:
    """``$KILN_COMMIT``, else the checkout's short hash (``+wip`` when it has changes)."""
    env = os.environ.get("KILN_COMMIT")
    if env:
        return env
    root = Path(kiln.__file__).resolve().parents[1]
    try:
        run = lambda *a: subprocess.run(  # noqa: E731
            ["git", *a], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        commit = run("rev-parse", "--short", "HEAD")
        dirty = run("status", "--porcelain", "--untracked-files=no")
        return commit + ("+wip" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {
        "python": platform.python_version(),
        "kiln": getattr(kiln, "__version__", None),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    for name in ("transformers", "triton"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def environment(device: torch.device) -> dict[str, Any]:
    from kiln.bench.ceilings import device_name

    return {
        "commit": git_commit(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": device_name(device),
        "host": platform.node(),
        "versions": versions(),
    }


def _clean(x: Any) -> Any:
    """JSON without NaN: nan and inf become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def write_json(report: dict[str, Any], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(_clean(report), indent=2) + "\n")
    return p


def _f(x: Any, spec: str = ",.1f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def markdown_row(report: dict[str, Any], path: str | Path | None = None) -> str:
    """``| date | file | device | what | figure |`` as in benchmarks/README.md."""
    s, f = report["settings"], report["figures"]
    date = report["date"][:10]
    dev = f"{report['device']}, torch {report['versions']['torch']}"
    ds = s.get("dataset", "")
    if isinstance(ds, dict):
        ds = (
            f"{ds['num_requests']:,} req, in/out {ds['mean_input_len']:.0f}/"
            f"{ds['mean_output_len']:.0f} tokens"
        )
    dtype = s.get("dtype", "") + (f" ({s['quant']})" if s.get("quant") else "")
    what = f"`kiln bench {report['name']}` `{s.get('model', '?')}` {dtype} {ds}"
    if report["name"] == "throughput":
        fig = (
            f"{_f(f['output_tokens_per_s'])} out tok/s, {_f(f['request_throughput'], '.2f')} "
            f"req/s, TPOT p50 {_f(f['tpot_ms']['p50'], '.2f')} ms, "
            f"{_f(100 * f['roofline']['fraction'], '.1f')} % of roofline"
        )
        if report.get("peer"):
            fig += f"; {_f(report['peer']['ratios']['output_tokens_per_s'], '.2f')}x HF"
    elif report["name"] == "latency":
        fig = "; ".join(
            f"bs {r['batch_size']}: TPOT {_f(r['tpot_ms']['p50'], '.2f')} ms"
            for r in f["batch_sizes"]
        )
    else:
        fig = "; ".join(
            f"{r['request_rate']} req/s: {_f(r['output_tokens_per_s'])} out tok/s, "
            f"TTFT p99 {_f(r['ttft_ms']['p99'])} ms"
            for r in f["rates"]
        )
    name = f"`{path}`" if path else "-"
    return f"| {date} | {name} | {dev} | {what} | {fig} |"


def summary_lines(f: dict[str, Any]) -> list[str]:
    """Human-readable lines of ``metrics.aggregate`` figures."""
    lines = [
        f"requests           {f['num_completed']}/{f['num_requests']} completed in "
        f"{f['wall_time_s']:.2f} s; output tokens {f['output_tokens']:,} "
        f"(requested {f['requested_output_tokens']:,})",
        f"request throughput {_f(f['request_throughput'], ',.3f')} req/s",
        f"output tokens/s    {_f(f['output_tokens_per_s'])}   total tokens/s "
        f"{_f(f['total_tokens_per_s'])}   per user {_f(f['output_tokens_per_s_per_user'])}",
    ]
    for key, label in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_ms", "E2E"),
    ):
        s = f[key]
        lines.append(
            f"{label:<5} ms           mean {_f(s['mean'], '.2f')}  p50 {_f(s['p50'], '.2f')}  "
            f"p90 {_f(s['p90'], '.2f')}  p99 {_f(s['p99'], '.2f')}"
        )
    return lines


def plot_sweep(rates: list[dict[str, Any]], path: str | Path, title: str) -> Path:
    """PNG of TTFT / TPOT / ITL percentiles against output tokens/s, one point per rate."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise KilnError(
            "the serve sweep plot needs matplotlib (pip install 'matplotlib==3.10.*'); "
            "run again without --plot, or install it."
        ) from e
    xs = [r["output_tokens_per_s"] for r in rates]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, label in zip(
        axes, ("ttft_ms", "tpot_ms", "itl_ms"), ("TTFT", "TPOT", "ITL"), strict=True
    ):
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(xs, [r[key][q] for r in rates], style, label=f"{label} {q}")
        for x, r in zip(xs, rates, strict=True):
            ax.annotate(f"{r['request_rate']}/s", (x, r[key]["p50"]), fontsize=7)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{label} (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=100)
    plt.close(fig)
    return p
