"""``kiln build | run | inspect | eval | serve | bench``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kiln.config import (
    DTYPES,
    BuildConfig,
    Mapping,
)
from kiln.errors import KilnError
from kiln.quant.cli_options import (
    add_kv_cache_options,
    add_quant_options,
    quant_config_from_args,
    quant_desc,
)


def _add_build_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="weights and activations (auto: float32 on CPU, bfloat16 on GPU)",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--max-batch-size", type=int, default=64, help="sequences per step")
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="prompt + output tokens per sequence (default: the model's context)",
    )
    p.add_argument("--max-num-tokens", type=int, default=8192, help="tokens per forward step")
    p.add_argument("--seed", type=int, default=0, help="seed of dummy:<preset> weights")


def _build_config(a: argparse.Namespace, mapping: Mapping | None = None) -> BuildConfig:
    return BuildConfig(
        dtype=a.dtype,
        device=a.device,
        max_batch_size=a.max_batch_size,
        max_seq_len=a.max_seq_len,
        max_num_tokens=a.max_num_tokens,
        quant=quant_config_from_args(a),
        mapping=mapping or Mapping(),
        reuse_tuning=not getattr(a, "no_tuning_cache", False),
    )


def _model_or_embedded(model: str | None) -> str:
    """``--model``, or the embedded SmolLM2's path (said on stderr) when it was not given."""
    if model is not None:
        return model
    from kiln.checkpoint import default_model_path

    path = str(default_model_path())
    print(f"model: embedded SmolLM2-135M-Instruct ({path})", file=sys.stderr)
    return path


def cmd_build(a: argparse.Namespace) -> int:
    from kiln.build.builder import build_engine

    mapping = Mapping(tp=a.tp, pp=a.pp)
    if mapping.world_size != 1:
        raise KilnError(
            f"--tp {a.tp} --pp {a.pp}: tensor and pipeline parallelism are not available in "
            "this version of kiln; build with --tp 1 --pp 1."
        )
    t0 = time.perf_counter()
    model = _model_or_embedded(a.model)
    print(f"building {model} -> {a.output}", file=sys.stderr)
    m = build_engine(model, a.output, _build_config(a, mapping), seed=a.seed)
    size = sum(f["size"] for f in m["files"].values())
    print(
        f"built {a.output} in {time.perf_counter() - t0:.1f} s: {m['model']['architecture']}, "
        f"{m['dtype']}{', ' + m['quant']['algo'] if m['quant'].get('algo') else ''}, "
        f"{m['target']['device']}"
        f"{' (' + m['target']['gpu_name'] + ')' if m['target']['gpu_name'] else ''}, "
        f"{size / 2**20:.1f} MiB on disk"
    )
    return 0


def cmd_run(a: argparse.Namespace) -> int:
    from kiln.llm import LLM
    from kiln.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        seed=a.sample_seed,
    )
    model = _model_or_embedded(a.model)
    t0 = time.perf_counter()
    llm = LLM(
        model,
        dtype=a.dtype,
        device=a.device,
        max_batch_size=a.max_batch_size,
        max_seq_len=a.max_seq_len,
        max_num_tokens=a.max_num_tokens,
        seed=a.seed,
    )
    print(f"loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if a.raw:
        out = llm.generate(a.prompt, params, use_tqdm=False)[0]
    else:
        messages = [{"role": "system", "content": a.system}] if a.system else []
        messages.append({"role": "user", "content": a.prompt})
        out = llm.chat(messages, params, use_tqdm=False)[0]
    print(out.outputs[0].text.strip() if not a.raw else out.outputs[0].text)
    return 0


def describe(m: dict[str, Any], root: Path) -> str:
    mc, t, lim = m["model"], m["target"], m["limits"]
    files = m.get("files", {})
    size = sum(f["size"] for f in files.values())
    gpu = f"{t['gpu_name']} (compute capability {t['compute_capability']})" if t["gpu_name"] else ""
    weights = m["weights"]
    wdesc = (
        f"random (dummy, seed {weights['seed']}), generated at load"
        if weights["kind"] == "dummy"
        else ", ".join(weights["ranks"])
    )
    q = m["quant"]
    lines = [
        f"engine      {root}",
        f"format      v{m['format_version']}, kiln {m['kiln_version']}, built {m['created']} "
        f"in {m['build']['wall_time_s']:.1f} s",
        f"source      {m['source']['model']} ({m['source']['kind']})",
        f"model       {mc['architecture']}: {mc['num_hidden_layers']} layers, hidden "
        f"{mc['hidden_size']}, {mc['num_attention_heads']} heads / {mc['num_key_value_heads']} "
        f"kv heads x {mc['head_dim']}, ffn {mc['intermediate_size']}, vocab {mc['vocab_size']}, "
        f"context {mc['max_position_embeddings']}",
        f"rope        theta {mc['rope_theta']:g}, scaling "
        f"{(mc['rope_scaling'] or {}).get('rope_type', 'none')}",
        f"precision   {m['dtype']}; quantization {quant_desc(q)}; KV cache "
        f"{q['kv_cache_dtype'] or m['dtype']}"
        + (" (Hadamard-rotated keys)" if q.get("kv_rotation") == "hadamard" else ""),
        f"mapping     tp {m['mapping']['tp']} x pp {m['mapping']['pp']}",
        f"limits      max_batch_size {lim['max_batch_size']}, max_seq_len {lim['max_seq_len']}, "
        f"max_num_tokens {lim['max_num_tokens']}",
        f"target      {t['device']} {gpu}; torch {t['torch']}, triton {t['triton'] or '-'}",
        f"weights     {wdesc}",
        f"tokenizer   {m['tokenizer'] or 'none (byte-level fallback)'}",
        f"files       {len(files)}, {size / 2**20:.1f} MiB",
    ]
    lines += [
        f"  {name:<32} {f['size']:>14,d} B  sha256 {f['sha256'][:16]}…" for name, f in files.items()
    ]
    return "\n".join(lines)


def cmd_inspect(a: argparse.Namespace) -> int:
    from kiln.build.engine_dir import read_manifest

    root = Path(a.engine)
    m = read_manifest(root)
    print(json.dumps(m, indent=2) if a.json else describe(m, root))
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from kiln.serve.config import make_config
    from kiln.serve.server import run

    overrides = {k: v for k, v in vars(a).items() if k not in ("command", "func", "config")}
    return run(make_config(a.config, overrides))


def _add_serve_options(s: argparse.ArgumentParser) -> None:
    """Every flag defaults to SUPPRESS, so only the flags given override the YAML file."""
    S = argparse.SUPPRESS
    s.add_argument("--config", default=None, help="YAML file of options (flags override it)")
    s.add_argument(
        "--model", default=S, help="engine dir, HF dir, .gguf or dummy:<preset> (default: embedded)"
    )
    s.add_argument("--served-model-name", default=S, help="model id clients use")
    s.add_argument("--host", default=S, help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=S, help="port (default 8000)")
    s.add_argument("--api-key", default=S, help="require this key on /v1 (or $KILN_API_KEY)")
    s.add_argument(
        "--max-queued-requests", type=int, default=S, help="waiting requests before 429 (256)"
    )
    s.add_argument(
        "--shutdown-timeout", type=float, default=S, help="seconds to drain on SIGTERM (30)"
    )
    s.add_argument("--max-n", type=int, default=S, help="choices per request (16)")
    s.add_argument("--max-body-bytes", type=int, default=S, help="request body limit (1 MiB)")
    s.add_argument("--max-header-count", type=int, default=S, help="request headers limit (100)")
    s.add_argument("--max-header-bytes", type=int, default=S, help="header bytes limit (16384)")
    s.add_argument(
        "--max-model-len", type=int, default=S, help="prompt + max_tokens cap (engine max_seq_len)"
    )
    s.add_argument("--max-stop-strings", type=int, default=S, help="stop strings limit (16)")
    s.add_argument(
        "--reject-unknown-fields",
        action="store_true",
        default=S,
        help="answer 400 to unknown body fields (default: ignore them)",
    )
    s.add_argument(
        "--log-level", default=S, choices=["critical", "error", "warning", "info", "debug"]
    )
    s.add_argument("--dtype", default=S, choices=["auto", *DTYPES])
    s.add_argument("--device", default=S, choices=["auto", "cuda", "cpu"])
    s.add_argument("--max-batch-size", type=int, default=S, help="sequences per step (64)")
    s.add_argument("--max-seq-len", type=int, default=S, help="prompt + output tokens per sequence")
    s.add_argument("--max-num-tokens", type=int, default=S, help="tokens per forward step (8192)")
    s.add_argument("--kv-cache-max-tokens", type=int, default=S, help="KV-cache size in tokens")
    add_kv_cache_options(s, S)
    s.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        default=S,
        help="do not reuse computed prompt blocks across requests",
    )
    s.add_argument("--enforce-eager", action="store_true", default=S, help="no CUDA graphs")
    s.add_argument(
        "--scheduler-policy", default=S, choices=["guaranteed_no_evict", "max_utilization"]
    )
    s.add_argument("--seed", type=int, default=S, help="seed of dummy:<preset> weights")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kiln", description="Build and run LLM engines.")
    sub = ap.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="build an engine directory from a checkpoint")
    b.add_argument(
        "--model",
        default=None,
        help="HF directory, .gguf file or dummy:<preset> (default: embedded SmolLM2)",
    )
    b.add_argument("--output", required=True, help="engine directory to write")
    _add_build_options(b)
    b.add_argument(
        "--no-tuning-cache",
        action="store_true",
        help="time the GPU kernels again instead of reusing an earlier build's tuning of the "
        "same shapes, limits, GPU and kiln (kept in $KILN_CACHE_DIR/tuning; "
        "KILN_TUNING_CACHE=0 does the same for every command)",
    )
    b.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    b.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks")
    add_quant_options(b)
    b.set_defaults(func=cmd_build)

    r = sub.add_parser("run", help="generate a reply to one prompt")
    r.add_argument("prompt")
    r.add_argument(
        "--model",
        default=None,
        help="engine dir, HF dir, .gguf or dummy:<preset> (default: embedded SmolLM2)",
    )
    _add_build_options(r)
    r.add_argument("--max-tokens", type=int, default=256)
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    r.add_argument("--top-k", type=int, default=-1)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--sample-seed", type=int, default=None, help="seed of the sampler")
    r.add_argument("--raw", action="store_true", help="skip the chat template")
    r.add_argument("--system", default=None, help="system message for the chat template")
    r.set_defaults(func=cmd_run)

    i = sub.add_parser("inspect", help="describe an engine directory")
    i.add_argument("engine")
    i.add_argument("--json", action="store_true", help="print the raw manifest")
    i.set_defaults(func=cmd_inspect)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible API over HTTP")
    _add_serve_options(s)
    s.set_defaults(func=cmd_serve)

    from kiln.quant.eval_cli import add_eval_parser

    add_eval_parser(sub, _add_build_options)

    from kiln.bench.cli import add_bench_parser

    add_bench_parser(sub, _add_build_options)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        return a.func(a)
    except KilnError as e:
        command = " ".join([a.command, *([a.bench_command] if "bench_command" in a else [])])
        print(f"kiln {command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
