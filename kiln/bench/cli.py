"""``kiln bench throughput | latency | serve | ceilings``: argument parsing and the
commands, which print a summary, a markdown row for benchmarks/README.md and, with
``--report-json``, every figure with the commit, device, versions and settings."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections.abc import Callable
from typing import Any

from kiln.config import check_memory_fraction
from kiln.quant.cli_options import add_kv_cache_options


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _add_dataset_options(p: argparse.ArgumentParser, num_requests: int) -> None:
    g = p.add_argument_group("dataset")
    # left None here, so that --cases can tell what was given; _dataset_defaults fills them
    g.add_argument("--num-requests", type=int, default=None, help=f"(default {num_requests})")
    g.add_argument("--isl", type=int, default=None, help="input tokens per request (mean; 128)")
    g.add_argument("--osl", type=int, default=None, help="output tokens per request (mean; 128)")
    g.add_argument("--isl-stdev", type=float, default=0.0, help="normal stdev (0: fixed)")
    g.add_argument("--osl-stdev", type=float, default=0.0, help="normal stdev (0: fixed)")
    g.add_argument("--dataset-seed", type=int, default=0)
    g.add_argument("--dataset", default=None, help="JSONL dataset to load instead")
    g.add_argument("--prompts-file", default=None, help="text file, one prompt per line")
    g.add_argument("--save-dataset", default=None, help="write the dataset used as JSONL")


def _add_engine_options(p: argparse.ArgumentParser, add_build: Callable[..., None]) -> None:
    p.add_argument("--model", default=None, help="engine dir, HF dir, .gguf or dummy:<preset>")
    add_build(p)
    p.add_argument("--kv-cache-max-tokens", type=int, default=None, help="KV-cache size cap")
    add_kv_cache_options(p)
    p.add_argument(
        "--scheduler-policy",
        default="guaranteed_no_evict",
        choices=["guaranteed_no_evict", "max_utilization"],
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--no-kernel-warmup",
        action="store_true",
        help="skip compiling the eager steps' kernel variants at load (they then compile "
        "when first met, possibly while measuring)",
    )
    p.add_argument("--warmup", type=int, default=2, help="short requests run before measuring")
    p.add_argument("--report-json", default=None, help="write the full report here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--refresh-ceilings", action="store_true", help="measure the device again")


def _dataset_defaults(a: argparse.Namespace, num_requests: int) -> None:
    for name, default in (("num_requests", num_requests), ("isl", 128), ("osl", 128)):
        if getattr(a, name) is None:
            setattr(a, name, default)


def _dataset(a: argparse.Namespace, vocab: int, count: Callable[[str], int], max_len: int | None):
    from kiln.bench import datasets

    if a.dataset:
        reqs = datasets.load_jsonl(a.dataset)[: a.num_requests]
    elif a.prompts_file:
        reqs = datasets.from_text_file(
            a.prompts_file, a.osl, count, num_requests=a.num_requests, osl_stdev=a.osl_stdev
        )
    else:
        reqs = datasets.synthetic(
            a.num_requests, a.isl, a.osl, vocab, isl_stdev=a.isl_stdev,
            osl_stdev=a.osl_stdev, seed=a.dataset_seed, max_len=max_len,
        )  # fmt: skip
    if a.save_dataset:
        datasets.save_jsonl(reqs, a.save_dataset)
    return reqs


def _dataset_settings(a: argparse.Namespace, reqs: list[Any]) -> dict[str, Any]:
    from kiln.bench.datasets import describe

    src = a.dataset or a.prompts_file
    kind = f"file {src}" if src else (
        f"synthetic isl {a.isl}±{a.isl_stdev:g} osl {a.osl}±{a.osl_stdev:g} seed {a.dataset_seed}"
    )  # fmt: skip
    return {"source": kind, **describe(reqs)}


def _load(a: argparse.Namespace):
    import torch

    from kiln.bench import ceilings
    from kiln.build.target import resolve_device
    from kiln.config import KvCacheConfig, SchedulerConfig
    from kiln.llm import LLM

    f = a.kv_cache_free_gpu_memory_fraction
    check_memory_fraction("--kv-cache-free-gpu-memory-fraction", f)
    # the ceilings first: on a GPU the KV cache then takes most of the free memory
    dev = torch.device(resolve_device(a.device))
    _say(f"device ceilings ({ceilings.cache_path(dev)})")
    ceil = ceilings.get(dev, refresh=a.refresh_ceilings)
    _say(f"loading {a.model or 'the embedded model'}")
    llm = LLM(
        a.model, dtype=a.dtype, device=a.device, max_batch_size=a.max_batch_size,
        max_seq_len=a.max_seq_len, max_num_tokens=a.max_num_tokens, seed=a.seed,
        kv_cache_config=KvCacheConfig(max_tokens=a.kv_cache_max_tokens,
                                      free_gpu_memory_fraction=f),
        kv_cache_dtype=None if a.kv_cache_dtype == "auto" else a.kv_cache_dtype,
        scheduler_config=SchedulerConfig(a.scheduler_policy), progress=not a.no_progress,
        enforce_eager=a.enforce_eager, kernel_warmup=not a.no_kernel_warmup,
    )  # fmt: skip
    return llm, ceil


def _finish(report: dict[str, Any], path: str | None, lines: list[str]) -> int:
    from kiln.bench import report as rep

    if path:
        rep.write_json(report, path)
        lines.append(f"report      {path}")
    print("\n".join(lines))
    print(rep.markdown_row(report, path))
    return 0


def _measure(llm: Any, ceil: dict[str, Any], a: argparse.Namespace, reqs: list[Any],
             concurrency: int | None, extra: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """Warm-up, then ``reqs`` timed: the throughput report (``extra`` joins its settings)."""
    from kiln.bench import report as rep
    from kiln.bench import throughput as tp
    from kiln.runtime import heap
    from kiln.runtime.compiles import count_compiles

    runner = llm.core.runner
    steps0 = runner.graph_steps, runner.eager_steps  # a sweep's earlier cases not counted
    tp.warm_up(llm, reqs, a.warmup)
    _say(f"running {len(reqs)} requests (concurrency {concurrency or 'unlimited'})")
    with heap.frozen() as gc_frozen, count_compiles() as compiles:  # as kiln serve's heap
        res = tp.run_requests(llm, reqs, concurrency=concurrency, progress=not a.no_progress)
    settings = {
        **tp.engine_settings(llm),
        "graph_steps": runner.graph_steps - steps0[0],
        "eager_steps": runner.eager_steps - steps0[1],
        "dataset": _dataset_settings(a, reqs),
        "concurrency": concurrency,
        "warmup_requests": a.warmup,
        "gc_frozen_objects": gc_frozen,
        **extra,
        "ceilings": ceil,
    }
    return {
        "name": "throughput",
        **rep.environment(llm.engine.device),
        "settings": settings,
        "figures": tp.figures(llm, res, ceil)
        | {"triton_variants_loaded": compiles.figures() if compiles else None},
    }


def _kiln_throughput(a: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], list]:
    llm, ceil = _load(a)
    reqs = _dataset(
        a, llm.config.vocab_size, lambda s: len(llm.tokenizer.encode(s)), llm.max_seq_len
    )
    report = _measure(llm, ceil, a, reqs, a.concurrency, {})
    peer_in = {
        "source": llm.engine.manifest["source"],
        "cfg": llm.config,
        "device": llm.engine.device,
        "dtype": llm.engine.dtype,
        "batch_size": min(len(reqs), llm.engine.limits["max_batch_size"]),
    }
    return report, peer_in, reqs


def cmd_throughput(a: argparse.Namespace) -> int:
    from kiln.bench import peer

    if a.cases is not None:
        return _throughput_cases(a)
    _dataset_defaults(a, 1000)
    report, p, reqs = _kiln_throughput(a)  # the engine is freed on return
    if a.peer:
        peer.free_device_memory()
        bs = a.peer_batch_size or p["batch_size"]
        _say(f"HF transformers peer: batch size {bs}")
        model = peer.load_peer(p["source"], p["cfg"], p["device"], p["dtype"])
        pf = peer.run_peer(model, reqs, bs, p["device"], progress=not a.no_progress)
        report["peer"] = {"figures": pf, "ratios": peer.ratios(report["figures"], pf)}
    return _finish(report, a.report_json, _throughput_lines(report))


def _throughput_cases(a: argparse.Namespace) -> int:
    """``--cases``: every case on one load (see ``kiln.bench.sweep``)."""
    from kiln.bench import sweep
    from kiln.bench.datasets import synthetic

    cases = sweep.parse_cases(a.cases)
    sweep.check_options(a, cases)
    llm, ceil = _load(a)
    sweep.check_fits(cases, llm.max_seq_len)
    for i, case in enumerate(cases):
        a.num_requests, a.isl, a.osl = case.num_requests, case.isl, case.osl  # for the settings
        forgot = llm.reset_prefix_cache()
        _say(f"case {i + 1} of {len(cases)}: {case.spec} (prefix cache emptied: {forgot} blocks)")
        reqs = synthetic(
            case.num_requests, case.isl, case.osl, llm.config.vocab_size, isl_stdev=a.isl_stdev,
            osl_stdev=a.osl_stdev, seed=a.dataset_seed, max_len=llm.max_seq_len,
        )  # fmt: skip
        extra = {"case": {"spec": case.spec, "index": i, "of": a.cases}}
        report = _measure(llm, ceil, a, reqs, case.concurrency, extra)
        _finish(report, sweep.report_path(a.report_json, case), _throughput_lines(report))
    return 0


def _throughput_lines(report: dict[str, Any]) -> list[str]:
    from kiln.bench import report as rep

    f = report["figures"]
    r = f["roofline"]
    lines = ["", *rep.summary_lines(f)]
    lines += [
        f"KV cache     peak {100 * f['peak_kv_cache_usage']:.1f} % of "
        f"{report['settings']['kv_cache_tokens']:,} tokens; preemptions {f['num_preemptions']}",
        f"roofline     {100 * r['fraction']:.1f} % (ideal {r['ideal_time_s']:.3f} s of measured "
        f"{r['measured_time_s']:.3f} s over {r['steps']} steps; "
        f"{r['memory_bound_steps']} memory-bound)",
    ]
    plan = report["settings"].get("memory_plan") or {}
    if plan.get("free_bytes_at_kv_sizing"):  # a GPU cache sized to fit (not set by max_tokens)
        lines.append(
            f"memory plan  {plan['free_bytes_at_kv_sizing'] / 2**30:.2f} GiB free at sizing, "
            f"{plan['activation_peak_bytes'] / 2**30:.2f} GiB step peak held back, "
            f"{plan['kv_cache_bytes'] / 2**30:.2f} GiB KV cache"
        )
    if "peer" in report:
        pf, ratio = report["peer"]["figures"], report["peer"]["ratios"]
        lines.append(
            f"HF peer      {pf['output_tokens_per_s']:,.1f} out tok/s at batch "
            f"{pf['batch_size']}; kiln/peer {ratio['output_tokens_per_s']:.2f}x"
        )
    tv = f["triton_variants_loaded"]
    if tv and tv["count"]:
        lines.append(
            f"WARNING: {tv['count']} Triton kernel variants were first loaded while measuring "
            f"({tv['seconds']:.1f} s, compiles or cache reads inside the timed window); "
            "more --warmup requests, or a second run, give a steady-state figure"
        )
    if not f["tokens_match"]:
        lines.append("WARNING: output tokens differ from the tokens requested")
    return lines


def cmd_latency(a: argparse.Namespace) -> int:
    from kiln.bench import latency as lat
    from kiln.bench import report as rep
    from kiln.bench import throughput as tp
    from kiln.bench.datasets import synthetic
    from kiln.runtime import heap

    sizes = lat.parse_batch_sizes(a.batch_sizes)
    llm, ceil = _load(a)
    tp.warm_up(llm, synthetic(1, a.isl, a.osl, llm.config.vocab_size), a.warmup)
    with heap.frozen():
        rows = lat.run_latency(
            llm, sizes, a.isl, a.osl, iterations=a.iterations, progress=not a.no_progress
        )
    report = {
        "name": "latency",
        **rep.environment(llm.engine.device),
        "settings": {
            **tp.engine_settings(llm),
            "dataset": f"synthetic isl {a.isl} osl {a.osl}",
            "iterations": a.iterations,
            "ceilings": ceil,
        },
        "figures": {"batch_sizes": rows},
    }
    lines = ["", "batch  TPOT p50 ms  TTFT p50 ms  E2E p50 ms  out tok/s  per user"]
    for r in rows:
        lines.append(
            f"{r['batch_size']:>5}  {r['tpot_ms']['p50']:>11.2f}  {r['ttft_ms']['p50']:>11.2f}  "
            f"{r['e2e_ms']['p50']:>10.1f}  {r['output_tokens_per_s']:>9.1f}  "
            f"{r['output_tokens_per_s_per_user']:>8.1f}"
        )
    return _finish(report, a.report_json, lines)


def cmd_serve_bench(a: argparse.Namespace) -> int:
    import torch

    from kiln.bench import report as rep
    from kiln.bench import serve

    _dataset_defaults(a, 100)
    rates = serve.parse_rates(a.request_rate)
    reqs = _dataset(a, a.vocab_size, lambda s: 0, None)
    res = asyncio.run(
        serve.sweep(
            a.url, reqs, rates, model=a.served_model, max_concurrency=a.max_concurrency,
            seed=a.seed, progress=not a.no_progress,
        )
    )  # fmt: skip
    report = {
        "name": "serve",
        **rep.environment(torch.device("cpu")),
        "settings": {
            "url": a.url,
            "model": res["model"],
            "dataset": _dataset_settings(a, reqs),
            "request_rates": [r if math.isfinite(r) else "inf" for r in rates],
            "max_concurrency": a.max_concurrency,
            "length_forced": res["length_forced"],
            "client_device": "device = the client's machine; the server's is not known",
        },
        "figures": {"rates": res["rates"]},
    }
    lines = []
    for r in res["rates"]:
        lines += ["", f"request rate {r['request_rate']} /s", *rep.summary_lines(r)]
    if a.plot:
        rep.plot_sweep(res["rates"], a.plot, f"kiln bench serve: {res['model']} at {a.url}")
        lines.append(f"plot        {a.plot}")
    return _finish(report, a.report_json, lines)


def cmd_ceilings(a: argparse.Namespace) -> int:
    from kiln.bench.ceilings import print_ceilings

    return print_ceilings(a.device, a.refresh, a.json)


def cmd_kernels(a: argparse.Namespace) -> int:
    from kiln.bench.kernels import run_command

    return run_command(a.report_json)


def add_bench_parser(sub: Any, add_build_options: Callable[..., None]) -> None:
    b = sub.add_parser("bench", help="throughput, latency and serving benchmarks")
    bs = b.add_subparsers(dest="bench_command", required=True)

    t = bs.add_parser("throughput", help="offline: all requests at once, output length forced")
    _add_engine_options(t, add_build_options)
    _add_dataset_options(t, 1000)
    t.add_argument("--concurrency", type=int, default=None, help="cap on requests in flight")
    t.add_argument(
        "--cases", default=None, metavar="NxISLxOSL[@C],...",
        help="synthetic shapes measured one after another on one load, each with its own "
        "warm-up, an emptied prefix cache and its own report (--report-json with {case}, "
        "for several); replaces --num-requests, --isl, --osl and --concurrency",
    )  # fmt: skip
    t.add_argument("--peer", choices=["hf"], default=None, help="also run transformers generate")
    t.add_argument("--peer-batch-size", type=int, default=None, help="(default max_batch_size)")
    t.set_defaults(func=cmd_throughput)

    lat = bs.add_parser("latency", help="fixed batch sizes: time per output token")
    _add_engine_options(lat, add_build_options)
    lat.add_argument("--isl", type=int, default=128)
    lat.add_argument("--osl", type=int, default=128)
    lat.add_argument("--batch-sizes", default="1,2,4,8", help="1,2,4 or a range 1-8")
    lat.add_argument("--iterations", type=int, default=3)
    lat.set_defaults(func=cmd_latency)

    s = bs.add_parser("serve", help="online: Poisson arrivals against an OpenAI-style server")
    s.add_argument("--url", required=True, help="e.g. http://127.0.0.1:8000")
    s.add_argument("--served-model", default=None, help="model id (default: first listed)")
    s.add_argument("--request-rate", default="inf", help="req/s, comma-separated sweep; inf")
    s.add_argument("--max-concurrency", type=int, default=None)
    s.add_argument("--vocab-size", type=int, default=500, help="synthetic ids in [0, N)")
    s.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    s.add_argument("--plot", default=None, help="PNG of latency percentiles vs throughput")
    s.add_argument("--report-json", default=None)
    s.add_argument("--no-progress", action="store_true")
    _add_dataset_options(s, 100)
    s.set_defaults(func=cmd_serve_bench)

    k = bs.add_parser("kernels", help="attention kernel micro-benchmarks against the ceilings")
    k.add_argument("--report-json", default=None)
    k.set_defaults(func=cmd_kernels)

    c = bs.add_parser("ceilings", help="measure the device's bandwidth and matmul rates")
    c.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    c.add_argument("--refresh", action="store_true", help="measure again (ignore the cache)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_ceilings)
