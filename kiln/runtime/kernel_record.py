"""The Triton variants an engine's load compiled, kept beside the engine so that a later
load on a machine with a cold Triton cache compiles them all at once, in threads, before
the warm-up needs them (Triton's compiler releases the GIL for most of its work).

A load records each variant it compiles during the kernel warm-up and the CUDA graph
capture (Triton's ``jit_cache_hook``: the kernel's module and name, its source key and
Triton's own serialized specialization) and writes them to
``kernel_variants/triton-<version>-sm<cc>.json`` in the engine directory, or, where that
directory is not writable (a read-only mount, another user's engine), under
``$KILN_CACHE_DIR/kernel_variants/<engine key>/`` (``fallback_path``). The next load reads
the engine's file and the cache's, and hands every entry to
``JITFunction.preload`` under Triton's ``AsyncCompileMode`` with a thread pool; the
compiled variants land in the kernels' in-memory caches (and Triton's disk cache), so the
warm-up that follows finds them. An entry is skipped, not trusted, when its module is not
one of kiln's, its name is not a Triton kernel there, or the kernel's source changed since
it was recorded; a variant that fails to compile is left to compile when first launched.
Nothing here runs code from the file: it names kiln's own kernels and their arguments.

The build's tuner uses the same machinery without a file (``precompile``): a dry run of
its candidates with every new variant recorded and its compile and launch skipped, then
the threaded preload of what was recorded. On machines of 8 CPUs or more, worker
processes first compile the variants into Triton's disk cache, where the threads then
find them (``kiln.runtime.compile_procs``: the compiler holds the GIL for part of its
work)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kiln.errors import env_int

RECORD_DIR = "kernel_variants"
log = logging.getLogger("kiln.kernel_record")


def compile_workers(env: Mapping[str, str] | None = None) -> int:
    """Threads that compile recorded variants (``KILN_COMPILE_WORKERS``, 0 turns the
    preload off; default: the CPUs this process may use, at most 32)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    env = os.environ if env is None else env
    return env_int(env, "KILN_COMPILE_WORKERS", min(32, cpus), range(0, 257))


def record_path(engine_dir: Path, triton_version: str, capability: tuple[int, int]) -> Path:
    major, minor = capability
    return engine_dir / RECORD_DIR / f"triton-{triton_version}-sm{major}{minor}.json"


def fallback_path(
    engine_dir: Path, triton_version: str, capability: tuple[int, int], cache: Path
) -> Path:
    """Where the record goes when the engine directory is not writable: under ``cache``,
    keyed by the engine's resolved path and its manifest's bytes (a rebuilt engine at the
    same path starts a new record)."""
    from kiln.build.engine_dir import MANIFEST

    h = hashlib.sha256(str(engine_dir.resolve()).encode())
    with contextlib.suppress(OSError):  # the load checked the manifest; else the path alone
        h.update((engine_dir / MANIFEST).read_bytes())
    return record_path(cache / RECORD_DIR / h.hexdigest()[:24], triton_version, capability)


def resolve(entry: dict[str, Any]) -> Any:
    """The kernel an entry names, or why it is skipped."""
    module, name, key = entry.get("module"), entry.get("name"), entry.get("source_key")
    if not isinstance(module, str) or not (module == "kiln" or module.startswith("kiln.")):
        return "not a kiln module"
    if not isinstance(name, str) or not name.isidentifier():
        return "not a module-level name"
    if not isinstance(entry.get("spec"), str):
        return "no specialization"
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return "no such kernel"
    if not callable(getattr(fn, "preload", None)) or not hasattr(fn, "cache_key"):
        return "not a Triton kernel"
    if fn.cache_key != key:
        return "changed since it was recorded"
    return fn


def forget_compiled() -> int:
    """Empty the in-memory variant caches of kiln's Triton kernels (Triton's disk cache
    stays): how many kernels. A load records only the variants its hook sees compiled, so
    after an implicit build in the same process, whose tuning compiled the variants the
    load then uses, they would be missing from the record and a later load on a cold
    Triton cache would compile them again (seen on an H200, 2026-12-03: 4 of them). With
    the caches emptied the load reads them back from Triton's disk cache, and the hook
    fires for each. The CUDA modules already loaded stay loaded."""
    seen: set[int] = set()
    for name, module in list(sys.modules.items()):
        if not (name == "kiln" or name.startswith("kiln.")) or module is None:
            continue
        for v in list(vars(module).values()):
            caches = getattr(v, "device_caches", None)
            if id(v) in seen or not hasattr(v, "cache_key") or not hasattr(caches, "clear"):
                continue
            seen.add(id(v))
            caches.clear()
    return len(seen)


class KernelRecord:
    """The variant record of one engine for the running Triton and GPU."""

    def __init__(self, path: Path | None, fallback: Path | None = None) -> None:
        """``path`` None: a record in memory only (``precompile``'s), never read or saved.
        ``fallback``: read too, and written where ``path`` cannot be."""
        self.path = path
        self.fallback = fallback
        self.entries: dict[str, dict[str, Any]] = {}  # by Triton's specialization
        self.new = 0
        self.problem: str | None = None
        for p in (path, fallback):
            if p is not None:
                self._read(p)

    def _read(self, path: Path) -> None:
        entries: dict[str, dict[str, Any]] = {}
        try:
            data = json.loads(path.read_text())
            for e in data["variants"]:
                entries[e["spec"]] = e
        except (FileNotFoundError, NotADirectoryError):
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.problem = f"unreadable record {path.name}: {exc}"
            return
        self.entries |= entries

    @classmethod
    def for_engine(cls, engine_dir: Path, device: Any, cache: Path | None = None) -> KernelRecord:
        """The record of ``engine_dir`` for ``device``'s GPU; with ``cache``, its fallback
        there (``fallback_path``)."""
        import torch
        import triton

        cap = torch.cuda.get_device_capability(device)
        v = triton.__version__
        fallback = None if cache is None else fallback_path(Path(engine_dir), v, cap, cache)
        return cls(record_path(Path(engine_dir), v, cap), fallback)

    def preload(self, workers: int, processes: int | None = None) -> dict[str, Any]:
        """Compile every usable entry in ``workers`` threads, after ``processes`` worker
        processes (``kiln.runtime.compile_procs``; by default ``compile_processes``) have
        compiled them into Triton's disk cache; figures of what happened (``disk_hits``:
        variants the threads found on disk)."""
        from kiln.runtime import compile_procs

        out: dict[str, Any] = {"recorded": len(self.entries), "workers": workers}
        if self.problem:
            out["problem"] = self.problem
        if workers <= 0 or not self.entries:
            return out | {"compiled": 0, "seconds": 0.0}
        try:
            from triton import knobs
            from triton.runtime._async_compile import AsyncCompileMode  # noqa: F401
        except ImportError:  # pragma: no cover - triton is pinned to a release that has it
            return out | {"compiled": 0, "seconds": 0.0, "problem": "no AsyncCompileMode"}

        start = time.perf_counter()
        skipped: dict[str, int] = {}
        kernels = []  # (entry, kernel) of every usable entry, each resolved once
        for e in self.entries.values():
            fn = resolve(e)
            if isinstance(fn, str):
                skipped[fn] = skipped.get(fn, 0) + 1
            else:
                kernels.append((e, fn))
        usable = [e for e, _ in kernels]
        if processes is None and not compile_procs.compile_processes(len(usable)):
            processes = 0  # too few variants or CPUs: no lookup either
        if processes is None or processes > 0:  # only what Triton's cache lacks
            missing = compile_procs.not_on_disk(usable)
            if processes is None:
                processes = compile_procs.compile_processes(len(missing))
            if processes > 0:
                out["in_processes"] = compile_procs.compile_in_processes(missing, processes)
            out["missing_on_disk"] = len(missing)
        hits: list[bool] = []
        prev = knobs.compilation.listener

        def listen(**kw: Any) -> None:
            hits.append(bool(kw.get("cache_hit")))
            if prev:
                prev(**kw)

        knobs.compilation.listener = listen
        try:
            futures = _submit(workers, kernels)
        finally:
            knobs.compilation.listener = prev
        compiled = sum(1 for f in futures if getattr(f, "kernel", None) is not None)
        return out | {
            "compiled": compiled,
            "failed": len(futures) - compiled,
            "disk_hits": sum(hits),
            "skipped": dict(sorted(skipped.items())),
            "seconds": round(time.perf_counter() - start, 3),
        }

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Add every kiln kernel variant compiled inside the block to the record (chained
        onto hooks already installed, which keep being called)."""
        from triton import knobs

        rt = knobs.runtime
        prev = rt.jit_cache_hook

        def hook(*args: Any, **kw: Any) -> Any:
            self.add(kw)
            return prev(*args, **kw) if prev else None

        rt.jit_cache_hook = hook
        try:
            yield
        finally:
            rt.jit_cache_hook = prev

    @contextmanager
    def deferring(self) -> Iterator[None]:
        """Inside the block a kiln variant not compiled yet is only recorded: the hook's
        true answer makes Triton skip its compile and its launch (the call returns
        without running anything), so that ``preload`` can compile them all at once in
        threads afterwards. Compiled variants launch as usual; a hook already installed
        is still called."""
        from triton import knobs

        rt = knobs.runtime
        prev = rt.jit_cache_hook

        def hook(*args: Any, **kw: Any) -> bool:
            self.add(kw)
            if prev:
                prev(*args, **kw)
            return (kw.get("compile") or {}).get("specialization_data") in self.entries

        rt.jit_cache_hook = hook
        try:
            yield
        finally:
            rt.jit_cache_hook = prev

    def add(self, hook_kw: dict[str, Any]) -> None:
        """One ``jit_cache_hook`` call: its kernel (``fn``: module, name, jit_function) and
        Triton's serialized specialization (``compile["specialization_data"]``)."""
        fn, compile_ = hook_kw.get("fn"), hook_kw.get("compile") or {}
        spec = compile_.get("specialization_data")
        module = getattr(fn, "module", None)
        if not isinstance(spec, str) or not isinstance(module, str):
            return
        if not (module == "kiln" or module.startswith("kiln.")) or spec in self.entries:
            return
        jit = getattr(fn, "jit_function", None)
        name, key = getattr(fn, "name", None), getattr(jit, "cache_key", None)
        self.entries[spec] = {"module": module, "name": name, "source_key": key, "spec": spec}
        self.new += 1

    def save(self) -> str:
        """Write the record when it gained entries (to ``path``, else to ``fallback``):
        where, or why not."""
        if not self.new:
            return "unchanged"
        if self.path is None:
            return "not written (in memory)"
        why = self._write(self.path, parents=False)
        if why and self.fallback is not None:
            if not (why2 := self._write(self.fallback, parents=True)):
                self.new = 0
                return f"{self.fallback} (the engine directory's: {why})"
            why = f"{why}; nor {self.fallback}: {why2}"
        if why:
            return f"not written ({why})"
        self.new = 0
        return str(self.path)

    def _write(self, path: Path, parents: bool) -> str | None:
        """Write every entry to ``path`` atomically: None, or why not."""
        try:
            path.parent.mkdir(parents=parents, exist_ok=True)
            text = json.dumps({"variants": list(self.entries.values())}, indent=0)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                os.chmod(tmp, 0o644)
                os.replace(tmp, path)  # readers see the old record or the new one
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except OSError as exc:
            return str(exc.strerror or exc)
        return None


def precompile(work: Callable[[], Any], workers: int | None = None) -> dict[str, Any]:
    """Run ``work`` once with kiln's new Triton variants deferred (``deferring``: recorded,
    neither compiled nor launched), then compile them all in ``workers`` threads
    (``compile_workers()`` by default): ``preload``'s figures. For a tuner, whose
    candidates would otherwise compile one by one: ``work`` calls them as the timing will,
    and must not depend on the skipped kernels' results (a candidate whose check then
    fails is an error the tuner records and moves past; any exception is logged and
    dropped here). Figures only, never an error: a variant not compiled here compiles at
    its first launch, as without this."""
    rec = KernelRecord(None)
    start = time.perf_counter()
    with rec.deferring():
        try:
            work()
        except Exception as exc:
            log.debug("precompile's dry run stopped: %s", exc)
    dry = round(time.perf_counter() - start, 3)
    return rec.preload(compile_workers() if workers is None else workers) | {"dry_run_s": dry}


def _submit(workers: int, kernels: list[tuple[dict[str, Any], Any]]) -> list[Any]:
    """Each (entry, kernel) compiled in ``workers`` threads: the futures (None where the
    preload raised; failed ones are counted by their missing kernel)."""
    from triton.runtime._async_compile import AsyncCompileMode

    futures = []
    with ThreadPoolExecutor(workers) as pool, AsyncCompileMode(pool, ignore_errors=True):
        for e, fn in kernels:
            try:
                futures.append(fn.preload(e["spec"]))
            except Exception as exc:  # a stale entry: the variant compiles at launch
                futures.append(None)
                log.debug("preload of %s.%s failed: %s", e["module"], e["name"], exc)
    return futures
