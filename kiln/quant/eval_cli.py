"""``kiln eval``: perplexity of a model on a text, or how far it strays from a reference
model (``--against``): perplexity increase, top-1 agreement and mean KL divergence."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.quant.quality import DEFAULT_MAX_TOKENS, DEFAULT_WINDOW


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _load(model: str | None, a: argparse.Namespace) -> Any:
    from kiln.checkpoint import default_model_path
    from kiln.config import KvCacheConfig
    from kiln.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(
        model or str(default_model_path()),
        dtype=a.dtype,
        device=a.device,
        max_batch_size=a.max_batch_size,
        max_seq_len=a.max_seq_len,
        max_num_tokens=a.max_num_tokens,
        seed=a.seed,
        # eval runs its own forward passes over a scratch cache: keep the engine's small
        kv_cache_config=KvCacheConfig(max_tokens=64, enable_block_reuse=False),
        enforce_eager=True,
        overlap_scheduling=False,
    )
    _say(f"loaded {model or 'embedded SmolLM2-135M-Instruct'} in {time.perf_counter() - t0:.1f} s")
    return llm


def summary(report: dict[str, Any], model: str, against: str | None, text_desc: str) -> list[str]:
    """The lines ``kiln eval`` prints for a report's ``to_dict()``."""
    r = report
    lines = [
        f"text        {text_desc}: {_count(r['num_tokens'], 'token')} scored in "
        f"{_count(r['num_windows'], 'window')} of up to {r['window']}",
        f"model       {model}",
    ]
    if against is None:
        lines += [
            f"perplexity  {r['ppl']:.4f} (mean NLL {r['mean_nll']:.4f} nats/token)",
        ]
        return lines
    lines += [
        f"reference   {against}",
        f"perplexity  {r['ppl_test']:.4f} (model), {r['ppl_ref']:.4f} (reference)",
        f"increase    {r['ppl_increase_pct']:+.3f} % " + _interval(r),
        f"top-1       {100 * r['top1_agreement']:.2f} % of positions agree",
        f"mean KL     {r['mean_kl']:.6f} nats/token (reference || model)",
    ]
    return lines


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _interval(r: dict[str, Any]) -> str:
    if r["num_windows"] < 2:  # a resample of one window is that window
        return "(one window of text: no interval; more text or a smaller --window gives one)"
    lo, hi = r["ppl_increase_ci95"]
    return f"(95 % interval over the text's windows {lo:+.3f} to {hi:+.3f} %)"


def _check_before_loading(a: argparse.Namespace) -> None:
    """What can be refused before a model loads: the counts, and both model paths (a
    missing ``--against`` was found only after ``--model`` had loaded)."""
    from kiln.checkpoint import SOURCES_HELP
    from kiln.errors import bad_value
    from kiln.quant.quality import check_counts

    check_counts(a.max_tokens, a.window, a.stride)
    for field, source in (("model", a.model), ("against", a.against)):
        if source and not source.startswith("dummy:") and not Path(source).expanduser().exists():
            raise bad_value(field, source, f"an existing path; {SOURCES_HELP}")


def cmd_eval(a: argparse.Namespace) -> int:
    from kiln.quant.calib import load_text
    from kiln.quant.quality import compare, evaluate

    text = load_text(a.text)
    _check_before_loading(a)
    text_desc = a.text or "held-out half of the default corpus (standard-library docstrings)"
    model_name = a.model or "embedded SmolLM2-135M-Instruct"
    llm = _load(a.model, a)
    t0 = time.perf_counter()
    opts = dict(max_tokens=a.max_tokens, window=a.window, stride=a.stride)
    if a.against is None:
        report = evaluate(llm, text, **opts).to_dict()
    else:
        ref = _load(a.against, a)
        report = compare(ref, llm, text, **opts).to_dict()
    _say(f"evaluated in {time.perf_counter() - t0:.1f} s")
    lines = summary(report, model_name, a.against, text_desc)
    if a.json:
        _say("\n".join(lines))
        print(json.dumps({"model": model_name, "against": a.against, **report}, indent=2))
    else:
        print("\n".join(lines))
    return 0


def add_eval_parser(sub: Any, add_build_options: Callable[..., None]) -> None:
    e = sub.add_parser(
        "eval",
        help="perplexity on a text; with --against, the distance to a reference model",
        description="Perplexity of --model on a text (default: the held-out half of kiln's "
        "built-in corpus). With --against REF, both models score the same tokens and the "
        "report gives the perplexity increase of --model over REF, the share of positions "
        "where their top-1 tokens agree and the mean KL(REF || model).",
    )
    e.add_argument(
        "--model",
        default=None,
        help="engine dir, HF dir, .gguf or dummy:<preset> (default: embedded SmolLM2)",
    )
    e.add_argument("--against", default=None, help="reference model (same vocabulary)")
    e.add_argument("--text", default=None, help="UTF-8 text file to score")
    e.add_argument(
        "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="tokens of text scored"
    )
    e.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="tokens per forward pass")
    e.add_argument(
        "--stride", type=int, default=None, help="tokens between windows (default: --window)"
    )
    e.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    add_build_options(e)
    e.set_defaults(func=cmd_eval)
