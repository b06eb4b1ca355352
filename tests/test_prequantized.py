"""Pre-quantized Hugging Face checkpoints (fp8, AutoAWQ gemm int4) built into kiln engines;
GPTQ is in test_prequant_gptq.py. The checkpoints are synthetic: the tiny Llama's
projections quantized here, in the HF layouts, next to a plain checkpoint of the same
weights dequantized."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.build.builder import build_engine
from kiln.build.loader import load_engine
from kiln.build.prequant import checkpoint_quant, unpack_awq
from kiln.config import BuildConfig, QuantConfig
from kiln.errors import CheckpointError, ConfigError
from kiln.quant import formats as qf
from tests.util import prefill_logits, save_tiny_llama

PROJ = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
IGNORED = "model.layers.0.mlp.down_proj"  # left unquantized in every synthetic checkpoint
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of an int32 holds column ORDER[i]
GROUP = 32
IDS = list(range(1, 40))


def _pack_awq(q: torch.Tensor) -> torch.Tensor:
    """(R, C) values 0..15 -> AutoAWQ int32 (R, C/8), written from the format description."""
    q = q.to(torch.int64)
    out = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for c in range(out.shape[1]):
        for i, j in enumerate(ORDER):
            out[:, c] |= q[:, 8 * c + j] << (4 * i)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def _write(src: Path, dst: Path, tensors: dict[str, torch.Tensor], qc: dict | None) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copyfile(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    if qc is not None:
        cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def _quantize(src: Path, out: Path, method: str, per_tensor: bool = False, static: bool = False):
    """(pre-quantized checkpoint, plain checkpoint of its dequantized weights)."""
    quant: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(0)
    for name, w in load_file(str(src / "model.safetensors")).items():
        mod = name.removesuffix(".weight")
        if not PROJ.fullmatch(name) or mod == IGNORED:
            quant[name] = plain[name] = w
            continue
        if method == "fp8":
            s = w.float().abs().amax(dim=1, keepdim=True) / 448  # (N, 1)
            s = s.amax().reshape(()) if per_tensor else s
            q = qf.quantize_fp8(w, s)
            quant[name], quant[mod + ".weight_scale"] = q, s
            if static:
                quant[mod + ".input_scale"] = (torch.rand((), generator=gen) + 0.5) / 100
            plain[name] = q.float() * s
        else:
            q, s, z = qf.quantize_int4(w, GROUP)
            s = s.half()
            quant[mod + ".qweight"] = _pack_awq(q.t())
            quant[mod + ".qzeros"] = _pack_awq(z.t())
            quant[mod + ".scales"] = s.t()
            plain[name] = qf.dequantize_int4(q, s.float(), z)
    if method == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
        qc["ignored_layers"] = [IGNORED.removeprefix("model.")]
    else:
        qc = {"quant_method": "awq", "version": "gemm", "bits": 4, "zero_point": True}
        qc["group_size"] = GROUP
        qc["modules_to_not_convert"] = [IGNORED]
    return _write(src, out / "quant", quant, qc), _write(src, out / "plain", plain, None)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("hf"))


def _build(src: Path, out: Path, **quant: object) -> dict:
    return build_engine(
        str(src), out, BuildConfig(device="cpu", quant=QuantConfig(**quant)), 0, False
    )


def test_awq_unpack_inverts_the_documented_order() -> None:
    q = torch.randint(0, 16, (5, 24), generator=torch.Generator().manual_seed(1))
    packed = _pack_awq(q)
    assert packed.dtype == torch.int32 and packed.shape == (5, 3)
    assert torch.equal(unpack_awq(packed), q.to(torch.uint8))
    one = torch.zeros(1, 8, dtype=torch.int64)
    one[0, 1] = 15  # column 1 lives in nibble 4 (bits 16..19)
    assert int(_pack_awq(one)[0, 0]) == 15 << 16


@pytest.mark.parametrize("per_tensor,static", [(False, False), (True, False), (False, True)])
def test_fp8_checkpoint(per_tensor: bool, static: bool, tiny_hf: Path, tmp_path: Path) -> None:
    qdir, pdir = _quantize(tiny_hf, tmp_path, "fp8", per_tensor, static)
    m = _build(qdir, tmp_path / "e")
    q = m["quant"]
    assert q["algo"] == "fp8" and q["applied"] == "checkpoint"
    assert q["activation_scheme"] == ("static" if static else "dynamic")
    assert "layers.0.mlp.down" in q["report"]["excluded"] and len(q["report"]["modules"]) == 7
    eng = load_engine(tmp_path / "e", "cpu")
    mods = dict(eng.model.named_modules())
    assert type(mods["layers.0.mlp.down"]).__name__ == "Linear"
    assert mods["layers.1.attn.qkv"].weight.dtype == qf.FP8_DTYPE
    # the engine's tensors are the checkpoint's, fused: rows of q, k, v and their scales
    ck = load_file(str(qdir / "model.safetensors"))
    sd = eng.model.state_dict()
    parts = [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    want_w = torch.cat([ck[p + ".weight"] for p in parts])
    assert torch.equal(sd["layers.1.attn.qkv.weight"].view(torch.uint8), want_w.view(torch.uint8))
    rows = [
        ck[p + ".weight_scale"].float().reshape(-1).expand(ck[p + ".weight"].shape[0])
        for p in parts
    ]
    assert torch.equal(sd["layers.1.attn.qkv.weight_scale"], torch.cat(rows))
    if static:
        want = max(float(ck[p + ".input_scale"]) for p in parts)
        assert float(sd["layers.1.attn.qkv.input_scale"]) == want
    else:
        assert "layers.1.attn.qkv.input_scale" not in sd
    # logits: exactly the fp8 reference path on the dequantized weights
    _build(pdir, tmp_path / "p")
    ref = load_engine(tmp_path / "p", "cpu")
    rmods = dict(ref.model.named_modules())
    for name, mod in mods.items():
        if type(mod).__name__ == "QuantLinear":
            parent, attr = name.rsplit(".", 1)
            setattr(ref.model.get_submodule(parent), attr, mod)
            w_deq = qf.dequantize_rows(mod.weight, mod.weight_scale)
            assert torch.equal(w_deq, rmods[name].weight.float())
    a, b = prefill_logits(eng, IDS), prefill_logits(ref, IDS)
    assert torch.equal(a, b)
    plain = load_engine(tmp_path / "p", "cpu")  # unquantized activations: close, not equal
    c = prefill_logits(plain, IDS)
    assert float((a - c).norm() / c.norm()) < 0.05
    from kiln.llm import LLM
    from kiln.sampling_params import SamplingParams

    out = LLM(tmp_path / "e", progress=False).generate([IDS], SamplingParams(max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_awq_checkpoint(tiny_hf: Path, tmp_path: Path) -> None:
    qdir, pdir = _quantize(tiny_hf, tmp_path, "awq")
    m = _build(qdir, tmp_path / "e")
    q = m["quant"]
    assert q["algo"] == "int4-awq" and q["group_size"] == GROUP and q["applied"] == "checkpoint"
    assert q["report"]["excluded"] == ["layers.0.mlp.down"]
    assert q["report"]["linear_bytes_after"] < q["report"]["linear_bytes_before"] / 3
    eng = load_engine(tmp_path / "e", "cpu")
    mod = eng.model.get_submodule("layers.1.mlp.gate_up")
    assert mod.weight.dtype == torch.uint8 and mod.weight.shape == (256, 32)
    assert torch.equal(mod.smooth, torch.ones(64))
    assert mod.weight_scale.dtype == torch.float16  # AutoAWQ's float16 scales, kept so
    from safetensors import safe_open

    with safe_open(str(tmp_path / "e" / "rank0.safetensors"), "pt") as f:
        assert f.get_slice("layers.1.mlp.gate_up.weight_scale").get_dtype() == "F16"
    _build(pdir, tmp_path / "p")
    a, b = prefill_logits(eng, IDS), prefill_logits(load_engine(tmp_path / "p", "cpu"), IDS)
    # W4A16 in float32 is the dequantized model up to float32 rounding
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    from kiln.llm import LLM
    from kiln.sampling_params import SamplingParams

    out = LLM(tmp_path / "e", progress=False).generate([IDS], SamplingParams(max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_prequantized_refusals(tiny_hf: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"block-wise.*\[64, 64\].*\[128, 128\] tiles"):
        checkpoint_quant(
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}
        )
    with pytest.raises(CheckpointError, match=r"not supported.*GPTQ int4"):
        checkpoint_quant({"quantization_config": {"quant_method": "bitsandbytes"}})
    with pytest.raises(CheckpointError, match="gemm"):
        checkpoint_quant({"quantization_config": {"quant_method": "awq", "version": "gemv"}})
    assert checkpoint_quant({}) is None
    qdir, _ = _quantize(tiny_hf, tmp_path, "fp8")
    with pytest.raises(ConfigError, match="already quantized"):
        _build(qdir, tmp_path / "e", algo="int8-wo")
    with pytest.raises(ConfigError, match="--activation-scheme outliers needs the unquantized"):
        _build(qdir, tmp_path / "e", algo="fp8", activation_scheme="outliers")
    # --quant fp8 alone: fp8's default scheme (outliers) was not asked for, so the
    # checkpoint's own per-token scales apply
    m = _build(qdir, tmp_path / "same", algo="fp8")
    assert m["quant"]["activation_scheme"] == "dynamic" and m["quant"]["applied"] == "checkpoint"
    with pytest.raises(ConfigError, match="--quantize-lm-head needs the unquantized"):
        _build(qdir, tmp_path / "e", algo="fp8", quantize_lm_head=True)
    m = _build(qdir, tmp_path / "kv", kv_cache_dtype="fp8")
    assert m["quant"]["kv_cache_dtype"] == "fp8" and len(m["quant"]["kv_scales"]) == 2
    assert torch.isfinite(prefill_logits(load_engine(tmp_path / "kv", "cpu"), IDS)).all()


def test_prequantized_build_tunes_the_checkpoints_kernels(
    tiny_hf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pre-quantized checkpoint built without ``--quant`` is tuned for its own
    quantization (the weight-only kernels of its int4 groups, the float16-code picks), not
    as an unquantized model, with every layer shape still given to the skinny matmul (its
    unconverted modules stay dense)."""
    from kiln.build import builder, tuning_cache

    seen: list[tuple] = []
    real = tuning_cache.cached_tune

    def spy(cfg, dtype, device, limits, quant=None, reuse=True, dense_layers=True):
        seen.append((quant.algo, quant.group_size, dense_layers))
        return real(cfg, dtype, device, limits, quant, reuse, dense_layers)

    monkeypatch.setattr(builder, "cached_tune", spy)
    qdir, _ = _quantize(tiny_hf, tmp_path, "awq")
    _build(qdir, tmp_path / "e")
    assert seen == [("int4-awq", GROUP, True)]
