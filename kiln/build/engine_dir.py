"""The engine directory: manifest.json, rank{i}.safetensors, tokenizer/ (see
docs/architecture.md). Reading checks every promise of the manifest before any weight is
read, and fails with one sentence naming the mismatch and the command that fixes it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from kiln.build.target import DTYPE_BY_NAME, dtype_supported
from kiln.config import SUPPORTED_ARCHITECTURES
from kiln.errors import EngineLoadError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_entries(root: Path) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file under ``root`` except the manifest."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            out[p.relative_to(root).as_posix()] = {
                "sha256": sha256_file(p),
                "size": p.stat().st_size,
            }
    return out


def write_manifest(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Write ``manifest`` with the checksums of every file now under ``root``; return it."""
    manifest = {**manifest, "files": file_entries(root)}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def rebuild_hint(manifest: dict[str, Any], extra: str = "") -> str:
    src = manifest.get("source", {}).get("model", "SRC")
    return f"`kiln build --model {src}{extra} --output DIR`"


def read_manifest(root: Path) -> dict[str, Any]:
    if not root.exists():
        raise EngineLoadError(
            f"engine path {str(root)!r} does not exist; build one with "
            f"`kiln build --model SRC --output {root}`."
        )
    path = root / MANIFEST
    if not path.is_file():
        raise EngineLoadError(
            f"{str(root)!r} is not an engine directory (no {MANIFEST}); build one with "
            f"`kiln build --model SRC --output {root}`."
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise EngineLoadError(
            f"{path} is not valid JSON ({e}); rebuild the engine with "
            f"`kiln build --model SRC --output {root}`."
        ) from e
    version = manifest.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise EngineLoadError(
            f"{path} has no valid format_version ({version!r}); it was not written by kiln "
            f"build or is damaged; rebuild it with {rebuild_hint(manifest)}."
        )
    if version > FORMAT_VERSION:
        raise EngineLoadError(
            f"engine format version {version} is newer than this kiln reads "
            f"({FORMAT_VERSION}); upgrade with `pip install -U kiln-llm` or rebuild the engine "
            f"with this kiln: {rebuild_hint(manifest)}."
        )
    arch = manifest.get("model", {}).get("architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise EngineLoadError(
            f"engine architecture {arch!r} is not supported; kiln runs "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}."
        )
    return manifest


def check_target(manifest: dict[str, Any], here: dict[str, Any], world_size: int = 1) -> None:
    """Raise if the engine cannot run on the device described by ``here``."""
    built = manifest["target"]
    if built["device"] != here["device"]:
        what = built["gpu_name"] or built["device"]
        raise EngineLoadError(
            f"engine was built for {built['device']} ({what}) but is being loaded on "
            f"{here['device']}; rebuild it for this machine with "
            f"{rebuild_hint(manifest, ' --device ' + here['device'])}."
        )
    if built["device"] == "cuda" and built["compute_capability"] != here["compute_capability"]:
        raise EngineLoadError(
            f"engine was built for compute capability {built['compute_capability']} "
            f"({built['gpu_name']}) but this GPU ({here['gpu_name']}) has "
            f"{here['compute_capability']}; rebuild it on this GPU with {rebuild_hint(manifest)}."
        )
    tp, pp = manifest["mapping"]["tp"], manifest["mapping"]["pp"]
    if tp * pp != world_size:
        raise EngineLoadError(
            f"engine was built for tp={tp} x pp={pp} = {tp * pp} GPU process(es) but the world "
            f"size is {world_size}; launch {tp * pp} processes or rebuild it for "
            f"{world_size}: {rebuild_hint(manifest, _split_for(world_size))}."
        )
    if manifest.get("dtype") not in DTYPE_BY_NAME:
        raise EngineLoadError(
            f"engine dtype {manifest.get('dtype')!r} is unknown to this kiln (it runs "
            f"{', '.join(DTYPE_BY_NAME)}); rebuild with {rebuild_hint(manifest)}."
        )
    reason = dtype_supported(manifest["dtype"], here)
    if reason:
        raise EngineLoadError(
            f"engine precision {manifest['dtype']} cannot run here: {reason}; rebuild with "
            f"{rebuild_hint(manifest, ' --dtype float16')}."
        )


def _split_for(world_size: int) -> str:
    return f" --tp {world_size} --pp 1"


def verify_files(root: Path, manifest: dict[str, Any], stamp_dir: Path | None) -> None:
    """Check that every file of the manifest exists with its size and sha256.

    Hashing 16 GB takes seconds, so a successful check leaves a stamp (size, mtime, sha256)
    under ``stamp_dir``; later loads rehash only files whose size or mtime changed."""
    stamp_path = None
    stamps: dict[str, Any] = {}
    if stamp_dir is not None:
        key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:24]
        stamp_path = stamp_dir / f"{key}.json"
        if stamp_path.is_file():
            try:
                stamps = json.loads(stamp_path.read_text())
            except json.JSONDecodeError:
                stamps = {}
    new_stamps = {}
    for rel, want in manifest.get("files", {}).items():
        p = root / rel
        if not p.is_file():
            raise EngineLoadError(
                f"engine file {rel} is missing from {root}; rebuild the engine with "
                f"{rebuild_hint(manifest)}."
            )
        st = p.stat()
        if st.st_size != want["size"]:
            raise EngineLoadError(
                f"engine file {rel} has {st.st_size} bytes but the manifest says {want['size']} "
                f"(truncated or replaced); rebuild the engine with {rebuild_hint(manifest)}."
            )
        stamp = [st.st_size, st.st_mtime_ns, want["sha256"]]
        if stamps.get(rel) != stamp and sha256_file(p) != want["sha256"]:
            raise EngineLoadError(
                f"engine file {rel} does not match its sha256 in the manifest (altered or "
                f"corrupted); rebuild the engine with {rebuild_hint(manifest)}."
            )
        new_stamps[rel] = stamp
    if stamp_path is not None and new_stamps != stamps:
        stamp_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(new_stamps))
        tmp.replace(stamp_path)
