"""The start-up heap frozen out of the garbage collector's scans (kiln.runtime.heap): by
``kiln serve`` once its engine is loaded, by ``kiln bench`` for each measurement."""

from __future__ import annotations

import gc
import json
import logging
from pathlib import Path

import pytest

from kiln.errors import ConfigError
from kiln.runtime import heap
from kiln.serve import server
from kiln.serve.config import ServeConfig


def test_frozen_freezes_for_the_block_then_thaws() -> None:
    assert gc.get_freeze_count() == 0
    junk: list[object] = [[]]
    junk[0].append(junk)  # type: ignore[attr-defined]  # a cycle that collect() frees
    del junk
    with heap.frozen() as n:
        assert n > 1000 and gc.get_freeze_count() > 1000
        assert gc.collect() == 0  # nothing left to collect outside the frozen heap
    assert gc.get_freeze_count() == 0


def test_frozen_leaves_an_earlier_freeze_alone() -> None:
    try:
        outer = heap.freeze()
        with heap.frozen() as n:
            assert n > 1000 and outer > 1000
        assert gc.get_freeze_count() > 1000  # still frozen for its owner
    finally:
        gc.unfreeze()


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(heap.ENV, "0")
    assert heap.freeze() == 0 and gc.get_freeze_count() == 0
    with heap.frozen() as n:
        assert n == 0 and gc.get_freeze_count() == 0
    monkeypatch.setenv(heap.ENV, "yes")
    with pytest.raises(ConfigError, match="KILN_GC_FREEZE"):
        heap.freeze()
    assert gc.get_freeze_count() == 0


def test_serve_freezes_once_the_engine_is_loaded(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    engine = object()
    seen: list[int] = []

    def load(config: ServeConfig) -> object:
        seen.append(gc.get_freeze_count())  # not yet frozen while loading
        return engine

    monkeypatch.setattr(server, "load_llm", load)
    try:
        with caplog.at_level(logging.INFO, logger="kiln.serve"):
            assert server.load_frozen(ServeConfig()) is engine
        assert seen == [0] and gc.get_freeze_count() > 1000
        assert "objects frozen out of the garbage collector's scans" in caplog.text
    finally:
        gc.unfreeze()


def test_bench_measures_on_a_frozen_heap_and_thaws_it(tmp_path: Path) -> None:
    from kiln.cli import main

    out = tmp_path / "t.json"
    argv = ["bench", "throughput", "--model", "dummy:tiny", "--num-requests", "3", "--isl", "5",
            "--osl", "4", "--no-progress", "--report-json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(out.read_text())["settings"]["gc_frozen_objects"] > 1000
    assert gc.get_freeze_count() == 0
