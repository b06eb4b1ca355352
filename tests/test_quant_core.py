"""Quantized engines, the core: number formats, QuantLinear, QuantConfig, build and load.
CPU references only; the CUDA paths are checked against them by the gpu-marked test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from kiln.build.builder import build_engine
from kiln.build.loader import load_engine
from kiln.config import DEFAULT_CALIB_TOKENS, BuildConfig, QuantConfig
from kiln.errors import ConfigError
from kiln.kernels.quant_act import quantize_rows_ref
from kiln.layers.linear import Linear
from kiln.models import build_model
from kiln.quant import formats as qf
from kiln.quant.layers import QuantLinear
from kiln.quant.passes import quantize_model
from tests.util import prefill_logits, save_tiny_llama

ALGOS = ("fp8", "int8-wo", "int4-awq", "w8a8-sq")
FP8 = torch.float8_e4m3fn


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- formats


def test_fp8_weight_round_trip_error_bound() -> None:
    w = torch.randn(48, 96, generator=_gen()) * torch.rand(48, 1, generator=_gen(1)) * 3
    q, s = qf.quantize_fp8_weight(w)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (48,)
    assert torch.allclose(s, w.abs().amax(dim=1) / 448.0)
    err = (qf.dequantize_rows(q, s) - w).abs()
    # e4m3: 3 mantissa bits (relative half-ulp 2^-4); subnormal step 2^-9 of the scale
    bound = torch.maximum(w.abs() * 2**-4, s[:, None] * 2**-10) * 1.0001
    assert bool((err <= bound).all())
    assert qf.dequantize_rows(q, s).abs().amax(dim=1).allclose(w.abs().amax(dim=1))


def test_fp8_activation_per_token_and_static() -> None:
    x = torch.randn(7, 64, generator=_gen(2)) * 5
    q, s = quantize_rows_ref(x, "fp8")  # per-token activations
    assert s.shape == (7, 1)
    err = (q.float() * s - x).abs()
    assert bool((err <= torch.maximum(x.abs() * 2**-4, s * 2**-10) * 1.0001).all())
    scale = qf.fp8_static_scale(x.abs().amax())
    assert scale.shape == () and scale.dtype == torch.float32
    big = qf.quantize_fp8(x * 10, scale)  # out of the calibrated range: saturates, no NaN
    assert not bool(big.float().isnan().any()) and big.float().abs().max() == 448.0


def test_int8_round_trip_error_bound() -> None:
    w = torch.randn(32, 80, generator=_gen(3))
    q, s = qf.quantize_int8_weight(w)
    assert q.dtype == torch.int8 and s.shape == (32,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    err = (qf.dequantize_rows(q, s) - w).abs()
    assert bool((err <= s[:, None] / 2 * 1.0001).all())
    xq, xs = quantize_rows_ref(w, "int8")
    assert xs.shape == (32, 1) and torch.equal(xq, q)


@pytest.mark.parametrize("group", [16, 32, 80])
def test_int4_round_trip_error_bound(group: int) -> None:
    w = torch.randn(24, 160, generator=_gen(4)) + 0.3
    q, s, z = qf.quantize_int4(w, group)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert s.shape == z.shape == (24, 160 // group) and z.dtype == torch.uint8
    err = (qf.dequantize_int4(q, s, z) - w).abs().reshape(24, -1, group)
    assert bool((err <= s[..., None] / 2 * 1.0001 + 1e-7).all())
    assert torch.equal(qf.dequantize_int4(q, s, z)[w == 0], w[w == 0])  # 0 stays exact
    with pytest.raises(ValueError, match="does not divide"):
        qf.quantize_int4(w, 48)


def test_int4_pack_unpack_exact() -> None:
    q = torch.randint(0, 16, (9, 34), generator=_gen(5), dtype=torch.uint8)
    p = qf.pack_int4(q)
    assert p.shape == (9, 17) and p.dtype == torch.uint8
    assert torch.equal(qf.unpack_int4(p), q)
    assert qf.pack_int4(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)).tolist() == [[0x21, 0x0F]]
    every = torch.arange(256, dtype=torch.uint8).reshape(1, 256)
    assert torch.equal(qf.pack_int4(qf.unpack_int4(every)), every)


# ---------------------------------------------------------------- QuantLinear vs formulas


def _linear(k: int, n: int, bias: bool, seed: int = 6) -> Linear:
    lin = Linear(k, n, bias=bias, dtype=torch.float32)
    lin.weight.copy_(torch.randn(n, k, generator=_gen(seed)) * 0.05)
    if bias:
        lin.bias.copy_(torch.randn(n, generator=_gen(seed + 1)) * 0.1)
    return lin


def _fp8_dq(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (t / s).clamp(-448, 448).to(FP8).float() * s


@torch.no_grad()
@pytest.mark.parametrize("bias", [False, True])
def test_quant_linear_matches_explicit_formulas(bias: bool) -> None:
    k, n = 64, 48
    lin = _linear(k, n, bias)
    w, b = lin.weight.clone(), (lin.bias.clone() if bias else torch.zeros(n))
    x = torch.randn(5, k, generator=_gen(8))
    ref = F.linear(x, w, lin.bias)
    smooth = torch.rand(k, generator=_gen(9)) + 0.5

    # fp8, dynamic per-token activations
    ws = w.abs().amax(1, keepdim=True) / 448
    xs = x.abs().amax(1, keepdim=True) / 448
    want = _fp8_dq(x, xs) @ _fp8_dq(w, ws).T + b
    got = QuantLinear.from_linear(lin, "fp8")(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (got - ref).norm() / ref.norm() < 0.08

    # fp8, static per-tensor activation scale from a calibrated amax
    amax = torch.tensor(3.0)
    q = QuantLinear.from_linear(lin, "fp8", input_amax=amax)
    want = _fp8_dq(x, amax / 448) @ _fp8_dq(w, ws).T + b
    torch.testing.assert_close(q(x), want, rtol=1e-6, atol=1e-6)
    assert q.input_scale.shape == ()

    # int8 weight-only
    ws = w.abs().amax(1, keepdim=True) / 127
    want = x @ (torch.round(w / ws) * ws).T + b
    got = QuantLinear.from_linear(lin, "int8-wo")(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (got - ref).norm() / ref.norm() < 0.02

    # w8a8 with smoothing: x / s per token to int8, (w * s) per channel to int8
    xs_ = x / smooth
    ws = (w * smooth).abs().amax(1, keepdim=True) / 127
    xsc = xs_.abs().amax(1, keepdim=True) / 127
    want = (torch.round(xs_ / xsc) * xsc) @ (torch.round(w * smooth / ws) * ws).T + b
    got = QuantLinear.from_linear(lin, "w8a8-sq", smooth=smooth)(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (got - ref).norm() / ref.norm() < 0.03

    # int4, groups of 16 along K, asymmetric, AWQ-style scales
    g = (w * smooth).reshape(n, k // 16, 16)
    lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
    sc = qf.f16_grid_up((hi - lo) / 15)  # the smallest float16 at least the range / 15
    z = torch.round(-lo / sc)
    wd = ((torch.round(g / sc) + z).clamp(0, 15) - z) * sc
    want = (x / smooth) @ wd.reshape(n, k).T + b
    q = QuantLinear.from_linear(lin, "int4-awq", group_size=16, smooth=smooth)
    torch.testing.assert_close(q(x), want, rtol=1e-5, atol=1e-6)
    assert (q(x) - ref).norm() / ref.norm() < 0.2
    assert q.weight.shape == (n, k // 2) and q.weight_zero.shape == (n, k // 16)
    rtn = QuantLinear.from_linear(lin, "int4-awq", group_size=16)  # no AWQ scales: RTN
    assert torch.equal(rtn.smooth, torch.ones(k))


def test_quant_linear_state_names_and_dtypes() -> None:
    lin = _linear(64, 32, bias=True)
    want = {
        "fp8": {"weight": FP8, "weight_scale": torch.float32, "bias": torch.float32},
        "int8-wo": {"weight": torch.int8, "weight_scale": torch.float32, "bias": torch.float32},
        "w8a8-sq": {
            "weight": torch.int8,
            "weight_scale": torch.float32,
            "smooth": torch.float32,
            "bias": torch.float32,
        },
        "int4-awq": {
            "weight": torch.uint8,
            "weight_scale": torch.float16,  # on float16's grid (formats.int4_fit)
            "weight_zero": torch.uint8,
            "smooth": torch.float32,
            "bias": torch.float32,
        },
    }
    for algo, names in want.items():
        q = QuantLinear.from_linear(lin, algo, group_size=32 if algo == "int4-awq" else None)
        assert {k: v.dtype for k, v in q.state_dict().items()} == names, algo


# ---------------------------------------------------------------- QuantConfig


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(algo="int3"), "quant.algo"),
        (dict(kv_cache_dtype="int8"), "quant.kv_cache_dtype"),
        (dict(algo="fp8", group_size=64), "quant.group_size"),
        (dict(algo="int4-awq", group_size=7), "quant.group_size"),
        (dict(algo="int4-awq", group_size=0), "quant.group_size"),
        (dict(algo="fp8", activation_scheme="per-block"), "quant.activation_scheme"),
        (dict(algo="int8-wo", activation_scheme="static"), "quant.activation_scheme"),
        (dict(algo="w8a8-sq", sq_alpha=1.5), "quant.sq_alpha"),
        (dict(algo="w8a8-sq", sq_alpha=True), "quant.sq_alpha"),
        (dict(algo="fp8", exclude_modules="layers.0.*"), "quant.exclude_modules"),
        (dict(algo="fp8", exclude_modules=("",)), "quant.exclude_modules"),
        (dict(algo="fp8", weight_rounding="stochastic"), "quant.weight_rounding"),
        (dict(algo="w8a8-sq", weight_rounding="gptq"), "quant.weight_rounding"),
        (dict(algo="fp8", calib_tokens=0), "quant.calib_tokens"),
        (dict(algo="fp8", calib_tokens=2048.0), "quant.calib_tokens"),
        (dict(algo="fp8", calib_tokens=True), "quant.calib_tokens"),
    ],
)
def test_quant_config_rejects(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}=.* is invalid: "):
        QuantConfig(**kwargs)


def test_quant_config_defaults_and_group_error_names_module() -> None:
    assert QuantConfig(algo="int4-awq").group_size == 128
    assert QuantConfig(algo="fp8").weight_rounding == "gptq"  # the default where it applies
    assert QuantConfig(algo="int8-wo").weight_rounding is None
    assert QuantConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    assert QuantConfig(algo="fp8").calib_tokens == DEFAULT_CALIB_TOKENS
    assert QuantConfig(algo="fp8", exclude_modules=["*.down"]).exclude_modules == ("*.down",)
    cfg = QuantConfig.from_dict({"algo": "fp8", "report": {}, "applied": "build"})
    assert cfg.algo == "fp8"
    from kiln.checkpoint.dummy import DummyCheckpoint

    model = build_model(DummyCheckpoint("tiny", {}).config, torch.float32, "meta")
    with pytest.raises(ConfigError, match=r"in_features=64 of layers\.0\.attn\.qkv"):
        quantize_model(model, QuantConfig(algo="int4-awq"))  # 176 and 64 are not 128-aligned
    with pytest.raises(ConfigError, match="calibration statistics"):
        quantize_model(model, QuantConfig(algo="fp8", activation_scheme="static"))


# ---------------------------------------------------------------- build, load, generate


def _qcfg(algo: str, **kw: object) -> QuantConfig:
    return QuantConfig(algo=algo, group_size=16 if algo == "int4-awq" else None, **kw)


def _types(engine) -> dict[str, str]:
    return {
        n: type(m).__name__
        for n, m in engine.model.named_modules()
        if isinstance(m, Linear | QuantLinear)
    }


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def hf_plain(tiny_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("e") / "plain"
    build_engine(str(tiny_hf), out, BuildConfig(device="cpu"), progress=False)
    return out


@pytest.mark.parametrize(
    "algo,scheme", [("fp8", "dynamic"), ("fp8", "static"), *((a, "dynamic") for a in ALGOS[1:])]
)
def test_build_load_generate_hf(
    algo: str, scheme: str, tiny_hf: Path, hf_plain: Path, tmp_path: Path
) -> None:
    exclude = ("layers.0.*", "*.down")
    qcfg = _qcfg(algo, activation_scheme=scheme, exclude_modules=exclude)
    m = build_engine(str(tiny_hf), tmp_path / "e", BuildConfig(device="cpu", quant=qcfg), 0, False)
    assert m["quant"]["algo"] == algo and m["quant"]["applied"] == "build"
    assert m["quant"]["report"]["modules"] == [
        "layers.1.attn.qkv",
        "layers.1.attn.o",
        "layers.1.mlp.gate_up",
    ]
    eng = load_engine(tmp_path / "e", "cpu")
    types = _types(eng)
    assert types["layers.0.attn.qkv"] == types["layers.1.mlp.down"] == "Linear"
    assert types["layers.1.attn.qkv"] == types["layers.1.mlp.gate_up"] == "QuantLinear"
    with safe_open(str(tmp_path / "e" / "rank0.safetensors"), "pt") as f:
        assert f.get_slice("layers.0.mlp.gate_up.weight").get_dtype() == "F32"
        want = {"fp8": "F8_E4M3", "int4-awq": "U8"}.get(algo, "I8")
        assert f.get_slice("layers.1.mlp.gate_up.weight").get_dtype() == want
        want = "F16" if algo == "int4-awq" else "F32"  # int4: 2 bytes a group
        assert f.get_slice("layers.1.mlp.gate_up.weight_scale").get_dtype() == want
    if algo == "int4-awq":  # scales on float16's grid at build, stored and held in float16
        assert eng.model.get_submodule("layers.1.attn.qkv").weight_scale.dtype == torch.float16
    plain = load_engine(hf_plain, "cpu")
    ids = list(range(1, 40))
    a, b = prefill_logits(eng, ids), prefill_logits(plain, ids)
    assert torch.isfinite(a).all()
    assert float((a - b).norm() / b.norm()) < 0.1
    from kiln.llm import LLM
    from kiln.sampling_params import SamplingParams

    out = LLM(tmp_path / "e", progress=False).generate([ids], SamplingParams(max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_quantized_engine_is_smaller(tiny_hf: Path, hf_plain: Path, tmp_path: Path) -> None:
    def size(p: Path) -> int:
        return (p / "rank0.safetensors").stat().st_size

    sizes = {}
    for algo in ("fp8", "int4-awq"):
        gs = 32 if algo == "int4-awq" else None  # smaller groups: scales weigh more
        # fp8 per token: the plain weight (the default's outlier columns are 2C more)
        scheme = "dynamic" if algo == "fp8" else None
        q = QuantConfig(algo=algo, group_size=gs, activation_scheme=scheme)
        cfg = BuildConfig(device="cpu", quant=q)
        m = build_engine(str(tiny_hf), tmp_path / algo, cfg, progress=False)
        r = m["quant"]["report"]
        sizes[algo] = (size(tmp_path / algo), r["linear_bytes_after"] / r["linear_bytes_before"])
    # float32 engine: fp8 stores a quarter of the linear weights plus scales, int4 an eighth
    assert 0.25 < sizes["fp8"][1] < 0.27 and 0.125 < sizes["int4-awq"][1] < 0.2
    assert size(hf_plain) > sizes["fp8"][0] > sizes["int4-awq"][0]


@pytest.mark.parametrize("algo,scheme", [("fp8", "static"), *((a, "dynamic") for a in ALGOS)])
def test_dummy_engine_quantized_at_load(algo: str, scheme: str, tmp_path: Path) -> None:
    qcfg = _qcfg(algo, activation_scheme=scheme, exclude_modules=("*.o",))
    m = build_engine("dummy:tiny", tmp_path / "e", BuildConfig(device="cpu", quant=qcfg), 3, False)
    assert m["quant"]["applied"] == "load" and "rank0.safetensors" not in m["files"]
    assert m["quant"]["weight_rounding"] in (None, "nearest")  # no GPTQ at load
    assert m["quant"]["report"]["excluded"] == ["layers.0.attn.o", "layers.1.attn.o"]
    eng = load_engine(tmp_path / "e", "cpu")
    types = _types(eng)
    assert types["layers.0.attn.o"] == "Linear" and types["layers.1.mlp.down"] == "QuantLinear"
    logits = prefill_logits(eng, list(range(20)))
    assert logits.shape == (20, 512) and bool(torch.isfinite(logits).all())


def test_cli_build_quant_and_inspect(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from kiln.cli import main

    out = str(tmp_path / "e")
    args = ["build", "--model", "dummy:tiny", "--output", out, "--device", "cpu"]
    args += ["--quant", "int4-awq", "--group-size", "16", "--exclude-modules", "layers.0.*, *.down"]
    assert main([*args, "--kv-cache-dtype", "fp8"]) == 0
    assert main(["inspect", out]) == 0
    text = capsys.readouterr().out
    assert "quantization int4-awq (group 16, 3 modules, 5 excluded" in text
    assert "KV cache fp8" in text
    assert main(["build", "--model", "dummy:tiny", "--output", out, "--quant", "int4-awq"]) == 2
    err = capsys.readouterr().err  # refused before the build starts, with a group that fits
    assert "quant.group_size=128 is invalid" in err and "--group-size 16 fits" in err, err


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ALGOS)
def test_cuda_paths_match_references(algo: str) -> None:
    lin = _linear(256, 512, bias=True)
    q = QuantLinear.from_linear(lin, algo, group_size=128 if algo == "int4-awq" else None)
    _cuda_matches_reference(q, algo)


def _cuda_matches_reference(q: QuantLinear, label: str) -> None:
    """``q`` on the GPU's kernels (bfloat16 inputs) within 2 % of its CPU reference."""
    for m in (1, 7, 64):
        x = torch.randn(m, 256, generator=_gen(m)).to(torch.bfloat16)
        want = q(x.float()).float()
        got = q.to("cuda")(x.cuda()).float().cpu()
        q.to("cpu")
        assert float((got - want).norm() / want.norm()) < 2e-2, (label, m)


def _permuted(algo: str) -> tuple[QuantLinear, QuantLinear]:
    """A weight-only layer, and the same weights stored with permuted input columns and
    the permutation as ``input_perm`` (an act-order checkpoint's layout)."""
    lin = _linear(256, 512, bias=True)
    gs = 128 if algo == "int4-awq" else None
    perm = torch.randperm(256, generator=_gen(5))
    lin_p = _linear(256, 512, bias=True)
    lin_p.weight.copy_(lin.weight[:, perm])
    lin_p.bias.copy_(lin.bias)
    q = QuantLinear.from_linear(lin_p, algo, group_size=gs)
    q.expect_input_perm()
    q.input_perm.copy_(perm)
    return QuantLinear.from_linear(lin, algo, group_size=gs), q


@torch.no_grad()
def test_input_perm_gathers_x_to_the_stored_column_order() -> None:
    """int8-wo rounds per row, so permuting the columns changes no code: the act-order
    layer equals the plain one up to float32 summation order."""
    plain, q = _permuted("int8-wo")
    x = torch.randn(7, 256, generator=_gen(1))
    assert torch.allclose(q(x), plain(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="weight-only"):
        QuantLinear.from_linear(_linear(256, 512, bias=False), "fp8").expect_input_perm()


@torch.no_grad()
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("algo", ["int8-wo", "int4-awq"])
def test_input_perm_on_cuda(algo: str) -> None:
    """Act-order layers on the GPU's kernels against the CPU reference of the same layer,
    and inside a CUDA graph (the gather is captured too)."""
    _, q = _permuted(algo)
    _cuda_matches_reference(q, algo)
    q.to("cuda")
    x = torch.randn(8, 256, generator=_gen(8)).to(torch.bfloat16).cuda()
    q(x)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = q(x)
    x.copy_(torch.randn(8, 256, generator=_gen(9)).to(torch.bfloat16))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, q(x))


@torch.no_grad()
@pytest.mark.parametrize("algo", ALGOS)
def test_fused_activation_quant_changes_nothing(algo: str, tmp_path: Path) -> None:
    """Loading fuses the per-token activation quantization into RMSNorm / SiLU-mul (fp8,
    w8a8-sq): the logits are identical with the fusion switched off, and weight-only modes
    fuse nothing."""
    from kiln.quant.passes import fuse_activation_quant

    qcfg = _qcfg(algo, exclude_modules=("layers.1.mlp.down",))
    build_engine("dummy:tiny", tmp_path / "e", BuildConfig(device="cpu", quant=qcfg), 3, False)
    eng = load_engine(tmp_path / "e", "cpu")
    fused = prefill_logits(eng, list(range(25)))
    n = fuse_activation_quant(eng.model, enable=False)
    assert n == 0
    plain = prefill_logits(eng, list(range(25)))
    assert torch.equal(fused, plain)
    want = 5 if algo in ("fp8", "w8a8-sq") else 0  # 2 layers x 3, one down excluded
    assert fuse_activation_quant(eng.model) == want
    assert eng.model.layers[1].mlp.fuse_down_quant is False


def test_weight_rounding_nearest_or_gptq(tiny_hf: Path, tmp_path: Path) -> None:
    """``--weight-rounding nearest`` stores exactly the round-to-nearest weights; the default
    (GPTQ) rounds some of them the other way; the manifest records which."""
    from kiln.cli import main

    src = str(tiny_hf)
    for wr in ("nearest", None):
        args = ["build", "--model", src, "--output", str(tmp_path / str(wr)), "--quant", "fp8",
                "--activation-scheme", "dynamic"]  # fmt: skip
        assert main(args + (["--weight-rounding", wr] if wr else [])) == 0
    with safe_open(str(tmp_path / "nearest" / "rank0.safetensors"), "pt") as f:
        near = f.get_tensor("layers.1.mlp.down.weight").float()
    with safe_open(str(tmp_path / "None" / "rank0.safetensors"), "pt") as f:
        gptq = f.get_tensor("layers.1.mlp.down.weight").float()
    with safe_open(str(tiny_hf / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.1.mlp.down_proj.weight").float()
    # the build quantizes the weight in the engine's dtype (float32 on a CPU, bfloat16 on
    # CUDA by default) on its device (on the H200, 8 of 8,192 codes rounded by CPU
    # arithmetic differed)
    import json

    dtype = json.loads((tmp_path / "nearest" / "manifest.json").read_text())["dtype"]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    want = qf.quantize_fp8_weight(w.to(dev, getattr(torch, dtype)))[0].float().cpu()
    assert torch.equal(near, want), f"{(near != want).sum()} of {near.numel()} differ"
    assert not torch.equal(gptq, near)
    man = json.loads((tmp_path / "None" / "manifest.json").read_text())
    assert man["quant"]["weight_rounding"] == "gptq"
    near_man = json.loads((tmp_path / "nearest" / "manifest.json").read_text())
    assert near_man["quant"]["weight_rounding"] == "nearest"
