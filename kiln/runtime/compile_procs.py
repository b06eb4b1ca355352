"""Compiling recorded Triton variants in worker processes before the threaded preload
(``kiln.runtime.kernel_record``) reads them back from Triton's disk cache.

Why: Triton's compiler holds the GIL for part of its work. On this project's 2-core CPU
machine the frontend (``make_ir``) alone was 22-33 % of a float16-code int4 kernel's
compile for sm_90 (0.40-0.61 s a variant, 2026-12-06), so threads stop scaling at a few
times one thread's rate, whatever the core count; an H100's int4h build compiled its 239
variants in 44.6 s on 16 threads. Processes have a GIL each.

How: the variants are shared out round-robin among worker processes (``python -m
kiln.runtime.compile_procs``, a fresh interpreter each: no CUDA context is inherited, and
none is made, since the target is given; nothing of the caller's is imported). Each
imports the kernels its entries name (``kernel_record.resolve``: kiln's own kernels only,
their source unchanged), rebuilds each variant from Triton's serialized specialization as
``JITFunction.preload`` does, and compiles it for the parent's target into the parent's
Triton cache directory. The parent's threaded preload then finds each variant on disk (a
cache hit loads the binary). Everything here is best effort: a variant a process does not
compile is compiled by the threads, as without this.

``KILN_COMPILE_PROCESSES``: how many processes (0: none, threads only). Default: where at
least 128 variants are missing from the cache and this process may use at least 8 CPUs,
one a CPU up to 32 and at most one per 8 variants; else 0. Measured on an H100 machine
(16 CPUs, 2026-12-06, int4h build of dummy Llama-3.1-8B on empty caches): the weight-only
phase's 239 variants compiled in 15.1 s against 48.2 in 16 threads, but 64 skinny-matmul
variants took 6.1 s against 2.7 and 48 attention variants 8.2 against 5.8: starting a
process (importing torch, Triton and kiln) costs seconds, which only many variants repay."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.errors import env_int

log = logging.getLogger("kiln.compile_procs")
MIN_CPUS = 8
MIN_VARIANTS = 128
MIN_PER_PROCESS = 8


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def compile_processes(variants: int, env: Mapping[str, str] | None = None) -> int:
    """Processes to compile ``variants`` in (module docstring); 0 for threads only."""
    env = os.environ if env is None else env
    cpus = _cpus()
    default = 0
    if cpus >= MIN_CPUS and variants >= MIN_VARIANTS:
        default = min(32, cpus, variants // MIN_PER_PROCESS)
    n = env_int(env, "KILN_COMPILE_PROCESSES", default, range(0, 257))
    return max(0, min(n, variants))


def current_target() -> tuple[str, Any, int]:
    """The active Triton driver's target as (backend, arch, warp size)."""
    from triton.runtime.driver import driver

    t = driver.active.get_current_target()
    return (t.backend, t.arch, t.warp_size)


def _rebuild(fn: Any, spec: str, backend: Any) -> tuple[Any, dict[str, Any]]:
    """A variant's source and options from Triton's serialized specialization, as
    ``JITFunction.preload`` rebuilds them (triton 3.6)."""
    import triton.language as tl

    d = json.loads(spec)
    if d["name"] != fn._fn_name:
        raise ValueError(f"specialization of {d['name']}, not {fn._fn_name}")
    constexprs = {
        tuple(k): tl.dtype(v) if tl.dtype.is_dtype(v)
        else tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v
        for k, v in zip(d["constant_keys"], d["constant_vals"], strict=True)
    }  # fmt: skip
    attrs = {tuple(k): v for k, v in zip(d["attrs_keys"], d["attrs_vals"], strict=True)}
    signature = {k: tuple(v) if isinstance(v, list) else v for k, v in d["signature"].items()}
    opts = {k: tuple(v) if isinstance(v, list) else v for k, v in d["options"].items()}
    options = backend.parse_options(opts)
    if fn.is_gluon():  # the source class a launch sets up only with a driver
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        from triton.compiler import ASTSource as Source
    return Source(fn, signature, constexprs, attrs), options.__dict__


def not_on_disk(entries: list[dict[str, Any]],
                target: tuple[str, Any, int] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """The entries whose variant is not in Triton's cache directory yet for ``target`` (the
    active driver's by default), looked up as ``triton.compile`` does (the same key), so
    that a warm cache starts no process. An entry whose lookup fails counts as missing."""
    import hashlib

    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import get_cache_key, make_backend
    from triton.runtime.cache import get_cache_manager

    from kiln.runtime.kernel_record import resolve

    try:
        backend = make_backend(GPUTarget(*(target or current_target())))
        env_vars = get_cache_invalidating_env_vars()
    except Exception:  # no target to look up against: every entry is missing
        return list(entries)
    missing = []
    for e in entries:
        try:
            fn = resolve(e)
            src, options = _rebuild(fn, e["spec"], backend)
            opts = backend.parse_options(dict(options, **src.parse_options()))
            key = get_cache_key(src, backend, opts, env_vars=env_vars)
            digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
            if get_cache_manager(digest).get_group(f"{src.name[:150]}.json") is None:
                missing.append(e)
        except Exception:
            missing.append(e)
    return missing


def _compile_batch(entries: list[dict[str, Any]], target: tuple[str, Any, int],
                   cache_dir: str) -> dict[str, Any]:  # fmt: skip
    """In a worker process: compile each entry for ``target`` into ``cache_dir``; counts,
    and the first failure's message."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    from kiln.runtime.kernel_record import resolve

    knobs.cache.dir = cache_dir
    gpu = GPUTarget(*target)
    backend = make_backend(gpu)
    done = failed = 0
    first = None
    for e in entries:
        fn = resolve(e)
        if isinstance(fn, str):
            continue  # the parent skips it too
        try:
            src, options = _rebuild(fn, e["spec"], backend)
            triton.compile(src, target=gpu, options=options)
            done += 1
        except Exception as exc:  # left to the parent's threads
            failed += 1
            first = first or f"{e.get('name')}: {type(exc).__name__}: {exc}"[:300]
    return {"compiled": done, "failed": failed, "first_error": first}


def compile_in_processes(entries: list[dict[str, Any]], processes: int,
                         target: tuple[str, Any, int] | None = None,
                         timeout: float = 900.0) -> dict[str, Any]:  # fmt: skip
    """Compile ``entries`` (``KernelRecord`` entries) in ``processes`` worker processes
    into Triton's cache directory for ``target`` (the active driver's by default): the
    figures. Each worker is ``python -m kiln.runtime.compile_procs BATCH.json``, a fresh
    interpreter that imports nothing of the caller's (``multiprocessing``'s spawn would
    run the caller's main script again, a user's unguarded ``LLM(...)`` included). Never
    raises: a failure leaves the variants to the threads."""
    from triton import knobs

    out: dict[str, Any] = {"processes": processes, "compiled": 0, "failed": 0}
    if processes <= 0 or not entries:
        return out | {"seconds": 0.0}
    start = time.perf_counter()
    procs: list[subprocess.Popen[str]] = []
    try:
        target = target or current_target()
        root = str(Path(__file__).resolve().parents[2])  # the directory kiln is imported from
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])]))  # fmt: skip
        env.pop("TRITON_INTERPRET", None)
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(processes):
                job = Path(tmp) / f"batch{i}.json"
                batch = {"entries": entries[i::processes], "target": list(target),
                         "cache_dir": knobs.cache.dir}  # fmt: skip
                job.write_text(json.dumps(batch))
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "kiln.runtime.compile_procs", str(job)], env=env,
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))  # fmt: skip
            deadline = start + timeout
            for p in procs:
                stdout, _ = p.communicate(timeout=max(1.0, deadline - time.perf_counter()))
                got = json.loads(stdout.strip().splitlines()[-1])
                out["compiled"] += got["compiled"]
                out["failed"] += got["failed"]
                if got["first_error"] and "first_error" not in out:
                    out["first_error"] = got["first_error"]
    except Exception as exc:  # a worker that died or hung: the threads compile the rest
        out["problem"] = f"{type(exc).__name__}: {exc}"[:300]
        log.debug("compiling in processes failed: %s", exc)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out | {"seconds": round(time.perf_counter() - start, 3)}


if __name__ == "__main__":  # a worker: python -m kiln.runtime.compile_procs BATCH.json
    job = json.loads(Path(sys.argv[1]).read_text())
    result = _compile_batch(job["entries"], tuple(job["target"]), job["cache_dir"])
    print(json.dumps(result))
