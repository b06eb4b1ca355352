"""Build-time kernel tuning: time each kernel's candidate configurations at the model's own
shapes on the target GPU and keep the fastest, in the engine's ``tuning.json``. Loading
the engine makes them active (``kiln.kernels.tuning.set_tuning``) without re-tuning.

A CPU build has nothing to time: its tuning.json records the defaults and says so."""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kiln.bench.kernels import graph_us, median_cuda_ms
from kiln.build.tuning_cases import (
    CASE_CACHE_BYTES,
    DECODE_CANDIDATES,
    MEDIUM_BATCH,
    MEDIUM_BATCH_CASES,
    SMALL_BATCH,
    SMALL_BATCH_BLOCKS_PER_STEP,
    SMALL_BATCH_CASES,
    _decode_case,
    _prefill_case,
    main_decode_cases,
    projection_shapes,
    skinny_shapes,
)
from kiln.config import ModelConfig, QuantConfig
from kiln.kernels.prefill_attention import prefill_config_candidates
from kiln.kernels.tuning import DEFAULTS, KEYS, set_tuning
from kiln.quant import passes as quant_passes
from kiln.runtime.cuda_graphs import default_batch_sizes

TUNING = "tuning.json"


def _case_budget() -> int:
    """Bytes of cache one large decode case may take: ``CASE_CACHE_BYTES``, or a quarter of
    the GPU's free memory where that is less."""
    return min(CASE_CACHE_BYTES, torch.cuda.mem_get_info()[0] // 4)


def _median_ms(fn: Callable[[], Any]) -> float:
    return median_cuda_ms(fn, 10)


def _graph_ms(fn: Callable[[], Any]) -> float:
    """One call's GPU time with 32 calls (a decode step's layers) in a CUDA graph: for
    kernels of a few microseconds, whose single-call event timing is mostly launch cost."""
    return graph_us(fn, reps=10, per_graph=32) / 1e3


class Lazy:
    """A case made only when it is timed, and freed before the next (large inputs)."""

    def __init__(self, make: Callable[[], Callable[[dict[str, Any]], Any]]) -> None:
        self.make = make


def _best(
    name: str,
    candidates: list[dict[str, Any]],
    cases: list[Callable[[dict[str, Any]], Any] | Lazy],
    timer: Callable[[Callable[[], Any]], float] = _median_ms,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The candidate with the least total time (``timer``, ms) over ``cases``; failures
    (e.g. a tile that needs more shared memory than the GPU has) are recorded and
    skipped. Every candidate is timed on one case before the next case is made."""
    totals = [0.0] * len(candidates)
    errors: dict[int, str] = {}
    for case in cases:
        run = case.make() if isinstance(case, Lazy) else case
        for i, c in enumerate(candidates):
            if i in errors:
                continue
            try:
                totals[i] += timer(lambda run=run, c=c: run(c))
            except Exception as e:
                errors[i] = f"{type(e).__name__}: {str(e)[:120]}"
        del run
        if isinstance(case, Lazy) and torch.cuda.is_available():
            torch.cuda.empty_cache()
    rows = [
        {**c, "error": errors[i]} if i in errors else {**c, "ms": round(totals[i], 4)}
        for i, c in enumerate(candidates)
    ]
    ok = [r for r in rows if "ms" in r]
    if not ok:
        return dict(DEFAULTS[name]), rows
    best = min(ok, key=lambda r: r["ms"])
    return {k: best[k] for k in KEYS[name] if k in best}, rows


def _precompile(work: Callable[[], Any]) -> dict[str, Any] | None:
    """``work`` (a dry run of a phase's candidates, called as the timing will call them)
    with the new kernel variants it needs deferred, then compiled at once in threads
    (``kiln.runtime.kernel_record.precompile``): the figures, or None where that is off
    (``KILN_COMPILE_WORKERS=0``) or there is no GPU. The timing then finds them compiled."""
    from kiln.runtime.kernel_record import compile_workers, precompile

    if not torch.cuda.is_available() or compile_workers() <= 0:
        return None
    return precompile(work)


def _each_once(
    parts: list[tuple[list[dict[str, Any]], list[Callable[[dict[str, Any]], Any] | Lazy]]],
) -> Callable[[], None]:
    """A dry run for ``_precompile``: each part's candidates called once on each of its
    cases (a ``Lazy`` case made for it), failures ignored (the timed run records them)."""

    def dry() -> None:
        for candidates, cases in parts:
            for case in cases:
                run = case.make() if isinstance(case, Lazy) else case
                for c in candidates:
                    with contextlib.suppress(Exception):
                        run(c)
                del run

    return dry


SKINNY_MAX_CANDIDATES = 10  # per shape and row count: keeps the build under a minute
SKINNY_TUNE_ROWS = (1, 4, 16)
"""Batch sizes at which the skinny matmul is tuned; other sizes take the config of the next
larger one (see kiln.kernels.gemv.skinny_config)."""


def _tune_skinny(
    cfg: ModelConfig, dtype: torch.dtype, shapes: set[tuple[int, int]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fastest skinny-matmul candidate per projection shape of ``shapes`` (see
    ``skinny_shapes``) and per row count of ``SKINNY_TUNE_ROWS`` (only 16-bit models use
    the kernel); with the three fastest candidates of each, as measured. Shapes not tuned
    take the kernel's default heuristic."""
    from kiln.bench.gemv_bench import cublas_ms, tune_skinny

    if dtype not in (torch.bfloat16, torch.float16) or not shapes:
        return dict(DEFAULTS["skinny_matmul"]), {}
    by_shape: dict[str, dict[str, Any]] = {}
    measured: dict[str, Any] = {}

    def dry() -> None:  # every variant first, compiled in threads
        for n, k in sorted(shapes):
            for m in SKINNY_TUNE_ROWS:
                tune_skinny(n, k, m, dtype, max_candidates=SKINNY_MAX_CANDIDATES, timed=False)

    if (pre := _precompile(dry)) is not None:
        measured["precompile"] = pre
    for n, k in sorted(shapes):
        for m in SKINNY_TUNE_ROWS:
            rows = tune_skinny(n, k, m, dtype, max_candidates=SKINNY_MAX_CANDIDATES)
            cublas = cublas_ms(n, k, m, dtype)
            if "ms" in rows[0] and rows[0]["ms"] < cublas:
                by_shape.setdefault(f"{n}x{k}", {})[str(m)] = rows[0]["config"]
            else:  # cuBLAS wins (or no candidate ran): the dispatcher keeps F.linear
                by_shape.setdefault(f"{n}x{k}", {})[str(m)] = {"cublas": True}
            measured[f"{n}x{k} m={m}"] = {
                "cublas_ms": cublas,
                "best": [{**r["config"], "ms": r.get("ms")} for r in rows[:3]],
            }
    return {"by_shape": by_shape}, measured


WQ_TUNE_ROWS = (1, 4, 8, 16, 32, 64)
"""Batch sizes at which the weight-only kernels are tuned (the lookup as for the skinny
matmul: 33-96 rows take the 64-row pick); beyond ``WQ_MAX_M`` rows (int4 96, int8 64)
the dispatcher dequantizes and calls cuBLAS."""


def _tune_weight_only(
    cfg: ModelConfig, quant: QuantConfig | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fastest weight-only kernel configuration per projection shape of an int4-awq or
    int8-wo engine (the lm_head's too where it is quantized) and per row count of
    ``WQ_TUNE_ROWS``, with the three fastest of each; apart (``f16``) the float16-code
    kernel's where it beat them all (``kiln.kernels.wq_tiled``)."""
    from kiln.bench.quant_bench import tune_weight_only, weight_only_copies

    if quant is None or quant.algo not in ("int4-awq", "int8-wo"):
        return dict(DEFAULTS["weight_only"]), {}
    from kiln.kernels.wq_gemm import wq_shape_key

    group = quant.group_size if quant.algo == "int4-awq" else None
    shapes = projection_shapes(cfg)
    if quant.quantize_lm_head:  # the largest weight: its untuned default ran 108 µs a call
        shapes.add((cfg.vocab_size, cfg.hidden_size))  # at one row on the H200, tuned 84
    by_shape: dict[str, dict[str, Any]] = {}
    f16: dict[str, dict[str, Any]] = {}
    measured: dict[str, Any] = {}
    # a model the build refused already (K not of whole groups) has nothing to time
    todo = [(n, k) for n, k in sorted(shapes) if not (group and k % group)]

    # every shape's and row count's new kernel variants compile at once in threads before
    # they are timed (else one by one as each is first called): one batch for all shapes
    def dry() -> None:
        for n, k in todo:
            one = weight_only_copies(n, k, group, empty=True)
            for m in WQ_TUNE_ROWS:
                tune_weight_only(n, k, m, group, ws=one, timed=False)
            del one

    if (pre := _precompile(dry)) is not None:
        measured["precompile"] = pre
    for n, k in todo:
        key = wq_shape_key(n, k, group)
        ws = weight_only_copies(n, k, group)  # one set of weights for every row count
        for m in WQ_TUNE_ROWS:
            rows = tune_weight_only(n, k, m, group, ws=ws)
            ok = [r for r in rows if "ms" in r]
            other = [r for r in ok if not r["config"].get("F16")]
            if other:  # else the default configuration
                by_shape.setdefault(key, {})[str(m)] = other[0]["config"]
            if ok and ok[0]["config"].get("F16"):  # the float16-code kernel won (wq_tiled)
                f16.setdefault(key, {})[str(m)] = ok[0]["config"]
            measured[f"{key} m={m}"] = [{**r["config"], "ms": r.get("ms")} for r in rows[:3]]
            if ok and ok[0]["config"].get("F16") and other:  # and what it beat
                measured[f"{key} m={m}"].append({**other[0]["config"], "ms": other[0]["ms"]})
        del ws  # before the next shape's copies are made
    return {"by_shape": by_shape, "f16": f16}, measured


FP8_TUNE_ROWS = (1, 4, 8, 16, 32)
"""Rows at which fp8 engines time the fp8 skinny kernel (up to four rows) and the
tensor-core fp8 kernel (up to 32) against ``torch._scaled_mm``; a step of m rows takes the
pick of the smallest of these >= m."""


def _tune_fp8_skinny(
    cfg: ModelConfig, quant: QuantConfig | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per projection shape of an fp8 engine (with the outlier columns where the build
    splits them) and per row count of ``FP8_TUNE_ROWS``: the fp8 skinny kernel's fastest
    configuration where it beats ``torch._scaled_mm``, else ``{"scaled_mm": true}``."""
    from kiln.bench.gemv_bench import fp8_weight_copies, tune_fp8_skinny

    if quant is None or quant.algo != "fp8" or quant.activation_scheme == "block":
        # block scales: torch._scaled_mm at every row count
        return dict(DEFAULTS["fp8_skinny"]), {}
    shapes = projection_shapes(cfg)
    if quant.activation_scheme == "outliers":  # [W | W_hi | W_lo]: K + 2C columns
        want = quant.act_outliers  # set whenever the scheme is "outliers" (QuantConfig)
        shapes |= {(n, k + 2 * c) for n, k in shapes if (c := quant_passes.outlier_count(want, k))}
    by_shape: dict[str, dict[str, Any]] = {}
    measured: dict[str, Any] = {}

    def dry() -> None:  # every variant first, compiled in threads
        for n, k in sorted(shapes):
            for m in FP8_TUNE_ROWS:
                tune_fp8_skinny(n, k, m, timed=False)

    if (pre := _precompile(dry)) is not None:
        measured["precompile"] = pre
    for n, k in sorted(shapes):
        ws = fp8_weight_copies(n, k)  # one set of weights for every row count
        for m in FP8_TUNE_ROWS:
            rows, mm_ms = tune_fp8_skinny(n, k, m, weights=ws)
            ok = rows and "ms" in rows[0] and rows[0]["ms"] < mm_ms
            by_shape.setdefault(f"{n}x{k}", {})[str(m)] = (
                rows[0]["config"] if ok else {"scaled_mm": True}
            )
            measured[f"{n}x{k} m={m}"] = {
                "scaled_mm_ms": mm_ms,
                "best": [{**r["config"], "ms": r.get("ms")} for r in rows[:3]],
            }
        del ws  # before the next shape's copies are made
    return {"by_shape": by_shape}, measured


def tune(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: str,
    limits: dict[str, int],
    bs: int = 32,
    quant: QuantConfig | None = None,
    dense_layers: bool = True,
) -> dict[str, Any]:
    """tuning.json's content for a build on ``device``. ``dense_layers``: whether a layer
    projection may stay in the engine's dtype (``skinny_shapes``)."""
    sizes = default_batch_sizes(limits["max_batch_size"])
    if device != "cuda":
        return {
            "tuned": False,
            "why": "built for the CPU: no GPU kernels to time; defaults recorded",
            "kernels": DEFAULTS,
            "cuda_graph_batch_sizes": sizes,
        }
    t0 = time.perf_counter()
    phases: dict[str, float] = {}  # seconds each kernel's tuning took (where builds spend)

    def lap(name: str) -> None:
        phases[name] = round(time.perf_counter() - t0 - sum(phases.values()), 2)

    ctx = min(limits["max_seq_len"], 4096)
    kv_fp8 = quant is not None and quant.kv_cache_dtype == "fp8"
    limit = limits["max_seq_len"]
    decode_cases: list[Any] = [
        Lazy(functools.partial(_decode_case, cfg, dtype, b, c, bs, kv_fp8, limit=limit))
        for b, c in main_decode_cases(cfg, dtype, limits, kv_fp8, _case_budget())
    ]
    decode_candidates = [dict(c) for c in DECODE_CANDIDATES]
    kernels: dict[str, Any] = {}
    measured: dict[str, Any] = {}
    # latency-bound steps apart, called as the engine's graphs call the kernel (max_seq_len
    # the engine's limit) and timed in a graph: on an H200 one int4 engine ran 2.49 / 3.56
    # ms TPOT at 1 / 8 sequences with these cases' pick under single-call timing (264/4/2)
    # and 2.02 / 2.71 with 528/4/1 (the graph-timed experiment's choice)
    small = min(SMALL_BATCH, limits["max_batch_size"])
    tiers = [("small_batch", small, SMALL_BATCH_CASES)]
    medium = min(MEDIUM_BATCH, limits["max_batch_size"])
    if medium > small:
        tiers.append(("medium_batch", medium, MEDIUM_BATCH_CASES))
    tier_runs = []
    for tier, most, shapes in tiers:
        cases = [  # made when timed (the precompile's dry run makes them too)
            Lazy(functools.partial(_decode_case, cfg, dtype, min(b, most), min(limit, c), bs,
                                   kv_fp8, limit=limit))
            for b, c in shapes
        ]  # fmt: skip
        cands = decode_candidates
        if tier == "small_batch":
            cands = [c for c in cands if c["blocks_per_step"] in SMALL_BATCH_BLOCKS_PER_STEP]
        tier_runs.append((tier, most, cands, cases))
    prefill_cases = [
        Lazy(functools.partial(_prefill_case, cfg, dtype, n, t, bs, kv_fp8))
        for n, t in ((1, min(limits["max_num_tokens"], ctx, 4096)),
                     (8, min(limits["max_num_tokens"] // 8, 512)))
    ]  # fmt: skip
    prefill_candidates = prefill_config_candidates(cfg.head_dim, dtype)
    pre = _precompile(_each_once(
        [(decode_candidates, decode_cases), *[(c, k) for _, _, c, k in tier_runs],
         (prefill_candidates, prefill_cases)]
    ))  # fmt: skip
    if pre is not None:
        measured["precompile"] = {"attention": pre}
        lap("precompile_attention")
    kernels["decode_attention"], measured["decode_attention"] = _best(
        "decode_attention", decode_candidates, decode_cases
    )
    for tier, most, cands, cases in tier_runs:
        best, measured[f"decode_attention_{tier}"] = _best(
            "decode_attention", cands, cases, _graph_ms
        )
        kernels["decode_attention"][tier] = {"max_batch": most} | best
    lap("decode_attention")
    kernels["prefill_attention"], measured["prefill_attention"] = _best(
        "prefill_attention", prefill_candidates, prefill_cases
    )
    lap("prefill_attention")
    kernels["skinny_matmul"], measured["skinny_matmul"] = _tune_skinny(
        cfg, dtype, skinny_shapes(cfg, quant, dense_layers)
    )
    lap("skinny_matmul")
    if dtype in (torch.bfloat16, torch.float16):  # the kernels' dtypes on a GPU
        kernels["weight_only"], measured["weight_only"] = _tune_weight_only(cfg, quant)
        lap("weight_only")
        kernels["fp8_skinny"], measured["fp8_skinny"] = _tune_fp8_skinny(cfg, quant)
        lap("fp8_skinny")
    measured["phase_s"] = phases
    set_tuning(None)
    return {
        "tuned": True,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "kernels": kernels,
        "cuda_graph_batch_sizes": sizes,
        "measured": measured,
        "wall_time_s": round(time.perf_counter() - t0, 2),
    }


def write_tuning(root: Path, tuning: dict[str, Any]) -> None:
    (root / TUNING).write_text(json.dumps(tuning, indent=1) + "\n")


def read_tuning(root: Path) -> dict[str, Any] | None:
    p = root / TUNING
    return json.loads(p.read_text()) if p.is_file() else None
