"""fp8 per-token scale search (``--act-scale-search``): the reference's choice, and the
Triton quantizers (alone, fused into RMSNorm and into SiLU-and-mul, with smoothing and
with outlier columns) against it, on fresh random inputs of odd sizes. Interpreter on the
CPU, compiled on a GPU.

On the CPU (float32 under the interpreter) the kernels pick exactly the reference's scale
and codes: they score the candidates with its scalar arithmetic, in its order. On a GPU
in bfloat16 a fused op's output may differ from torch's by an ulp, which can move a row's
pick; there every row's scale must still be one of its candidates and at least 99 % of
the rows must pick as the reference does."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import quant_act as qa

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV == "cuda" else [])
ROWS = [(1, 16), (3, 577), (7, 1536)] + ([(257, 4096), (100, 14336)] if DEV == "cuda" else [])
E4M3 = torch.float8_e4m3fn


def _sq_err(x: torch.Tensor, a: qa.QuantAct) -> torch.Tensor:
    """Per row, the squared error of the dequantized first K columns against x."""
    k = x.shape[1]
    return ((a.q[:, :k].float() * a.scale - x.float()) ** 2).sum(dim=1)


def _check(got: qa.QuantAct, ref: qa.QuantAct, search: int, s0: torch.Tensor,
           exact: bool = False) -> None:  # fmt: skip
    """``s0``: the unsearched reference's scales (each row's amax / 448), of which every
    candidate is a multiple. ``exact`` (the quantizer alone on the CPU): the same scales
    and codes.
    Otherwise the fused ops' outputs may differ from torch's by an ulp, so a row's amax
    too: its scale must agree with the reference's to 2^-7 (the same candidate) on every
    row on the CPU and on 99 % of the rows on a GPU, the others being candidates of the
    same amax; and 99 % of the codes of the agreeing rows must match."""
    assert got.q.dtype == ref.q.dtype and got.q.shape == ref.q.shape
    assert got.scale.shape == ref.scale.shape == (ref.q.shape[0], 1)
    if exact and DEV == "cpu":
        assert torch.equal(got.scale, ref.scale)  # and the codes (-0 and +0 alike)
        assert torch.equal(got.q.float(), ref.q.float())
        return
    same_row = ((got.scale - ref.scale).abs() <= ref.scale * 2**-7).reshape(-1)
    # counted in integers: 99 of 100 rows is 0.99, which float32's mean rounds below 0.99
    n = same_row.numel()
    assert int(same_row.sum()) >= (n if DEV == "cpu" else -(-99 * n // 100))
    # every pick is a candidate s0 * (1 + j / search) of about the same s0: the same to
    # 2^-7 on the CPU; on a GPU a bfloat16 row's amax may be one ulp off, up to 2^-7 of it
    # (the candidates are 1 / search >= 2^-4 apart)
    # (s0 is given, not inferred from the row's top code: 448 / (1 + j / 8) rounds to the
    # same e4m3 code, 288, for j = 4 and 5, which failed on the H100 at d9c4d7f)
    ratio = (got.scale / s0).reshape(-1, 1)
    cands = 1 + torch.arange(search, device=DEV).float() / search
    tol = 2**-7 if DEV == "cpu" else 2**-6
    assert bool(((ratio - cands).abs().min(dim=1).values <= tol).all())
    rows = same_row.nonzero().reshape(-1)
    same = (got.q[rows].view(torch.uint8) == ref.q[rows].view(torch.uint8)).float().mean()
    assert same.item() >= 0.99


def _rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=g) * (
        torch.rand(m, 1, device=DEV, generator=g) * 10
    )
    x[:, k // 3] *= 30.0  # a channel far above the rest, as LLM activations have
    return x.to(dtype)


@pytest.mark.parametrize("search", [2, 4, 16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", ROWS)
def test_quantize_rows_search(search: int, dtype: torch.dtype, m: int, k: int) -> None:
    x = _rows(m, k, dtype, m * k + search)
    for smooth in (None, torch.rand(k, device=DEV) * 4 + 0.25):
        got = qa.quantize_rows_triton(x, "fp8", smooth, None, search)
        s0 = qa.quantize_rows_ref(x, "fp8", smooth).scale
        _check(got, qa.quantize_rows_ref(x, "fp8", smooth, search=search), search, s0,
               exact=True)  # fmt: skip


@pytest.mark.parametrize("search", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", ROWS)
def test_fused_search(search: int, dtype: torch.dtype, m: int, k: int) -> None:
    x = _rows(m, k, dtype, 7 * k + search)
    g = torch.Generator(device=DEV).manual_seed(m + k + search)  # not the test order's
    w = (torch.rand(k, device=DEV, generator=g) + 0.5).to(dtype)
    r = torch.randn(m, k, device=DEV, generator=g).to(dtype)
    (got, got_r), (ref, ref_r) = (
        f(x, w, 1e-5, r, "fp8", None, None, search)
        for f in (qa.rms_norm_quant_triton, qa.rms_norm_quant_ref)
    )
    _check(got, ref, search, qa.rms_norm_quant_ref(x, w, 1e-5, r, "fp8")[0].scale)
    assert torch.equal(got_r, ref_r)
    h = (torch.randn(m, 2 * k, device=DEV, generator=g) * 3).to(dtype)
    got = qa.silu_and_mul_quant_triton(h, "fp8", None, None, search)
    _check(got, qa.silu_and_mul_quant_ref(h, "fp8", None, None, search), search,
           qa.silu_and_mul_quant_ref(h, "fp8").scale)  # fmt: skip


@pytest.mark.parametrize("m,k,c", [(3, 577, 8), (5, 1536, 16)] + (
    [(100, 14336, 32)] if DEV == "cuda" else []))  # fmt: skip
def test_search_with_outlier_columns(m: int, k: int, c: int) -> None:
    """The outlier channels' lo / hi columns are taken on the searched scale."""
    o = torch.randperm(k, device=DEV)[:c].sort().values
    x = _rows(m, k, torch.float32, k + c)
    x[:, o[:2]] *= 100.0
    got = qa.quantize_rows_triton(x, "fp8", None, o, 8)
    ref = qa.quantize_rows_ref(x, "fp8", outliers=o, search=8)
    # the row's K columns and scale exactly; lo / hi as test_quant_act's outlier checks do
    s0 = qa.quantize_rows_ref(x, "fp8", outliers=o).scale
    _check(qa.QuantAct(got.q[:, :k], got.scale), qa.QuantAct(ref.q[:, :k], ref.scale), 8, s0,
           exact=True)  # fmt: skip
    whole = [(a.q[:, k : k + c].float() + a.q[:, k + c :].float()) * a.scale for a in (got, ref)]
    assert bool(((whole[0] - whole[1]).abs() <= whole[1].abs() * 2**-7 + ref.scale * 2**-9).all())
    assert torch.equal(ref.q[:, k + c :].view(torch.uint8), ref.q[:, o].view(torch.uint8))
    two = (ref.q[:, k : k + c].float() + ref.q[:, k + c :].float()) * ref.scale
    assert bool(((two - x[:, o]).abs() <= x[:, o].abs() * 2**-8 + ref.scale * 2**-10).all())


def test_search_picks_the_least_error_candidate() -> None:
    """The reference's scale is the candidate under which the row's four largest distinct
    magnitudes round with the least squared error (checked in float64, to within float32
    noise) and exactly one of the candidates; ``search=0`` is the plain per-token
    quantization. On rows whose squared norm sits in a few channels, as LLM activations'
    does, the whole row's squared error falls by a third to a half (measured 0.62 / 0.50 /
    0.44 at 4 / 8 / 16 candidates; 2 gain nothing); on Gaussian rows by about 2 %."""
    torch.manual_seed(3)
    x = torch.randn(300, 333) * torch.rand(300, 1) * 5
    x[:, 7] *= 40.0
    x[0, :] = 1.0  # one distinct magnitude only
    plain = qa.quantize_rows_ref(x, "fp8")
    assert torch.equal(qa.quantize_rows_ref(x, "fp8", search=0).scale, plain.scale)
    s0 = x.abs().amax(dim=1, keepdim=True) / 448.0
    tops = torch.stack([
        torch.nn.functional.pad(r.abs().unique().flip(0)[:4], (0, 4))[:4] for r in x
    ]).double()  # fmt: skip
    y = torch.randn(300, 333)
    y[:, :6] *= torch.tensor([80.0, 50.0, 30.0, 20.0, 12.0, 8.0])
    for n, gain in ((2, 1.01), (4, 0.7), (8, 0.6), (16, 0.5)):
        a = qa.quantize_rows_ref(x, "fp8", search=n)
        cands = torch.cat([s0 * (1.0 + j / n) for j in range(n)], dim=1)
        assert bool((a.scale == cands).any(dim=1).all())  # exactly one of them
        v = (tops[:, None, :] / cands.double()[:, :, None]).float()
        err = ((v.to(E4M3).double() - v.double()) ** 2).sum(-1) * cands.double() ** 2
        got = err.gather(1, (a.scale == cands).float().argmax(1, keepdim=True)).squeeze(1)
        assert bool((got <= err.min(1).values * (1 + 1e-4) + 1e-30).all())
        assert _sq_err(x, a).mean() <= 1.01 * _sq_err(x, plain).mean()
        ya, yp = qa.quantize_rows_ref(y, "fp8", search=n), qa.quantize_rows_ref(y, "fp8")
        assert _sq_err(y, ya).mean() <= gain * _sq_err(y, yp).mean()
        # a constant row stays (near) exact: 448 or another e4m3 value of no error
        assert torch.allclose(a.q[0].float() * a.scale[0], x[0], rtol=1e-6, atol=0)


def test_search_zero_rows_and_refusals() -> None:
    x = torch.zeros(3, 40, device=DEV)
    got = qa.quantize_rows_triton(x, "fp8", None, None, 4)
    assert not got.q.float().any() and bool((got.scale > 0).all())
    # rows of fewer than four distinct magnitudes: constant, two values, one value and 0s
    few = torch.ones(3, 40, device=DEV)
    few[1, ::2] = -3.0
    few[2, 1:] = 0.0
    for n in (2, 8):
        _check(qa.quantize_rows_triton(few, "fp8", None, None, n),
               qa.quantize_rows_ref(few, "fp8", search=n), n,
               qa.quantize_rows_ref(few, "fp8").scale, exact=True)  # fmt: skip
    assert qa.quantize_rows_triton(x[:0], "fp8", None, None, 4).q.shape == (0, 40)
    for bad in (3, 1, 32, -2):
        with pytest.raises(ValueError, match="search="):
            qa.quantize_rows_ref(x, "fp8", search=bad)
    with pytest.raises(ValueError, match="fp8 quantization only"):
        qa.quantize_rows_ref(x, "int8", search=4)
    with pytest.raises(ValueError, match="fp8 quantization only"):
        qa.quantize_rows_triton(x, "int8", None, None, 4)
    with pytest.raises(ValueError, match="fp8 quantization only"):
        qa.quantize_rows_ref(x, "int8", group=8, search=4)


def test_search_compiles_for_sm90_without_spills() -> None:
    """Without a GPU: SiLU·mul + fp8 quantization of a 14,336-wide row compiled for sm_90
    with 0, 2, 4 and 8 candidates, as launched (with a search, no contracted multiply-adds):
    no division an element (the candidates' reciprocals and the chosen scale's: at most
    two ``div.rn`` a thread), no fma but the final quotients' two an element and the
    division's own (a contracted ``cost + d * d`` would round the sums otherwise than the
    reference), no spilled registers, at most 64 registers a thread (two 16-warp programs
    an SM, as without the search), and at most 1.6 times the PTX of the kernel without
    the search (three more max passes over the row; the candidates are scalar work). Its
    H200 cost is not measured yet (scripts/h200_quant.sh qs)."""
    from tests import sm90

    got = sm90.run(_COMPILE_SEARCH)
    for n, r in got.items():
        assert r["div_rn"] <= 2 and r["stack"] == 0 and r["regs"] <= 64, (n, r)
        assert r["lines"] <= 1.6 * got["0"]["lines"], (n, r)
        if int(n):  # 32 elements a thread, two explicit fmas each; the reciprocals' own
            assert 2 * 16384 // (16 * 32) <= r["fma"] <= 2 * 16384 // (16 * 32) + 8, (n, r)


_COMPILE_SEARCH = """
import json
from kiln.kernels import quant_act as qa
from tests.sm90 import compile_sm90

sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "sm_ptr": "*fp32",
       "idx_ptr": "*fp32", "stride_x": "i32", "stride_q": "i32", "stride_sg": "i32",
       "inter": "i32"}
out = {}
for n in (0, 2, 4, 8):
    consts = dict(HAS_SMOOTH=False, INT8=False, EMULATE=False, C=0, CP=16, SEARCH=n,
                  GROUP=0, BLOCK=16384)
    k = compile_sm90(qa._silu_mul_quant_kernel, sig, consts, 16,
                     divisible=("x_ptr", "q_ptr", "stride_x", "stride_q", "inter"),
                     options={"enable_fp_fusion": False} if n else None)
    body = [ln for ln in k["ptx"].splitlines()
            if ln.strip() and not ln.strip().startswith(("//", ".", "$", "{", "}"))]
    out[n] = {"div_rn": k["ptx"].count("div.rn.f32"), "fma": k["ptx"].count("fma.rn.f32"),
              "regs": k["regs"], "stack": k["stack"], "lines": len(body)}
print(json.dumps(out))
"""


# ---------------------------------------------------------------- the engine option


@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [
        (dict(algo="fp8", act_scale_search=3), "one of 0, 2, 4, 8, 16"),
        (dict(algo="fp8", act_scale_search=True), "one of 0, 2, 4, 8, 16"),
        (dict(algo="int8-wo", act_scale_search=4), "0 unless --quant fp8"),
        (dict(algo="w8a8-sq", act_scale_search=4), "0 unless --quant fp8"),
        (dict(algo="fp8", activation_scheme="static", act_scale_search=4), "but static"),
        (dict(act_scale_search=4), "0 unless --quant fp8"),
    ],
)
def test_quant_config_refuses_bad_searches(kwargs: dict, msg: str) -> None:
    from kiln.config import QuantConfig
    from kiln.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"^quant\.act_scale_search=.* is invalid: .*{msg}"):
        QuantConfig(**kwargs)
    for scheme in ("dynamic", "outliers", "smooth"):
        assert QuantConfig(algo="fp8", activation_scheme=scheme, act_scale_search=8)


@torch.no_grad()
@pytest.mark.parametrize("scheme", ["dynamic", "outliers"])
def test_build_load_with_scale_search(scheme: str, tmp_path) -> None:
    """A build with the search records it; the loaded engine's fp8 projections search,
    fused or not, with the same logits; the search changes them against the same weights
    without it (the weights are the same: GPTQ rounds from unquantized inputs)."""
    from kiln.build.builder import build_engine
    from kiln.build.loader import load_engine
    from kiln.config import BuildConfig, QuantConfig
    from kiln.llm import LLM
    from kiln.quant.layers import QuantLinear
    from kiln.quant.passes import fuse_activation_quant
    from kiln.sampling_params import SamplingParams
    from tests.util import prefill_logits, save_tiny_llama

    hf = save_tiny_llama(tmp_path / "hf")
    extra = dict(act_outliers=8) if scheme == "outliers" else {}
    engines = {}
    for n in (0, 4):
        qcfg = QuantConfig(algo="fp8", activation_scheme=scheme, act_scale_search=n, **extra)
        m = build_engine(str(hf), tmp_path / f"e{n}", BuildConfig(device="cpu", quant=qcfg),
                         0, False)  # fmt: skip
        assert m["quant"]["act_scale_search"] == n
        engines[n] = load_engine(tmp_path / f"e{n}", "cpu")
    qls = [q for q in engines[4].model.modules() if isinstance(q, QuantLinear)]
    assert len(qls) == 8 and all(q.act_search == 4 for q in qls)
    assert "act_search=4" in repr(qls[0])
    ids = list(range(1, 40))
    unfused = prefill_logits(engines[4], ids)
    assert fuse_activation_quant(engines[4].model) == 6
    fused = prefill_logits(engines[4], ids)
    assert torch.equal(fused, unfused)
    plain = prefill_logits(engines[0], ids)
    assert not torch.equal(fused, plain) and float((fused - plain).norm() / plain.norm()) < 0.05
    out = LLM(tmp_path / "e4", progress=False).generate([ids], SamplingParams(max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_cli_scale_search(tmp_path, capsys: pytest.CaptureFixture) -> None:
    from kiln.build.loader import load_engine
    from kiln.cli import main
    from tests.util import prefill_logits

    out = str(tmp_path / "e")
    args = ["build", "--model", "dummy:tiny", "--output", out, "--device", "cpu", "--quant", "fp8"]
    assert main([*args, "--act-scale-search", "8", "--quantize-lm-head"]) == 0
    assert main(["inspect", out]) == 0
    shown = capsys.readouterr().out  # fp8's default scheme, outlier channels, searched too
    assert "outliers with 64 channels split activations (scales searched among 8" in shown
    eng = load_engine(out, "cpu")  # a dummy engine: quantized at load, searching
    assert eng.model.get_submodule("lm_head.proj").act_search == 8
    assert eng.model.get_submodule("layers.1.mlp.down").act_search == 8
    assert prefill_logits(eng, list(range(20))).isfinite().all()
    with pytest.raises(SystemExit):
        main([*args, "--act-scale-search", "5"])
    assert "argument --act-scale-search: invalid choice: 5" in capsys.readouterr().err
    assert main([*args[:-1], "int8-wo", "--act-scale-search", "4"]) == 2
    assert "quant.act_scale_search=4 is invalid" in capsys.readouterr().err


@pytest.mark.gpu
@torch.no_grad()
def test_cuda_quant_linear_with_search_matches_the_reference() -> None:
    """fp8 QuantLinear with a searched scale on the GPU (Triton quantizer, then the GEMM the
    build picked for the row count) against the CPU reference layer."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from kiln.layers.linear import Linear
    from kiln.quant.layers import QuantLinear

    torch.manual_seed(0)
    lin = Linear(256, 128, dtype=torch.float32, device="cpu")
    lin.weight.copy_((torch.randn(128, 256) * 0.05).bfloat16().float())  # bf16-exact
    ref = QuantLinear.from_linear(lin, "fp8", act_search=8)
    gpu = QuantLinear.from_linear(lin.to("cuda", torch.bfloat16), "fp8", act_search=8)
    for m in (1, 9, 300):
        x = _rows(m, 256, torch.bfloat16, m)  # the same bf16 inputs on both sides
        want = ref(x.float().cpu())
        got = gpu(x).float().cpu()
        assert float((got - want).norm() / want.norm()) < 2e-2
