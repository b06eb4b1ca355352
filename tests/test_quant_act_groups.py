"""fp8 with "group" activations: one scale per token and per group of input channels
(``--activation-scheme group``). The reference arithmetic, QuantLinear, the configuration,
the build (group size resolved per model), the CLI, and the refusals where the GPU GEMM
does not exist yet. CPU only."""

from __future__ import annotations

import math
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
from kiln.quant import formats as qf
from kiln.quant.build import resolve_act_group
from kiln.quant.layers import QuantLinear, fuse_activation_quant
from tests.util import prefill_logits, save_tiny_llama


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
    with pytest.raises(ValueError, match="group=7 must divide the row length"):
        quantize_rows_ref(x, "fp8", group=7)


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


@torch.no_grad()
def test_quant_linear_group_forward_is_the_explicit_formula() -> None:
    lin = Linear(96, 40, bias=True, dtype=torch.float32, device="cpu")
    lin.weight.copy_(torch.randn(40, 96, generator=_gen(4)) * 0.1)
    lin.bias.copy_(torch.randn(40, generator=_gen(5)))
    q = QuantLinear.from_linear(lin, "fp8", act_group=32)
    assert q.act_group == 32 and q.act_kind is None and "act_group=32" in repr(q)
    x = _outliers(7, 96, seed=6)
    xq, xs = quantize_rows_ref(x, "fp8", group=32)
    w = q.weight.float() * q.weight_scale[:, None]
    want = F.linear(xq.float() * xs.repeat_interleave(32, dim=1), w) + lin.bias
    assert torch.equal(q(x), want)
    a = qf.quantize_act(x, None, "fp8", None, 32)
    assert torch.equal(qf.act_matmul_ref(a, q.weight, q.weight_scale, lin.bias, x.dtype), want)
    with pytest.raises(ConfigError, match=r"^quant\.act_group_size=.*in_features=96"):
        QuantLinear(96, 40, "fp8", act_group=64)
    with pytest.raises(ConfigError, match=r"^quant\.act_group_size="):
        QuantLinear(96, 40, "int8-wo", act_group=32)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(algo="fp8", act_group_size=64),  # needs activation_scheme="group"
        dict(algo="fp8", activation_scheme="group", act_group_size=48),
        dict(algo="fp8", activation_scheme="group", act_group_size=True),
        dict(algo="int8-wo", activation_scheme="group"),
    ],
)
def test_quant_config_rejects_bad_groups(kwargs: dict) -> None:
    field = "activation_scheme" if kwargs["algo"] != "fp8" else "act_group_size"
    with pytest.raises(ConfigError, match=rf"^quant\.{field}=.* is invalid: "):
        QuantConfig(**kwargs)


def test_group_size_resolved_per_model_and_refused_on_cuda() -> None:
    cfg = DummyCheckpoint("tiny", {}).config  # inputs 64 (qkv, o, gate_up) and 176 (down)
    group = QuantConfig(algo="fp8", activation_scheme="group")
    assert resolve_act_group(group, cfg, "cpu").act_group_size == 16  # 176 = 11 x 16
    no_down = QuantConfig(algo="fp8", activation_scheme="group", exclude_modules=("*.down",))
    assert resolve_act_group(no_down, cfg, "cpu").act_group_size == 64
    asked = QuantConfig(algo="fp8", activation_scheme="group", act_group_size=32)
    with pytest.raises(ConfigError, match=r"in_features=176 of layers\.0\.mlp\.down"):
        resolve_act_group(asked, cfg, "cpu")
    with pytest.raises(ConfigError, match="runs on the CPU only"):
        resolve_act_group(group, cfg, "cuda")
    plain = QuantConfig(algo="fp8")
    assert resolve_act_group(plain, cfg, "cuda") is plain


@torch.no_grad()
def test_build_load_generate_with_group_activations(tmp_path: Path) -> None:
    hf = save_tiny_llama(tmp_path / "hf")
    plain = build_engine(str(hf), tmp_path / "plain", BuildConfig(device="cpu"), progress=False)
    assert plain["quant"]["activation_scheme"] == "dynamic"
    qcfg = QuantConfig(algo="fp8", activation_scheme="group")
    m = build_engine(str(hf), tmp_path / "g", BuildConfig(device="cpu", quant=qcfg), 0, False)
    assert m["quant"]["act_group_size"] == 64  # inputs 64 and 128: the default 128 halved
    quality = m["quant"]["quality"]  # the gate measured the engine as it runs
    assert math.isfinite(quality["ppl_increase_pct"]) and quality["mean_kl"] > 0
    assert 0 < quality["top1_agreement"] <= 1
    eng = load_engine(tmp_path / "g", "cpu")
    qls = [mod for mod in eng.model.modules() if isinstance(mod, QuantLinear)]
    assert len(qls) == 8 and all(q.act_group == 64 for q in qls)
    assert fuse_activation_quant(eng.model) == 0  # each projection quantizes its own input
    ids = list(range(1, 40))
    a, b = prefill_logits(eng, ids), prefill_logits(load_engine(tmp_path / "plain", "cpu"), ids)
    assert torch.isfinite(a).all() and float((a - b).norm() / b.norm()) < 0.1
    from kiln.llm import LLM
    from kiln.sampling_params import SamplingParams

    out = LLM(tmp_path / "g", progress=False).generate([ids], SamplingParams(max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_cli_group_activations(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from kiln.cli import main

    out = str(tmp_path / "e")
    args = ["build", "--model", "dummy:tiny", "--output", out, "--device", "cpu", "--quant", "fp8"]
    assert main([*args, "--activation-scheme", "group"]) == 0
    assert main(["inspect", out]) == 0
    assert "fp8 (group of 16 channels activations" in capsys.readouterr().out
    assert main([*args, "--activation-scheme", "group", "--act-group-size", "32"]) == 2
    assert "quant.act_group_size=32 is invalid" in capsys.readouterr().err
    assert main([*args, "--act-group-size", "32"]) == 2
    assert "only --activation-scheme group uses a group size" in capsys.readouterr().err
