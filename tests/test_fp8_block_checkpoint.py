"""Block-wise fp8 checkpoints (Hugging Face ``weight_block_size`` [128, 128], the format of
DeepSeek-V3's and Qwen3's FP8 releases; compressed-tensors FP8_BLOCK) built into kiln's
fp8 "block" engines. The checkpoints are synthetic: a tiny Llama's projections quantized
here in 128 x 128 tiles, next to a plain checkpoint of the same weights dequantized."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.build.builder import build_engine
from kiln.build.loader import load_engine
from kiln.config import BuildConfig, QuantConfig
from kiln.errors import CheckpointError
from kiln.quant import formats as qf
from tests.test_prequantized import IGNORED, PROJ, _write
from tests.util import prefill_logits, save_tiny_llama

IDS = list(range(1, 40))
HF_QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
         "weight_block_size": [128, 128]}  # fmt: skip
_TILE_IN = {"type": "float", "num_bits": 8, "strategy": "group", "group_size": 128,
            "dynamic": True, "symmetric": True}  # fmt: skip
CT_QC = {"quant_method": "compressed-tensors", "format": "float-quantized",
         "quantization_status": "compressed", "ignore": ["lm_head"],
         "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": _TILE_IN,
                                       "weights": {"type": "float", "num_bits": 8,
                                                   "strategy": "block", "symmetric": True,
                                                   "block_structure": [128, 128],
                                                   "dynamic": False}}}}  # fmt: skip


def _hf(d: Path, kv_heads: int = 2) -> Path:
    cfg = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4,
               num_key_value_heads=kv_heads)  # fmt: skip
    return save_tiny_llama(d, config=cfg)


def _quantize(src: Path, out: Path, scale_name: str, qc: dict) -> tuple[Path, Path]:
    """(block-wise fp8 checkpoint, plain checkpoint of its dequantized weights)."""
    quant: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        mod = name.removesuffix(".weight")
        if not PROJ.fullmatch(name) or mod == IGNORED:
            quant[name] = plain[name] = w
            continue
        q, s = qf.quantize_fp8_block_weight(w)
        quant[name], quant[f"{mod}.{scale_name}"] = q, s
        plain[name] = qf.dequantize_rows(q, s)
    return _write(src, out / "quant", quant, qc), _write(src, out / "plain", plain, None)


def _build(src: Path, out: Path) -> dict:
    return build_engine(str(src), out, BuildConfig(device="cpu", quant=QuantConfig()), 0, False)


@pytest.mark.parametrize(
    ("scale_name", "qc"), [("weight_scale_inv", HF_QC), ("weight_scale", CT_QC)]
)
def test_block_checkpoint_loads_as_is(scale_name: str, qc: dict, tmp_path: Path) -> None:
    qc = qc | ({"ignored_layers": [IGNORED.removeprefix("model.")]} if qc is HF_QC else {})
    if qc.get("ignore") is not None:
        qc["ignore"] = ["lm_head", IGNORED.removeprefix("model.")]
    qdir, pdir = _quantize(_hf(tmp_path / "hf"), tmp_path, scale_name, qc)
    m = _build(qdir, tmp_path / "e")
    q = m["quant"]
    assert q["algo"] == "fp8" and q["activation_scheme"] == "block"
    assert q["applied"] == "checkpoint" and "layers.0.mlp.down" in q["report"]["excluded"]
    eng = load_engine(tmp_path / "e", "cpu")
    mods = dict(eng.model.named_modules())
    qkv = mods["layers.1.attn.qkv"]
    assert qkv.weight_block == qf.FP8_BLOCK and qkv.weight_scale.shape == (4, 2)
    # the engine's tensors are the checkpoint's, fused: rows of q, k, v and their tile rows
    ck = load_file(str(qdir / "model.safetensors"))
    parts = [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    want_w = torch.cat([ck[p + ".weight"] for p in parts])
    assert torch.equal(qkv.weight.view(torch.uint8), want_w.view(torch.uint8))
    assert torch.equal(qkv.weight_scale, torch.cat([ck[f"{p}.{scale_name}"] for p in parts]))
    # logits: exactly the block path on the dequantized weights
    _build(pdir, tmp_path / "p")
    ref = load_engine(tmp_path / "p", "cpu")
    rmods = dict(ref.model.named_modules())
    for name, mod in mods.items():
        if type(mod).__name__ == "QuantLinear":
            assert torch.equal(qf.dequantize_rows(mod.weight, mod.weight_scale),
                               rmods[name].weight.float())  # fmt: skip
            parent, attr = name.rsplit(".", 1)
            setattr(ref.model.get_submodule(parent), attr, mod)
    assert torch.equal(prefill_logits(eng, IDS), prefill_logits(ref, IDS))


def test_block_checkpoint_takes_a_group_scale_search(tmp_path: Path) -> None:
    qdir, _ = _quantize(_hf(tmp_path / "hf"), tmp_path, "weight_scale_inv", HF_QC)
    cfg = BuildConfig(device="cpu", quant=QuantConfig(algo="fp8", act_scale_search=8))
    m = build_engine(str(qdir), tmp_path / "e", cfg, 0, False)
    assert m["quant"]["activation_scheme"] == "block" and m["quant"]["act_scale_search"] == 8
    qkv = load_engine(tmp_path / "e", "cpu").model.get_submodule("layers.0.attn.qkv")
    assert qkv.act_search == 8 and qkv.weight_block == qf.FP8_BLOCK


def test_block_checkpoint_refusals(tmp_path: Path) -> None:
    # k and v of 64 rows each: a fused 128-row tile would straddle k and v
    qdir, _ = _quantize(_hf(tmp_path / "hf", kv_heads=1), tmp_path, "weight_scale_inv", HF_QC)
    with pytest.raises(CheckpointError, match=r"whose 128-row weight tiles would straddle"):
        _build(qdir, tmp_path / "e")
    # tile scales of the wrong shape
    src = _hf(tmp_path / "hf2")
    qdir, _ = _quantize(src, tmp_path / "x", "weight_scale_inv", HF_QC)
    t = load_file(str(qdir / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    t[key] = t[key][:1]
    bad = _write(src, tmp_path / "bad", t, HF_QC)
    with pytest.raises(CheckpointError, match=r"q_proj\.weight_scale_inv has shape \(1, 2\)"):
        _build(bad, tmp_path / "e2")
