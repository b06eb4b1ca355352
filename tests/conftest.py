"""Shared fixtures. Every test session builds engines into its own cache directory, so
tests never read or write the user's ~/.cache/kiln."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on the CPU; it must be set before any
    # kernel is decorated (that is, before kiln is imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")


_OWN_CACHE: list[str] = []  # the cache directory this session made, removed at its end


def pytest_configure(config: pytest.Config) -> None:
    if "KILN_CACHE_DIR" not in os.environ or os.environ.get("KILN_TEST_SHARED_CACHE") != "1":
        import tempfile

        os.environ["KILN_CACHE_DIR"] = tempfile.mkdtemp(prefix="kiln-test-cache-")
        _OWN_CACHE.append(os.environ["KILN_CACHE_DIR"])


def pytest_unconfigure(config: pytest.Config) -> None:
    # built engines (SmolLM2 ones too) take about 1.6 GB a session: left behind, repeated
    # runs filled this machine's disk (2026-12-02)
    import shutil

    for path in _OWN_CACHE:
        shutil.rmtree(path, ignore_errors=True)
    _OWN_CACHE.clear()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from kiln.checkpoint import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_llm():
    """The embedded SmolLM2 engine, built once per test session (about 30 s on 2 cores)."""
    from kiln import LLM

    return LLM(progress=False)


@pytest.fixture(scope="session")
def serve_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve-logs")


@pytest.fixture(scope="session")
def served(smollm2_llm, serve_logs: Path):
    """One ``kiln serve`` of the embedded model for the protocol, hostile-input, load and
    schemathesis tests. ``smollm2_llm`` first puts the engine into the session's cache, so
    the server only loads it. A 96-token context keeps generated (fuzzed) requests short."""
    from tests.serve_util import Server

    args = ["--max-model-len", "96", "--max-n", "4", "--max-body-bytes", "65536"]
    args += ["--kv-cache-max-tokens", "8192", "--max-queued-requests", "256"]
    srv = Server(args, serve_logs, name="main").wait_ready()
    yield srv
    srv.stop()
