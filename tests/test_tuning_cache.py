"""Kernel tuning reused across builds (``kiln.build.tuning_cache``): the key follows every
input the tuner depends on and nothing else, a matching build reuses the entry, and
``--no-tuning-cache`` / ``KILN_TUNING_CACHE=0`` / a damaged entry time the kernels again.
The tuner itself is replaced by a counter here (on the CPU there is nothing to time)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import torch

import kiln
from kiln.build import tuning_cache as tc
from kiln.checkpoint.dummy import PRESETS
from kiln.cli import parser
from kiln.config import BuildConfig, ModelConfig, QuantConfig
from kiln.errors import ConfigError

TARGET = {"gpu_name": "NVIDIA H200", "compute_capability": "9.0", "torch": "2.11.0",
          "triton": "3.6.0", "cuda": "13.0", "device": "cuda"}  # fmt: skip
LIMITS = {"max_batch_size": 64, "max_seq_len": 4096, "max_num_tokens": 8192}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """KILN_CACHE_DIR in tmp_path, a fixed GPU, and ``tune`` counting its calls."""
    calls: list[dict] = []

    def fake_tune(cfg, dtype, device, limits, quant=None, dense_layers=True):
        calls.append({"limits": dict(limits)})
        return {"tuned": True, "gpu": "NVIDIA H200", "kernels": {"n": len(calls)}}

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(tc.TUNING_CACHE_ENV, raising=False)
    monkeypatch.setattr(tc, "tune", fake_tune)
    monkeypatch.setattr(tc, "describe_target", lambda device: dict(TARGET))
    return calls


def _cfg() -> ModelConfig:
    return ModelConfig(**PRESETS["tiny"])


def test_second_build_reuses_the_first_builds_tuning(cache: list, tmp_path: Path) -> None:
    q = QuantConfig(algo="fp8", kv_cache_dtype="fp8")
    first = tc.cached_tune(_cfg(), torch.bfloat16, "cuda", LIMITS, q)
    assert len(cache) == 1 and "reused" not in first
    entry = tmp_path / "tuning" / f"{first['cache_key']}.json"
    assert json.loads(entry.read_text())["kernels"] == {"n": 1}
    again = tc.cached_tune(_cfg(), torch.bfloat16, "cuda", LIMITS, q)
    assert len(cache) == 1  # not timed again
    assert again["kernels"] == {"n": 1} and again["reused"]["path"] == str(entry)
    # other limits: another key, timed
    other = tc.cached_tune(_cfg(), torch.bfloat16, "cuda", LIMITS | {"max_batch_size": 128}, q)
    assert len(cache) == 2 and other["cache_key"] != first["cache_key"]


def test_opting_out_and_damaged_entries(cache: list, monkeypatch: pytest.MonkeyPatch) -> None:
    first = tc.cached_tune(_cfg(), torch.bfloat16, "cuda", LIMITS)
    tc.cached_tune(_cfg(), torch.bfloat16, "cuda", LIMITS, reuse=False)
    assert len(cache) == 2
    monkeypatch.setenv(tc.TUNING_CACHE_ENV, "0")
    tc.cached_tune(_cfg(), torch.bfloat16, "cuda", LIMITS)
    assert len(cache) == 3
    for bad in ("no", "2"):  # 0 or 1, on CPU builds too, and with reuse off
        monkeypatch.setenv(tc.TUNING_CACHE_ENV, bad)
        for device, reuse in (("cuda", True), ("cuda", False), ("cpu", True)):
            with pytest.raises(ConfigError, match=rf"KILN_TUNING_CACHE='{bad}' is invalid"):
                tc.cached_tune(_cfg(), torch.bfloat16, device, LIMITS, reuse=reuse)
    assert len(cache) == 3
    monkeypatch.delenv(tc.TUNING_CACHE_ENV)
    got = tc.cached_tune(_cfg(), torch.bfloat16, "cuda", LIMITS)
    assert len(cache) == 3 and got["reused"]  # the refreshed entry (n == 3)
    assert got["kernels"] == {"n": 3}
    path = Path(got["reused"]["path"])
    path.write_text("{not json")
    tc.cached_tune(_cfg(), torch.bfloat16, "cuda", LIMITS)
    assert len(cache) == 4 and json.loads(path.read_text())["cache_key"] == first["cache_key"]


def test_cpu_builds_are_not_cached(cache: list, tmp_path: Path) -> None:
    tc.cached_tune(_cfg(), torch.float32, "cpu", LIMITS)
    tc.cached_tune(_cfg(), torch.float32, "cpu", LIMITS)
    assert len(cache) == 2 and not (tmp_path / "tuning").exists()


def test_key_follows_the_tuners_inputs_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in os.environ if k.startswith("KILN_")]:
        monkeypatch.delenv(k)
    cfg, q = _cfg(), QuantConfig(algo="int4-awq", group_size=128)
    base = tc.tuning_key(cfg, torch.bfloat16, LIMITS, q, TARGET)
    assert base == tc.tuning_key(cfg, torch.bfloat16, dict(LIMITS), q, dict(TARGET))
    # settings the tuner does not read: calibration and quality options, the target's device
    same = [
        dataclasses.replace(q, calib_tokens=q.calib_tokens * 2),
        dataclasses.replace(q, max_quality_loss=1.0),
    ]
    for other in same:
        assert tc.tuning_key(cfg, torch.bfloat16, LIMITS, other, TARGET) == base
    assert tc.tuning_key(cfg, torch.bfloat16, LIMITS, q, TARGET | {"device": "x"}) == base
    changed = [
        tc.tuning_key(cfg, torch.float16, LIMITS, q, TARGET),
        tc.tuning_key(
            dataclasses.replace(cfg, num_hidden_layers=cfg.num_hidden_layers + 1),
            torch.bfloat16,
            LIMITS,
            q,
            TARGET,
        ),
        tc.tuning_key(cfg, torch.bfloat16, LIMITS | {"max_seq_len": 2048}, q, TARGET),
        tc.tuning_key(cfg, torch.bfloat16, LIMITS, dataclasses.replace(q, group_size=64), TARGET),
        tc.tuning_key(cfg, torch.bfloat16, LIMITS, None, TARGET),
        tc.tuning_key(cfg, torch.bfloat16, LIMITS, q, TARGET | {"gpu_name": "NVIDIA H100"}),
        tc.tuning_key(cfg, torch.bfloat16, LIMITS, q, TARGET | {"triton": "3.7.0"}),
    ]
    assert len(set(changed)) == len(changed) and base not in changed
    # a switch of kernel paths changes the key; the cache's own settings do not
    monkeypatch.setenv("KILN_CACHE_DIR", "/elsewhere")
    monkeypatch.setenv(tc.TUNING_CACHE_ENV, "1")
    monkeypatch.setenv("KILN_COMPILE_WORKERS", "0")  # how many threads compile, not what
    monkeypatch.setenv("KILN_COMPILE_PROCESSES", "0")
    monkeypatch.setenv("KILN_SIDE_COPIES", "0")
    assert tc.tuning_key(cfg, torch.bfloat16, LIMITS, q, TARGET) == base
    # which dense shapes the skinny matmul is tuned for
    assert tc.tuning_key(cfg, torch.bfloat16, LIMITS, q, TARGET, dense_layers=False) != base
    monkeypatch.setenv("KILN_PDL", "0")
    assert tc.tuning_key(cfg, torch.bfloat16, LIMITS, q, TARGET) != base
    monkeypatch.delenv("KILN_PDL")
    monkeypatch.setattr(kiln, "__version__", "9.9.9")
    assert tc.tuning_key(cfg, torch.bfloat16, LIMITS, q, TARGET) != base
    monkeypatch.setattr(tc, "source_hash", lambda: "0" * 64)  # a kernel's source changed
    assert tc.tuning_key(cfg, torch.bfloat16, LIMITS, q, TARGET) != base


def test_key_holds_every_quant_field_the_tuner_reads() -> None:
    build = Path(kiln.__file__).parent / "build"
    src = (build / "tuning.py").read_text() + (build / "tuning_cases.py").read_text()
    read = set(re.findall(r"\bquant\.(\w+)", src))
    assert read and read <= set(tc.QUANT_FIELDS), read - set(tc.QUANT_FIELDS)


def test_skinny_shapes_are_the_projections_left_dense() -> None:
    """The skinny matmul is tuned for the shapes that stay in the engine's dtype: every
    layer projection and the head unquantized; with every layer quantized only the head,
    and nothing once the head is quantized too; a layer's four again where some layer may
    stay dense (``dense_layers``)."""
    from kiln.build.tuning_cases import projection_shapes, skinny_shapes

    cfg = ModelConfig(**PRESETS["tiny"])
    layers, head = projection_shapes(cfg), (cfg.vocab_size, cfg.hidden_size)
    assert len(layers) == 4
    assert skinny_shapes(cfg, None) == layers | {head}
    assert skinny_shapes(cfg, QuantConfig()) == layers | {head}
    q = QuantConfig(algo="int4-awq")
    assert skinny_shapes(cfg, q, dense_layers=False) == {head}
    assert skinny_shapes(cfg, q, dense_layers=True) == layers | {head}
    qh = QuantConfig(algo="int4-awq", quantize_lm_head=True)
    assert skinny_shapes(cfg, qh, dense_layers=False) == set()
    assert skinny_shapes(cfg, qh, dense_layers=True) == layers


def test_key_hashes_the_build_modules_the_tuner_imports() -> None:
    """A tuning case or candidate moved out of tuning.py still changes the key."""
    src = (Path(kiln.__file__).parent / "build" / "tuning.py").read_text()
    mods = set(re.findall(r"^from kiln\.build\.(\w+) import", src, re.M))
    assert "tuning_cases" in mods
    assert {f"build/{m}.py" for m in mods} <= set(tc._SOURCES)


def test_build_flag_and_config() -> None:
    a = parser().parse_args(["build", "--model", "dummy:tiny", "--output", "x",
                             "--no-tuning-cache"])  # fmt: skip
    from kiln.cli import _build_config

    assert _build_config(a).reuse_tuning is False
    a = parser().parse_args(["build", "--model", "dummy:tiny", "--output", "x"])
    assert _build_config(a).reuse_tuning is True
    with pytest.raises(ValueError, match="reuse_tuning"):
        BuildConfig(reuse_tuning="no")  # type: ignore[arg-type]


@pytest.mark.parametrize("reuse", [True, False])
def test_builder_passes_reuse_through(reuse: bool, tmp_path: Path, monkeypatch) -> None:
    """``build_engine`` asks ``cached_tune`` with the BuildConfig's ``reuse_tuning`` and writes
    what it returns (a CPU build here: the defaults)."""
    from kiln.build import builder

    seen: list[bool] = []

    def spy(cfg, dtype, device, limits, quant=None, reuse=True, dense_layers=True):
        seen.append(reuse)
        dense.append(dense_layers)
        return tc.tune(cfg, dtype, device, limits, quant=quant)

    dense: list[bool] = []
    monkeypatch.setattr(builder, "cached_tune", spy)
    out = tmp_path / "eng"
    builder.build_engine("dummy:tiny", out, BuildConfig(device="cpu", reuse_tuning=reuse),
                         progress=False)  # fmt: skip
    assert seen == [reuse] and dense == [True]  # unquantized: every projection dense
    q = QuantConfig(algo="int8-wo", quantize_lm_head=True)
    builder.build_engine("dummy:tiny", tmp_path / "q", BuildConfig(device="cpu", quant=q),
                         progress=False)  # fmt: skip
    assert dense == [True, False]  # every layer quantized by the build
    assert json.loads((out / "tuning.json").read_text())["tuned"] is False
