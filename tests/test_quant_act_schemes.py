"""fp8's "outliers" activation scheme (per token, with each projection's input channels of
largest calibrated amax carried in two e4m3 parts on both sides of the GEMM): QuantLinear,
GPTQ, the configuration, the build, the CLI, and the CUDA path against its reference in
the gpu-marked test. Also the reference's per-group activation scales, which experiments
use (scripts/experiments/fp8_act_error_sources.py) and no engine mode does."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kiln.build.builder import build_engine
from kiln.build.loader import load_engine
from kiln.checkpoint.dummy import DummyCheckpoint
from kiln.config import BuildConfig, QuantConfig
from kiln.errors import ConfigError
from kiln.kernels.quant_act import quantize_rows_ref
from kiln.layers.linear import Linear
from kiln.quant.layers import QuantLinear
from kiln.quant.passes import fuse_activation_quant, quantize_model
from tests.util import prefill_logits, save_tiny_llama, tiny_random_model


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _outliers(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows with a few channels 300x the rest, as LLM activations have."""
    x = torch.randn(m, k, generator=_gen(seed))
    x[:, torch.randperm(k, generator=_gen(seed + 1))[:3]] *= 300.0
    return x


@pytest.mark.parametrize(("m", "k", "group"), [(5, 96, 32), (1, 48, 16), (9, 176, 16)])
def test_group_scales_round_each_group_on_its_own(m: int, k: int, group: int) -> None:
    x = _outliers(m, k, seed=k)
    q, s = quantize_rows_ref(x, "fp8", group=group)
    assert q.shape == (m, k) and s.shape == (m, k // group) and s.dtype == torch.float32
    xg = x.reshape(m, k // group, group)
    assert torch.equal(s, xg.abs().amax(-1) / 448.0)  # each group's amax maps to 448
    assert torch.equal(q.float().reshape(m, -1, group).abs().amax(-1), torch.full_like(s, 448.0))
    sx = s.repeat_interleave(group, dim=1)
    err = (q.float() * sx - x).abs()
    assert bool((err <= torch.maximum(x.abs() * 2**-4, sx * 2**-10) * 1.0001).all())
    # one group of the whole row is the per-token scheme, bit for bit
    q1, s1 = quantize_rows_ref(x, "fp8", group=k)
    q0, s0 = quantize_rows_ref(x, "fp8")
    assert torch.equal(q1.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s1, s0)
    # a group that does not divide K: the last group holds the rest, scaled on its own
    q7, s7 = quantize_rows_ref(x, "fp8", group=7)
    n7 = -(-k // 7)
    assert s7.shape == (m, n7)
    assert torch.equal(s7[:, -1], x[:, (n7 - 1) * 7 :].abs().amax(-1) / 448.0)
    qe = (x / s7.repeat_interleave(7, dim=1)[:, :k]).to(torch.float8_e4m3fn)
    assert torch.equal(q7.view(torch.uint8), qe.view(torch.uint8))
    with pytest.raises(ValueError, match="positive number of channels"):
        quantize_rows_ref(x, "fp8", group=0)


def test_group_scales_lose_less_than_per_token_with_outlier_channels() -> None:
    x = _outliers(64, 256, seed=3)

    def err(group: int | None) -> float:
        q, s = quantize_rows_ref(x, "fp8", group=group)
        sx = s if group is None else s.repeat_interleave(group, dim=1)
        return float((q.float() * sx - x).norm() / x.norm())

    # the outliers' groups keep the per-token error; every other group gets its own range
    assert err(32) < err(None)
    small = torch.ones(256, dtype=torch.bool)
    small[x.abs().amax(0) > 50] = False
    q, s = quantize_rows_ref(x, "fp8", group=32)
    qt, st = quantize_rows_ref(x, "fp8")
    e_g = (q.float() * s.repeat_interleave(32, dim=1) - x)[:, small].norm()
    e_t = (qt.float() * st - x)[:, small].norm()
    assert float(e_g) < float(e_t)


# ---------------------------------------------------------------- outlier channels


def _outlier_linear(k: int = 96, n: int = 40) -> tuple[Linear, torch.Tensor]:
    lin = Linear(k, n, bias=True, dtype=torch.float32, device="cpu")
    lin.weight.copy_(torch.randn(n, k, generator=_gen(7)) * 0.1)
    lin.bias.copy_(torch.randn(n, generator=_gen(8)))
    return lin, torch.tensor([50, 3, 17])


@torch.no_grad()
def test_quant_linear_outliers_forward_is_the_explicit_formula() -> None:
    lin, idx = _outlier_linear()
    q = QuantLinear.from_linear(lin, "fp8", outlier_channels=idx)
    o = [3, 17, 50]
    assert q.outlier_idx.tolist() == o and q.act_kind == "fp8" and "act_outliers=3" in repr(q)
    assert q.outliers is q.outlier_idx
    w = lin.weight.float()
    ws = w.abs().amax(1) / 448.0  # the row scales cover the outlier columns
    assert torch.equal(q.weight_scale, ws) and q.weight.shape == (40, 96 + 6)
    v = w / ws[:, None]
    hi = v[:, o].to(torch.float8_e4m3fn)
    lo = (v[:, o] - hi.float()).to(torch.float8_e4m3fn)
    u8 = q.weight.view(torch.uint8)
    assert torch.equal(u8[:, :96], v.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(u8[:, 96:99], hi.view(torch.uint8))
    assert torch.equal(u8[:, 99:], lo.view(torch.uint8))
    x = _outliers(7, 96, seed=9)
    xq, xs = quantize_rows_ref(x, "fp8")
    xv = (x / xs).clamp(-448, 448)
    x_hi = xq[:, o].float()
    x_lo = (xv[:, o] - x_hi).to(torch.float8_e4m3fn).float()
    main = F.linear(xq.float() * xs, q.weight[:, :96].float() * ws[:, None])
    split = F.linear(x_lo * xs, hi.float() * ws[:, None]) + F.linear(
        x_hi * xs, lo.float() * ws[:, None]
    )
    want = main + split + lin.bias
    assert torch.allclose(q(x), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # the outlier channels' own products: bfloat16-like precision, not e4m3's
    exact = F.linear(x[:, o], w[:, o])
    two = F.linear((x_hi + x_lo) * xs, (hi.float() + lo.float()) * ws[:, None])
    one = F.linear(x_hi * xs, hi.float() * ws[:, None])
    assert float((two - exact).norm()) < float((one - exact).norm()) / 8
    for bad in (96, 0):
        with pytest.raises(ConfigError, match=r"^quant\.act_outliers=.*in_features=96"):
            QuantLinear(96, 40, "fp8", act_outliers=bad)
    with pytest.raises(ConfigError, match=r"^quant\.act_outliers="):
        QuantLinear(96, 40, "fp8", static_input=True, act_outliers=4)
    with pytest.raises(TypeError, match="no pre-quantized input of 96 columns"):
        q(quantize_rows_ref(x, "fp8"))  # a producer that did not split the channels


@torch.no_grad()
def test_outlier_channels_cut_the_error_of_outlier_inputs() -> None:
    lin, _ = _outlier_linear()
    x = _outliers(32, 96, seed=10)  # three channels 300x the rest
    ref = F.linear(x, lin.weight, lin.bias)
    big = x.abs().amax(0).topk(3).indices
    per_token = QuantLinear.from_linear(lin, "fp8")
    kept = QuantLinear.from_linear(lin, "fp8", outlier_channels=big)
    e_t = float((per_token(x) - ref).norm() / ref.norm())
    e_o = float((kept(x) - ref).norm() / ref.norm())
    assert e_o < 0.8 * e_t


@torch.no_grad()
def test_quantize_model_keeps_the_largest_calibrated_channels() -> None:
    cfg = DummyCheckpoint("tiny", {}).config
    from kiln.models import build_model

    model = build_model(cfg, torch.float32, "cpu")
    qcfg = QuantConfig(algo="fp8", activation_scheme="outliers", act_outliers=8)
    with pytest.raises(ConfigError, match="needs calibration statistics"):
        quantize_model(model, qcfg)
    stats = {}
    big = [5, 9, 30, 31, 40, 41, 42]
    for i in range(cfg.num_hidden_layers):
        for t, k in (("attn.qkv", 64), ("attn.o", 64), ("mlp.gate_up", 64), ("mlp.down", 176)):
            amax = torch.rand(k, generator=_gen(i))
            amax[[*big, k - 1]] = torch.arange(9.0, 1.0, -1.0)
            stats[f"layers.{i}.{t}"] = {"amax": amax.max(), "channel_amax": amax}
    quantize_model(model, qcfg, act_stats=stats)
    qls = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(qls) == 8 and all(q.outlier_idx.tolist()[:7] == big for q in qls)
    assert {q.outlier_idx.tolist()[7] for q in qls} == {63, 175}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        # the outliers scheme (fp8's default) only
        (dict(algo="fp8", activation_scheme="dynamic", act_outliers=8), "act_outliers"),
        (dict(algo="int8-wo", act_outliers=8), "act_outliers"),
        (dict(algo="fp8", activation_scheme="outliers", act_outliers=0), "act_outliers"),
        (dict(algo="fp8", activation_scheme="outliers", act_outliers=2000), "act_outliers"),
        (dict(algo="fp8", activation_scheme="outliers", act_outliers=True), "act_outliers"),
        (dict(algo="fp8", activation_scheme="outliers", act_outliers=12), "act_outliers"),
        (dict(algo="w8a8-sq", activation_scheme="outliers"), "activation_scheme"),
        (
            dict(algo="fp8", activation_scheme="static", outlier_modules=("*.mlp.down",)),
            "outlier_modules",
        ),
        (
            dict(algo="fp8", activation_scheme="outliers", outlier_modules="*.down"),
            "outlier_modules",
        ),
        (dict(algo="fp8", activation_scheme="outliers", outlier_modules=("",)), "outlier_modules"),
    ],
)
def test_quant_config_rejects_bad_outliers(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^quant\.{field}=.* is invalid: "):
        QuantConfig(**kwargs)
    assert QuantConfig(algo="fp8", activation_scheme="outliers").act_outliers == 64


def test_fp8_defaults_to_outlier_channels() -> None:
    """fp8 without a scheme splits 64 channels a projection (at most an eighth of its
    inputs); the other modes stay per token; the manifest keeps the resolved scheme."""
    from kiln.quant.passes import _act_outliers

    q = QuantConfig(algo="fp8")
    assert (q.activation_scheme, q.act_outliers, q.scheme_given) == ("outliers", 64, False)
    assert QuantConfig(algo="fp8", act_outliers=16).act_outliers == 16
    given = QuantConfig(algo="fp8", activation_scheme="dynamic")
    assert (given.activation_scheme, given.act_outliers, given.scheme_given) == (
        "dynamic",
        None,
        True,
    )
    for algo in (None, "int8-wo", "int4-awq", "w8a8-sq"):
        assert QuantConfig(algo=algo).activation_scheme == "dynamic"
    back = QuantConfig.from_dict(dataclasses.asdict(q))  # the manifest's record
    assert back == q and not back.scheme_given
    # a replaced config keeps whether its scheme was asked for (both ways)
    assert not dataclasses.replace(q, calib_tokens=32).scheme_given
    assert dataclasses.replace(given, calib_tokens=32).scheme_given
    # an older manifest (no record of it) reads as asked for, as those engines were built
    old = {k: v for k, v in dataclasses.asdict(q).items() if k != "scheme_defaulted"}
    assert QuantConfig.from_dict(old).scheme_given
    assert [_act_outliers(q, "x", k) for k in (4096, 576, 200, 64, 63)] == [64, 64, 24, 8, None]


@torch.no_grad()
@pytest.mark.parametrize(("kv", "mods"), [(None, ()), ("fp8", ()), (None, ("*.mlp.down",))])
def test_build_load_generate_with_outlier_channels(
    kv: str | None, mods: tuple[str, ...], tmp_path: Path
) -> None:
    hf = save_tiny_llama(tmp_path / "hf")
    build_engine(str(hf), tmp_path / "plain", BuildConfig(device="cpu"), progress=False)
    qcfg = QuantConfig(algo="fp8", activation_scheme="outliers", act_outliers=8,
                       kv_cache_dtype=kv, outlier_modules=mods)  # fmt: skip
    m = build_engine(str(hf), tmp_path / "o", BuildConfig(device="cpu", quant=qcfg), 0, False)
    assert m["quant"]["act_outliers"] == 8 and m["quant"]["applied"] == "build"
    assert m["quant"]["kv_cache_dtype"] == kv and ("kv_scales" in m["quant"]) == (kv == "fp8")
    assert tuple(m["quant"]["outlier_modules"]) == mods
    eng = load_engine(tmp_path / "o", "cpu")
    qls = {n: mod for n, mod in eng.model.named_modules() if isinstance(mod, QuantLinear)}
    split = {n for n, q in qls.items() if q.outlier_idx is not None}
    assert len(qls) == 8 and split == {n for n in qls if not mods or n.endswith("mlp.down")}
    assert all(qls[n].outlier_idx.shape == (8,) for n in split)
    assert all(q.weight.shape[1] == q.in_features + 16 * (n in split) for n, q in qls.items())
    ids = list(range(1, 40))
    unfused = prefill_logits(eng, ids)
    assert fuse_activation_quant(eng.model) == 6  # RMSNorm x 2 and SiLU-mul, 2 layers
    a, b = prefill_logits(eng, ids), prefill_logits(load_engine(tmp_path / "plain", "cpu"), ids)
    assert torch.equal(a, unfused)  # the fused producers write the same split columns
    assert torch.isfinite(a).all() and float((a - b).norm() / b.norm()) < 0.1
    from kiln.llm import LLM
    from kiln.sampling_params import SamplingParams

    out = LLM(tmp_path / "o", progress=False).generate([ids], SamplingParams(max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_cli_outlier_channels_on_a_dummy_model(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from kiln.cli import main

    out = str(tmp_path / "e")
    args = ["build", "--model", "dummy:tiny", "--output", out, "--device", "cpu", "--quant", "fp8"]
    assert main([*args, "--activation-scheme", "outliers", "--act-outliers", "8"]) == 0
    assert main(["inspect", out]) == 0
    assert "fp8 (outliers with 8 channels split activations" in capsys.readouterr().out
    eng = load_engine(out, "cpu")  # a dummy engine: quantized, and calibrated, at load
    assert prefill_logits(eng, list(range(20))).isfinite().all()
    assert main([*args, "--activation-scheme", "dynamic", "--act-outliers", "8"]) == 2
    assert "only --activation-scheme outliers keeps channels out" in capsys.readouterr().err
    out2 = str(tmp_path / "e2")
    args2 = ["--activation-scheme", "outliers", "--outlier-modules", "*.mlp.down,*.attn.o"]
    assert main([*args[:4], out2, *args[5:], *args2]) == 0
    assert main(["inspect", out2]) == 0
    assert "outliers with 64 channels split in *.mlp.down,*.attn.o" in capsys.readouterr().out
    assert main([*args, "--activation-scheme", "static", "--outlier-modules", "*.mlp.down"]) == 2
    assert "quant.outlier_modules='*.mlp.down' is invalid" in capsys.readouterr().err


@pytest.mark.gpu
@torch.no_grad()
def test_cuda_outlier_channels_match_the_reference() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    lin, _ = _outlier_linear(k=256, n=128)
    idx = torch.tensor([7, 100, 200, 31, 8, 9, 250, 128])
    x = _outliers(9, 256, seed=11)
    ref_layer = QuantLinear.from_linear(lin, "fp8", outlier_channels=idx)
    want = ref_layer(x)
    gpu = QuantLinear.from_linear(lin.to("cuda", torch.bfloat16), "fp8", outlier_channels=idx)
    got = gpu(x.to("cuda", torch.bfloat16)).float().cpu()
    assert float((got - want).norm() / want.norm()) < 2e-2


@torch.no_grad()
def test_gptq_leaves_outlier_columns_out() -> None:
    from kiln.quant.build import gptq_weights
    from kiln.quant.stats import decoder_linears

    model, weights = tiny_random_model()
    name = "layers.1.mlp.down"
    weights_big = dict(weights)
    weights_big[name] = weights[name].clone()
    weights_big[name][:, [4, 100]] = 5.0  # would set every row's fp8 scale if rounded
    stats = {n: {"amax": torch.tensor(1.0), "channel_amax": torch.arange(float(w.shape[1]))}
             for n, w in weights.items()}  # fmt: skip
    cols = [4, 100, 1, 2, 3, 5, 6, 7]
    stats[name]["channel_amax"] = torch.zeros(176)
    stats[name]["channel_amax"][cols] = torch.arange(8.0, 0.0, -1.0)
    qcfg = QuantConfig(algo="fp8", activation_scheme="outliers", act_outliers=8)
    windows = [list(range(1, 60)), list(range(60, 120))]
    out = gptq_weights(model, qcfg, windows, weights_big, None, stats)
    wq, scale = out[name]
    assert not bool(wq[:, cols].float().any())  # left to the split columns
    # the row scales still cover the outlier columns: their hi parts must fit in e4m3
    assert torch.equal(scale, weights_big[name].abs().amax(1) / 448.0)
    big = QuantLinear.from_linear(decoder_linears(model)[name], "fp8", rounded=out[name],
                                  outlier_channels=torch.tensor(cols))  # fmt: skip
    assert big.weight.shape == (64, 176 + 16) and bool(big.weight.float().isfinite().all())
    plain = gptq_weights(
        model, QuantConfig(algo="fp8", activation_scheme="dynamic"), windows, weights_big, None
    )
    assert bool((plain[name][1] >= 5.0 / 448.0).all())  # without: the big columns set it
