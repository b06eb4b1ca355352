"""tuning.json: written by every build, made active at load; CUDA-graph batch sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.build.builder import build_engine
from kiln.build.loader import load_engine
from kiln.config import BuildConfig
from kiln.kernels import tuning
from kiln.runtime.cuda_graphs import default_batch_sizes


def test_cpu_build_records_defaults_and_load_applies_tuning(tmp_path: Path) -> None:
    out = tmp_path / "eng"
    manifest = build_engine("dummy:tiny", out, BuildConfig(device="cpu"), progress=False)
    t = json.loads((out / "tuning.json").read_text())
    assert t["tuned"] is False and "CPU" in t["why"]
    assert t["kernels"] == tuning.DEFAULTS
    assert "tuning.json" in manifest["files"]  # hashed like every engine file
    # an engine tuned elsewhere: its values become active at load; unknown keys are ignored
    t["kernels"]["decode_attention"] = {"target_programs": 999, "num_warps": 8, "new_key": 1}
    t["kernels"]["kernel_from_the_future"] = {"x": 1}
    (out / "tuning.json").write_text(json.dumps(t))
    from kiln.build.engine_dir import sha256_file, write_manifest

    m = json.loads((out / "manifest.json").read_text())
    m.pop("files")
    write_manifest(out, m)
    assert (
        sha256_file(out / "tuning.json")
        == json.loads((out / "manifest.json").read_text())["files"]["tuning.json"]["sha256"]
    )
    try:
        engine = load_engine(out, "cpu")
        assert engine.tuning is not None
        # keys the file lacks (an engine tuned before they existed) keep their defaults
        assert tuning.tuned("decode_attention") == {
            "target_programs": 999,
            "num_warps": 8,
            "blocks_per_step": 1,
        }
        assert tuning.tuned("prefill_attention") == tuning.DEFAULTS["prefill_attention"]
    finally:
        tuning.set_tuning(None)
    assert tuning.tuned("decode_attention") == tuning.DEFAULTS["decode_attention"]


def test_default_cuda_graph_batch_sizes() -> None:
    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(6) == [1, 2, 4, 6]
    s = default_batch_sizes(512)
    assert s[:5] == [1, 2, 4, 8, 16] and s[-1] == 512
    # padding to the next size wastes at most 1/8 of a step above 16 sequences
    for b in range(17, 513):
        g = min(x for x in s if x >= b)
        assert (g - b) / b < 0.125 or g - b < 16
    assert default_batch_sizes(1000)[-2:] == [960, 1000]


@pytest.mark.parametrize("kv_fp8", [False, True])
def test_decode_tuning_cases_run_every_candidate_shape(kv_fp8: bool) -> None:
    """The build's decode-attention cases (over an fp8 cache for fp8-KV engines) run with
    each kind of candidate the tuner times, blocks per step included; on the CPU through
    the interpreter, so that a GPU build does not first meet a broken case (a failing
    candidate would only be recorded and skipped)."""
    from kiln.build.tuning import _decode_case
    from kiln.config import ModelConfig

    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=32, hidden_size=64, intermediate_size=96,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=128,
    )  # fmt: skip
    case = _decode_case(cfg, torch.float32, 2, 40, 16, kv_fp8=kv_fp8, device="cpu")
    outs = [
        case({"target_programs": 8, "num_warps": 4, "blocks_per_step": nb}).clone()
        for nb in (1, 2, 4)
    ]
    assert torch.isfinite(outs[0]).all() and outs[0].abs().sum() > 0
    for o in outs[1:]:  # the step size changes the order of the sums, not the result
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-5)
