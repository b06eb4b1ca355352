"""Reuse of kernel tuning across builds (TensorRT-LLM's timing cache, for kiln's tuner).

A GPU build spends most of its time timing kernel candidates (an int4-awq build with an
int4 head on the H200: 203.7 of 209.8 s). The tuner's result depends only on the model's
shapes, the dtype, the engine's limits, the quantization fields the tuner reads, the GPU
and the software that runs the kernels, so a build whose inputs all match an earlier
build's reuses that tuning instead of timing again. The key holds each of these, kiln's
version, the ``KILN_*`` switches of kernel paths (``KILN_PDL``, ``KILN_FP8_SKINNY``, ...),
and a hash of the source of the kernels and of the tuner itself: any change to a
kernel, a candidate list or a tuning case makes a new key. Entries live in
``$KILN_CACHE_DIR/tuning/<key>.json`` (default ``~/.cache/kiln``); ``kiln build
--no-tuning-cache`` (``BuildConfig.reuse_tuning=False``) or ``KILN_TUNING_CACHE=0`` times
every kernel again and refreshes the entry."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

import kiln
from kiln.build.target import describe_target
from kiln.build.tuning import tune
from kiln.config import ModelConfig, QuantConfig
from kiln.errors import env_flag

TUNING_CACHE_ENV = "KILN_TUNING_CACHE"
QUANT_FIELDS = (
    "algo",
    "kv_cache_dtype",
    "group_size",
    "quantize_lm_head",
    "activation_scheme",
    "act_outliers",
)
"""The QuantConfig fields ``kiln.build.tuning`` reads (a test checks the tuner's source)."""
TARGET_FIELDS = ("gpu_name", "compute_capability", "torch", "triton", "cuda")
# KILN_* variables that do not change what the kernels do (the others, such as KILN_PDL or
# KILN_FP8_SKINNY, switch kernel paths the tuner times, so they join the key)
# (KILN_COMPILE_WORKERS: how many threads compile the variants, not which)
_ENV_NOT_IN_KEY = {
    "KILN_CACHE_DIR",
    "KILN_TUNING_CACHE",
    "KILN_API_KEY",
    "KILN_COMMIT",
    "KILN_COMPILE_WORKERS",
    "KILN_COMPILE_PROCESSES",  # how the variants compile, not what is measured
    "KILN_SIDE_COPIES",  # where the sampler's transfers run: outside the tuned kernels
    "KILN_GC_FREEZE",  # Python's garbage collector
    "KILN_LOAD_DRY_RUN",  # when a load compiles its variants, not which
    "KILN_TOP_P_KERNEL",  # the sampler's threshold path: no tuned kernel
    "KILN_FAULT_INJECT",  # kiln serve's test hook
}
# under kiln/: the kernels and what tuning runs and reads (timing helpers, weight formats,
# the graph batch sizes it records)
_SOURCES = (
    "kernels",
    "build/tuning.py",
    "build/tuning_cases.py",
    "bench",
    "quant",
    "runtime/cuda_graphs.py",
)


@functools.cache
def source_hash() -> str:
    """sha256 of the kernels', the tuner's and the timing helpers' source files."""
    root = Path(kiln.__file__).parent
    h = hashlib.sha256()
    for rel in _SOURCES:
        p = root / rel
        for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def tuning_key(cfg: ModelConfig, dtype: torch.dtype, limits: dict[str, int],
               quant: QuantConfig | None, target: dict[str, Any],
               dense_layers: bool = True) -> str:  # fmt: skip
    """The cache key of a build's tuning (hex)."""
    fields = {
        "model": cfg.to_dict(),
        "dtype": str(dtype),
        "limits": limits,
        "quant": {f: getattr(quant, f) for f in QUANT_FIELDS} if quant is not None else None,
        "dense_layers": dense_layers,
        "target": {k: target.get(k) for k in TARGET_FIELDS},
        "kiln": kiln.__version__,
        "sources": source_hash(),
        "env": {
            k: v
            for k, v in sorted(os.environ.items())
            if k.startswith("KILN_") and k not in _ENV_NOT_IN_KEY
        },
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def _read(path: Path) -> dict[str, Any] | None:
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) and got.get("tuned") is True else None


def cached_tune(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: str,
    limits: dict[str, int],
    quant: QuantConfig | None = None,
    reuse: bool = True,
    dense_layers: bool = True,
) -> dict[str, Any]:
    """``tune``'s result for a build, taken from the cache when an earlier build with the same
    key measured it (``reused`` then names the entry), else measured now and stored. CPU
    builds time nothing and are not cached."""
    from kiln.build.cache import cache_root  # kiln.build.cache imports the builder

    # read first, so that a bad value is refused on every build (0 or 1)
    reuse = env_flag(os.environ, TUNING_CACHE_ENV, True) and reuse
    if device != "cuda":
        return tune(cfg, dtype, device, limits, quant=quant, dense_layers=dense_layers)
    key = tuning_key(cfg, dtype, limits, quant, describe_target(device), dense_layers)
    path = cache_root() / "tuning" / f"{key}.json"
    if reuse and (hit := _read(path)) is not None:
        return hit | {"reused": {"key": key, "path": str(path)}}
    tuning = tune(cfg, dtype, device, limits, quant=quant, dense_layers=dense_layers)
    tuning |= {"cache_key": key}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(tuning, indent=1) + "\n")
        tmp.replace(path)  # atomic: a concurrent build reads the old entry or the new one
    except OSError:  # a read-only cache directory costs the reuse, not the build
        pass
    return tuning
