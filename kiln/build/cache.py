"""Implicit builds: a checkpoint passed where an engine is expected is built once into a
cache directory keyed by (checkpoint identity, build options, target) and reused after.

The cache lives in ``$KILN_CACHE_DIR`` or ``~/.cache/kiln``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path

import kiln
from kiln.build.builder import build_engine
from kiln.build.engine_dir import FORMAT_VERSION, MANIFEST
from kiln.build.target import describe_target, resolve_device
from kiln.checkpoint import source_identity
from kiln.config import BuildConfig


def cache_root() -> Path:
    return Path(os.environ.get("KILN_CACHE_DIR") or "~/.cache/kiln").expanduser()


BUILT_HERE: set[Path] = set()
"""Engines this process built (their builds' tuning compiled kernels in this process:
``kiln.runtime.kernel_record.forget_compiled``)."""


def cached_engine(source: str, cfg: BuildConfig, seed: int = 0, progress: bool = True) -> Path:
    """The engine directory for ``source`` built with ``cfg``; built now if not cached."""
    canonical, fingerprint = source_identity(source)
    device = resolve_device(cfg.device)
    target = describe_target(device)
    key_fields = {
        "checkpoint": fingerprint,
        "source": canonical,
        "build": dataclasses.asdict(dataclasses.replace(cfg, device=device)),
        "seed": seed,
        "target": {k: target[k] for k in ("device", "gpu_name", "compute_capability", "torch")},
        "format": FORMAT_VERSION,
        "kiln": kiln.__version__,
    }
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(canonical.removeprefix("dummy:")).name)[:48]
    path = cache_root() / "engines" / f"{slug}-{key}"
    if not (path / MANIFEST).is_file():
        build_engine(source, path, dataclasses.replace(cfg, device=device), seed, progress)
        BUILT_HERE.add(path)
    return path
