"""``--quantize-lm-head``: lm_head as a ``QuantLinear`` (``lm_head.proj``) for fp8, int8-wo
and int4-awq, built from a checkpoint (tied and untied heads), loaded through the shells,
and checked against the dequantized matrix and the unquantized engine; the configuration
and the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from kiln.build.builder import build_engine
from kiln.build.loader import load_engine
from kiln.config import BuildConfig, QuantConfig
from kiln.errors import ConfigError
from kiln.quant import formats as qf
from kiln.quant.layers import QuantLinear
from kiln.quant.passes import LM_HEAD
from tests.util import prefill_logits, save_tiny_llama, tiny_random_model


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(quantize_lm_head=True),  # no algo
        dict(algo="w8a8-sq", quantize_lm_head=True),
        dict(algo="fp8", activation_scheme="static", quantize_lm_head=True),
        dict(algo="fp8", quantize_lm_head=1),
    ],
)
def test_config_rejects_what_the_head_cannot_take(kwargs: dict) -> None:
    with pytest.raises(ConfigError, match=r"^quant\.quantize_lm_head=.* is invalid: "):
        QuantConfig(**kwargs)


def _dequantized(q: QuantLinear) -> torch.Tensor:
    if q.algo == "int4-awq":
        u = qf.unpack_int4(q.weight).float()
        g = q.group_size or 0
        s = q.weight_scale.repeat_interleave(g, dim=1)
        z = q.weight_zero.float().repeat_interleave(g, dim=1)
        return (u - z) * s
    return q.weight.float() * q.weight_scale[:, None]


@torch.no_grad()
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("algo", ["fp8", "int8-wo", "int4-awq"])
def test_build_load_and_compare(algo: str, tied: bool, tmp_path: Path) -> None:
    hf = save_tiny_llama(tmp_path / "hf", config={"tie_word_embeddings": tied, "vocab_size": 320})
    build_engine(str(hf), tmp_path / "plain", BuildConfig(device="cpu"), progress=False)
    group = 32 if algo == "int4-awq" else None
    qcfg = QuantConfig(algo=algo, group_size=group, quantize_lm_head=True)  # GPTQ layers
    m = build_engine(str(hf), tmp_path / "q", BuildConfig(device="cpu", quant=qcfg), 0, False)
    assert m["quant"]["quantize_lm_head"] is True
    assert LM_HEAD in m["quant"]["report"]["modules"]
    with safe_open(str(tmp_path / "q" / m["weights"]["ranks"][0]), "pt") as f:
        keys = set(f.keys())
    assert f"{LM_HEAD}.weight" in keys and "lm_head.weight" not in keys
    assert ("embed.weight" in keys) and (f"{LM_HEAD}.weight_scale" in keys)
    eng = load_engine(tmp_path / "q", "cpu")
    head = eng.model.lm_head
    assert isinstance(head.proj, QuantLinear) and head.proj.algo == algo
    assert head.proj.out_features == 320 and head.proj.in_features == 64
    if not tied:
        assert head.weight is None
    # the head multiplies by its dequantized matrix (activations per token for fp8)
    h = torch.randn(5, 64)
    got = head(h)
    a = qf.quantize_act(h, None, "fp8") if algo == "fp8" else None
    x = a.q.float() * a.scale if a is not None else h
    assert torch.allclose(got, F.linear(x, _dequantized(head.proj)), rtol=1e-5, atol=1e-5)
    # into a caller's float32 buffer (the CUDA graphs share one): the same values, in place
    buf = torch.full((8, 320), float("nan"))
    assert eng.model.compute_logits(h.to(eng.dtype), buf[:5]).data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:5], eng.model.compute_logits(h.to(eng.dtype)))
    assert buf[5:].isnan().all()
    ids = list(range(1, 30))
    plain_eng = load_engine(tmp_path / "plain", "cpu")
    buf.fill_(float("nan"))
    hb = h.to(plain_eng.dtype)
    assert plain_eng.model.compute_logits(hb, buf[:5]).data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:5], plain_eng.model.compute_logits(hb))
    plain = prefill_logits(plain_eng, ids)
    q = prefill_logits(eng, ids)
    err = float((q - plain).norm() / plain.norm())
    assert 0 < err < (0.3 if algo == "int4-awq" else 0.1), err


def test_cli_dummy_engine_and_inspect(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from kiln.cli import main

    out = str(tmp_path / "e")
    args = ["build", "--model", "dummy:tiny", "--output", out, "--device", "cpu"]
    assert main([*args, "--quant", "int8-wo", "--quantize-lm-head"]) == 0
    assert main(["inspect", out]) == 0
    assert "int8-wo (lm_head too," in capsys.readouterr().out
    eng = load_engine(out, "cpu")  # dummy: quantized at load, the head too
    assert isinstance(eng.model.lm_head.proj, QuantLinear)
    assert prefill_logits(eng, list(range(20))).isfinite().all()
    assert main([*args, "--quant", "w8a8-sq", "--quantize-lm-head"]) == 2
    assert "quant.quantize_lm_head=True is invalid" in capsys.readouterr().err


def test_fp8_head_needs_a_vocabulary_of_a_multiple_of_16(tmp_path: Path) -> None:
    hf = save_tiny_llama(tmp_path / "hf", config={"vocab_size": 301})
    qcfg = QuantConfig(algo="fp8", quantize_lm_head=True, weight_rounding="nearest")
    with pytest.raises(ConfigError, match="a multiple of 16, this model has 301"):
        build_engine(str(hf), tmp_path / "q", BuildConfig(device="cpu", quant=qcfg), 0, False)


@torch.no_grad()
def test_gptq_rounds_the_head_from_the_final_hidden_states() -> None:
    from kiln.quant.build import gptq_weights
    from kiln.quant.stats import prefill_hidden

    model, weights = tiny_random_model()
    windows = [list(range(1, 60)), list(range(60, 130))]
    qcfg = QuantConfig(algo="int4-awq", group_size=16, quantize_lm_head=True)
    out = gptq_weights(model, qcfg, windows, weights, None)
    u, s, z = out[LM_HEAD]
    w = model.lm_head.dense_weight().float()
    assert u.shape == w.shape and s.shape == (w.shape[0], w.shape[1] // 16)
    x = torch.cat([prefill_hidden(model, ids) for ids in windows]).float()
    gptq = (u.float() - z.float().repeat_interleave(16, 1)) * s.repeat_interleave(16, 1)
    ru, rs, rz = qf.quantize_int4(w, 16)
    rtn = (ru.float() - rz.float().repeat_interleave(16, 1)) * rs.repeat_interleave(16, 1)
    err_g = float(((gptq - w) @ x.T).norm())
    err_r = float(((rtn - w) @ x.T).norm())
    assert err_g < 0.9 * err_r, (err_g, err_r)
