"""Every check that loading an engine directory makes (kiln/build/engine_dir.py and
kiln/build/loader.py): each refusal is an EngineLoadError whose message names the mismatch
and carries the command that fixes it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import kiln.build.loader as loader
from kiln import LLM, SamplingParams
from kiln.build.builder import build_engine
from kiln.build.engine_dir import FORMAT_VERSION, MANIFEST, check_target, sha256_file
from kiln.build.loader import load_engine
from kiln.build.target import describe_target
from kiln.cli import main
from kiln.config import BuildConfig
from kiln.errors import EngineLoadError

from .util import save_tiny_llama

WEIGHTS = "rank0.safetensors"
H200 = {"device": "cuda", "gpu_name": "NVIDIA H200", "compute_capability": "9.0"}


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("hf-tiny"))


@pytest.fixture(scope="module")
def built(hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("built") / "engine"
    build_engine(str(hf_checkpoint), out, BuildConfig(device="cpu"), progress=False)
    return out


@pytest.fixture
def engine(built: Path, tmp_path: Path) -> Path:
    """A private copy of the built engine that a test may damage."""
    return Path(shutil.copytree(built, tmp_path / "engine"))


def read(root: Path) -> dict[str, Any]:
    return json.loads((root / MANIFEST).read_text())


def write(root: Path, manifest: dict[str, Any]) -> None:
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def edit(root: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """Merge ``sections`` into the manifest's sections of the same name; return the old one."""
    old = read(root)
    new = json.loads(json.dumps(old))
    for key, value in sections.items():
        new[key] = {**new[key], **value} if isinstance(new.get(key), dict) else value
    write(root, new)
    return old


def fake_target(gpu_name: str, cc: str) -> dict[str, Any]:
    return {
        **describe_target("cpu"),
        "device": "cuda",
        "gpu_name": gpu_name,
        "compute_capability": cc,
    }


def pretend_gpu(monkeypatch: pytest.MonkeyPatch, gpu_name: str, cc: str) -> None:
    """Make the loader believe this machine has ``gpu_name`` with compute capability ``cc``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(loader, "describe_target", lambda device: fake_target(gpu_name, cc))


def assert_fix(msg: str, *names: str, command: str = "kiln build") -> None:
    for name in names:
        assert name in msg, f"{name!r} not in message: {msg}"
    assert command in msg, f"{command!r} not in message: {msg}"
    assert "\n" not in msg


# ---- positive control ------------------------------------------------------------------


def test_built_engine_loads_and_generates(engine: Path) -> None:
    loaded = load_engine(engine, stamp_dir=engine.parent / "stamps")
    assert loaded.device.type == "cpu"
    assert loaded.dtype == torch.float32
    assert loaded.config.vocab_size == 300
    llm = LLM(engine)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_manifest_edited_back_to_valid_loads(engine: Path) -> None:
    old = edit(engine, target=H200, mapping={"tp": 2}, format_version=FORMAT_VERSION + 1)
    with pytest.raises(EngineLoadError):
        load_engine(engine)
    write(engine, old)
    loaded = load_engine(engine)
    assert loaded.manifest == old


# ---- target ----------------------------------------------------------------------------


def test_engine_for_another_device_kind(engine: Path) -> None:
    edit(engine, target=H200)
    with pytest.raises(EngineLoadError) as e:
        load_engine(engine)
    assert_fix(str(e.value), "built for cuda", "NVIDIA H200", "loaded on cpu", "--device cpu")
    assert f"--model {read(engine)['source']['model']}" in str(e.value)
    with pytest.raises(EngineLoadError, match="built for cuda"):
        LLM(engine)


def test_cpu_engine_loaded_on_a_gpu(engine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pretend_gpu(monkeypatch, "NVIDIA H200", "9.0")
    with pytest.raises(EngineLoadError) as e:
        load_engine(engine, device="cuda")
    assert_fix(str(e.value), "built for cpu", "loaded on cuda", "--device cuda")


def test_engine_for_another_compute_capability(
    engine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    edit(engine, target=H200)
    pretend_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", "8.0")
    with pytest.raises(EngineLoadError) as e:
        load_engine(engine)
    assert_fix(str(e.value), "compute capability 9.0", "NVIDIA H200", "NVIDIA A100", "8.0")
    # the rebuild command names the checkpoint the engine came from
    assert read(engine)["source"]["model"] in str(e.value)


def test_check_target_compute_capability_directly(engine: Path) -> None:
    manifest = {**read(engine), "target": {**read(engine)["target"], **H200}}
    check_target(manifest, fake_target("NVIDIA H200", "9.0"))  # same GPU: fine
    with pytest.raises(EngineLoadError) as e:
        check_target(manifest, fake_target("NVIDIA A100", "8.0"))
    assert_fix(str(e.value), "9.0", "8.0", "NVIDIA A100")


def test_world_size_differs_from_tp_times_pp(engine: Path) -> None:
    edit(engine, mapping={"tp": 2, "pp": 1})
    with pytest.raises(EngineLoadError) as e:
        load_engine(engine)
    assert_fix(str(e.value), "tp=2", "pp=1", "world size is 1", command="--tp 1 --pp 1")


def test_world_size_check_directly(engine: Path) -> None:
    manifest = read(engine)
    here = describe_target("cpu")
    check_target(manifest, here, world_size=1)
    with pytest.raises(EngineLoadError, match=r"world size is 4"):
        check_target(manifest, here, world_size=4)


def test_precision_the_device_cannot_run(engine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t4 = {"device": "cuda", "gpu_name": "Tesla T4", "compute_capability": "7.5"}
    edit(engine, dtype="bfloat16", target=t4)
    pretend_gpu(monkeypatch, "Tesla T4", "7.5")
    with pytest.raises(EngineLoadError) as e:
        load_engine(engine)
    assert_fix(str(e.value), "bfloat16", "7.5", "8.0", command="--dtype float16")
    assert "kiln build" in str(e.value)


def test_precision_check_directly(engine: Path) -> None:
    t4 = fake_target("Tesla T4", "7.5")
    manifest = {**read(engine), "dtype": "bfloat16", "target": t4}
    with pytest.raises(EngineLoadError) as e:
        check_target(manifest, t4)
    assert_fix(str(e.value), "bfloat16", "compute capability >= 8.0", command="--dtype float16")
    check_target({**manifest, "dtype": "float16"}, t4)  # float16 runs on a T4


# ---- manifest --------------------------------------------------------------------------


def test_newer_format_version(engine: Path) -> None:
    edit(engine, format_version=FORMAT_VERSION + 1)
    with pytest.raises(EngineLoadError) as e:
        load_engine(engine)
    assert_fix(
        str(e.value),
        f"format version {FORMAT_VERSION + 1}",
        f"({FORMAT_VERSION})",
        "pip install -U",
    )


def test_manifest_not_json(engine: Path) -> None:
    (engine / MANIFEST).write_text('{"format_version": 1,')
    with pytest.raises(EngineLoadError) as e:
        load_engine(engine)
    assert_fix(str(e.value), MANIFEST, "not valid JSON")


def test_unsupported_architecture(engine: Path) -> None:
    edit(engine, model={"architecture": "GPT2LMHeadModel"})
    with pytest.raises(EngineLoadError) as e:
        load_engine(engine)
    msg = str(e.value)
    for name in ("GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert name in msg


def test_model_config_in_manifest_invalid(engine: Path) -> None:
    edit(engine, model={"hidden_size": -64})
    with pytest.raises(EngineLoadError) as e:
        load_engine(engine)
    assert_fix(str(e.value), "hidden_size", "-64")


def test_weights_do_not_fit_manifest_model(engine: Path) -> None:
    edit(engine, model={"intermediate_size": 96})
    with pytest.raises(EngineLoadError) as e:
        load_engine(engine)
    assert_fix(str(e.value), "do not fit", "size mismatch")


def test_path_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-engine"
    with pytest.raises(EngineLoadError) as e:
        load_engine(missing)
    assert_fix(str(e.value), str(missing), "does not exist", command=f"--output {missing}")
    assert "kiln build" in str(e.value)


def test_directory_that_is_not_an_engine(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(EngineLoadError) as e:
        load_engine(tmp_path)
    assert_fix(str(e.value), "not an engine directory", MANIFEST, command="kiln build")


# ---- files -----------------------------------------------------------------------------


def test_missing_weight_file(engine: Path) -> None:
    (engine / WEIGHTS).unlink()
    with pytest.raises(EngineLoadError) as e:
        load_engine(engine)
    assert_fix(str(e.value), WEIGHTS, "missing")
    with pytest.raises(EngineLoadError, match="missing"):
        LLM(engine)


def test_truncated_weight_file(engine: Path) -> None:
    path = engine / WEIGHTS
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(EngineLoadError) as e:
        load_engine(engine)
    assert_fix(str(e.value), WEIGHTS, f"{size - 1000} bytes", str(size), "truncated")


def flip_middle(path: Path, n: int = 16) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        block = f.read(n)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in block))
    assert path.stat().st_size == size


def test_altered_weight_file_same_size(engine: Path) -> None:
    flip_middle(engine / WEIGHTS)
    with pytest.raises(EngineLoadError) as e:
        load_engine(engine)
    assert_fix(str(e.value), WEIGHTS, "sha256", "altered")


def test_altered_weight_file_after_a_stamped_load(engine: Path, tmp_path: Path) -> None:
    stamps = tmp_path / "stamps"
    load_engine(engine, stamp_dir=stamps)
    assert list(stamps.glob("*.json")), "a successful load leaves a verification stamp"
    load_engine(engine, stamp_dir=stamps)  # the stamp is trusted for an unchanged file
    flip_middle(engine / WEIGHTS)
    with pytest.raises(EngineLoadError) as e:
        load_engine(engine, stamp_dir=stamps)
    assert_fix(str(e.value), WEIGHTS, "sha256")


def test_altered_file_after_stamped_load_through_llm(
    engine: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    LLM(engine)
    assert list((tmp_path / "cache" / "verified").glob("*.json"))
    flip_middle(engine / WEIGHTS)
    with pytest.raises(EngineLoadError, match="sha256"):
        LLM(engine)


def test_altered_non_weight_file(engine: Path) -> None:
    other = next(name for name in read(engine)["files"] if name != WEIGHTS)
    flip_middle(engine / other, n=1)
    with pytest.raises(EngineLoadError) as e:
        load_engine(engine)
    assert_fix(str(e.value), other, "sha256")


# ---- kiln inspect ----------------------------------------------------------------------


def test_inspect_shows_the_manifest(engine: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(engine)]) == 0
    out = capsys.readouterr().out
    m = read(engine)
    assert "LlamaForCausalLM" in out
    assert "float32" in out
    lim = m["limits"]
    assert f"max_batch_size {lim['max_batch_size']}" in out
    assert f"max_seq_len {lim['max_seq_len']}" in out
    assert f"max_num_tokens {lim['max_num_tokens']}" in out
    assert re.search(r"^target\s+cpu", out, re.M)
    assert m["target"]["torch"] in out
    for name, f in m["files"].items():
        assert name in out
        assert f["sha256"][:16] in out
    assert sha256_file(engine / WEIGHTS)[:16] in out


def test_inspect_json(engine: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--json", str(engine)]) == 0
    assert json.loads(capsys.readouterr().out) == read(engine)


def test_inspect_not_an_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln inspect: error:")
    assert "kiln build" in err
