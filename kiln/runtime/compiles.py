"""Triton kernel variants first loaded while a benchmark measures: each is a compile (or a
read of Triton's on-disk cache) inside the timed window, which a steady-state figure should
not contain. ``count_compiles`` chains onto Triton's JIT hooks (``triton.knobs.runtime``):
the cache hook fires before a variant is compiled or read, the post-compile hook after, so
the time between them is what the variant cost the run."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class CompileLog:
    """Variants loaded in the window: their count, seconds, and count per kernel name."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self.by_kernel: dict[str, int] = {}
        self._started: dict[Any, float] = {}

    def started(self, key: Any) -> None:
        self._started[key] = time.perf_counter()

    def finished(self, key: Any, name: str) -> None:
        t0 = self._started.pop(key, None)
        self.count += 1
        if t0 is not None:
            self.seconds += time.perf_counter() - t0
        self.by_kernel[name] = self.by_kernel.get(name, 0) + 1

    def figures(self) -> dict[str, Any]:
        return {"count": self.count, "seconds": round(self.seconds, 3),
                "by_kernel": dict(sorted(self.by_kernel.items()))}  # fmt: skip


def _name(kw: dict[str, Any]) -> str:
    fn = kw.get("fn")  # triton's JitFunctionInfo (module, name, jit_function)
    return str(getattr(fn, "name", fn))


def _hook_key(kw: dict[str, Any]) -> Any:
    return (_name(kw), repr(kw.get("key")))


@contextmanager
def count_compiles() -> Iterator[CompileLog | None]:
    """Count the Triton variants first loaded inside the ``with`` block (None without
    Triton's hooks). Hooks already installed keep being called."""
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover - triton is a pinned dependency
        yield None
        return
    rt = knobs.runtime
    prev_cache, prev_post = rt.jit_cache_hook, rt.jit_post_compile_hook
    log = CompileLog()

    def cache_hook(*args: Any, **kw: Any) -> Any:
        log.started(_hook_key(kw))
        return prev_cache(*args, **kw) if prev_cache else None

    def post_hook(*args: Any, **kw: Any) -> Any:
        log.finished(_hook_key(kw), _name(kw))
        return prev_post(*args, **kw) if prev_post else None

    rt.jit_cache_hook, rt.jit_post_compile_hook = cache_hook, post_hook
    try:
        yield log
    finally:
        rt.jit_cache_hook, rt.jit_post_compile_hook = prev_cache, prev_post
