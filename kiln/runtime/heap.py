"""Python's garbage collector kept off the start-up heap of a process that serves one engine.

After a load the heap holds a few hundred thousand long-lived objects (modules, the model's
modules and parameters, the tokenizer), and every full collection walks them all. A step's
own objects (outputs, logprob dicts) set one off every few steps when they are many: on
this project's 2-core CPU, 256 rows of 20 logprobs on ``dummy:tiny`` took 15.6 ms a step,
12.2 with the start-up heap frozen (``gc.freeze``: a generation the collector never scans,
as vLLM's engine core process does after its start-up; benchmarks/results/
2026-12-07-cpu-gc-freeze-cost-8d57c7e.json, scripts/experiments/gc_freeze_cost.py).

A frozen object that later becomes cyclic garbage is never collected, so ``LLM()`` itself
does not freeze: a program may load and drop several engines. ``kiln serve`` freezes once
its engine is loaded, and ``kiln bench`` for each measurement (``frozen``, which thaws the
heap again). ``KILN_GC_FREEZE=0`` turns both off."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager

from kiln.errors import env_flag

ENV = "KILN_GC_FREEZE"


def freeze() -> int:
    """Collect, then freeze every object left; returns how many are frozen (0 when
    ``KILN_GC_FREEZE=0``; a value other than 0 or 1 is a ``ConfigError`` naming it)."""
    if not env_flag(os.environ, ENV, True):
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextmanager
def frozen() -> Iterator[int]:
    """``freeze()`` for the block (it yields the count); the heap is thawed after it, unless
    something had frozen it before the block (then it stays as that owner wants it)."""
    owned = gc.get_freeze_count() == 0
    n = freeze()
    try:
        yield n
    finally:
        if n and owned:
            gc.unfreeze()
