"""fp8 "block" (``--activation-scheme block``): weights in 128 x 128 tiles with one scale
each, activations with one scale per token and 128 channels. The formats and the
quantizers against their references (the Triton kernels under the interpreter on the CPU,
odd sizes and ragged last groups included), GPTQ with tile scales, ``QuantLinear``, a
build from an unquantized checkpoint, and the GPU path (``torch._scaled_mm`` with block
scales) against its float32 emulation. Pre-quantized block checkpoints are in
test_fp8_block_checkpoint.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.config import QuantConfig
from kiln.errors import ConfigError
from kiln.kernels import quant_act as qa
from kiln.kernels.quant_act_ref import expand_groups
from kiln.layers.linear import Linear
from kiln.quant import formats as qf
from kiln.quant.gptq import gptq_fp8_block
from kiln.quant.layers import QuantLinear

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
# (rows, channels): ragged last groups (576 = 4.5 groups, 200, 100 < one group) and whole ones
SIZES = [(3, 576), (2, 128), (5, 100), (1, 1536), (4, 200)] + (
    [(257, 4096), (64, 14336)] if DEV == "cuda" else []
)
G = qf.FP8_BLOCK


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _x(m: int, k: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows with a few channels 200x the rest, as LLM activations have."""
    x = torch.randn(m, k, generator=_gen(seed)) * (torch.rand(k, generator=_gen(seed + 1)) * 3)
    x[:, torch.randperm(k, generator=_gen(seed + 2))[:2]] *= 200.0
    return x.to(DEV, dtype)


def _same_codes(a: qa.QuantAct, b: qa.QuantAct) -> bool:
    """Equal scales and equal code values (the interpreter writes -0 as +0)."""
    return torch.equal(a.scale, b.scale) and torch.equal(a.q.float(), b.q.float())


# ---------------------------------------------------------------- formats


@pytest.mark.parametrize(("n", "k"), [(256, 384), (200, 576), (1, 1), (129, 127)])
def test_block_weight_scales_are_per_tile(n: int, k: int) -> None:
    w = torch.randn(n, k, generator=_gen(n + k)) * torch.rand(n, 1, generator=_gen(1))
    q, s = qf.quantize_fp8_block_weight(w)
    tiles = (-(-n // G), -(-k // G))
    assert q.dtype == qf.FP8_DTYPE and q.shape == (n, k)
    assert s.shape == tiles and s.dtype == torch.float32
    for i in range(tiles[0]):
        for j in range(tiles[1]):
            tile = w[i * G : (i + 1) * G, j * G : (j + 1) * G]
            assert float(s[i, j]) == float(tile.abs().amax() / 448.0)
            assert float(q[i * G : (i + 1) * G, j * G : (j + 1) * G].float().abs().amax()) == 448.0
    full = qf.block_scales_full(s, n, k)
    assert torch.equal(q.view(torch.uint8), qf.quantize_fp8(w, full).view(torch.uint8))
    deq = qf.dequantize_rows(q, s)
    assert torch.equal(deq, q.float() * full)
    # e4m3's relative step, or its subnormal step at the tile's scale
    assert bool(((deq - w).abs() <= torch.maximum(w.abs() * 2**-4, full * 2**-10) * 1.0001).all())


def test_act_matmul_ref_applies_group_and_tile_scales() -> None:
    m, n, k = 5, 200, 300
    x = _x(m, k, seed=4)
    w = torch.randn(n, k, generator=_gen(5)).to(DEV)
    wq, ws = qf.quantize_fp8_block_weight(w)
    a = qa.quantize_rows_ref(x, "fp8", group=G)
    assert a.scale.shape == (m, 3)
    xs = torch.cat([a.scale[:, j : j + 1].expand(m, min(G, k - j * G)) for j in range(3)], 1)
    want = (a.q.float() * xs) @ (wq.float() * qf.block_scales_full(ws, n, k)).t()
    got = qf.act_matmul_ref(a, wq, ws, None, torch.float32)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- quantizers


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k"), SIZES)
def test_group_quantizer_matches_reference(dtype: torch.dtype, m: int, k: int) -> None:
    x = _x(m, k, seed=m * k, dtype=dtype)
    got = qa.quantize_rows_triton(x, "fp8", group=G)
    ref = qa.quantize_rows_ref(x, "fp8", group=G)
    assert got.scale.shape == ref.scale.shape == (m, -(-k // G))
    assert got.scale.stride(0) == 1  # column-major, as torch._scaled_mm takes 1x128 scales
    assert _same_codes(got, ref)
    # each group's largest value is exact (448); the last, ragged group's too
    assert torch.equal(got.q.float().abs().amax(1), torch.full((m,), 448.0, device=DEV))


@pytest.mark.parametrize("search", [2, 4, 8, 16])
@pytest.mark.parametrize(("m", "k"), SIZES)
def test_group_scale_search_matches_reference(search: int, m: int, k: int) -> None:
    """Each group's scale searched (``--act-scale-search`` with block): the kernel picks
    the reference's candidate for every group, ragged ones included."""
    x = _x(m, k, seed=m + k + search)
    got = qa.quantize_rows_triton(x, "fp8", search=search, group=G)
    ref = qa.quantize_rows_ref(x, "fp8", group=G, search=search)
    assert _same_codes(got, ref)
    plain = qa.quantize_rows_ref(x, "fp8", group=G)
    ratio = ref.scale / plain.scale  # 1 + j / N, per group
    j = (ratio - 1.0) * search
    assert torch.allclose(j, j.round(), atol=1e-3) and bool((j.round() < search).all())
    # each group's own search: equal to searching that group alone as a row
    g0 = qa.quantize_rows_ref(x[:, :G].contiguous(), "fp8", search=search)
    assert torch.equal(ref.scale[:, :1], g0.scale)


def test_group_scale_search_lowers_the_groups_error() -> None:
    x = _x(64, 1024, seed=5)
    err = []
    for search in (0, 8):
        a = qa.quantize_rows_triton(x, "fp8", search=search, group=G)
        deq = a.q.float() * expand_groups(a.scale, 1024, G)
        err.append(float((deq - x).norm()))
    assert err[1] < err[0]
    y = torch.randn(3, 2 * 1024, device=DEV)
    got = qa.silu_and_mul_quant_triton(y, "fp8", search=8, group=G)
    _close(got, qa.silu_and_mul_quant_ref(y, "fp8", search=8, group=G))


def _close(got: qa.QuantAct, ref: qa.QuantAct) -> None:
    """The fused ops' own float32 rounding may differ by an ulp from the reference's
    (rsqrt, exp): scales to 2^-7, codes within one e4m3 step, 99 % of them equal."""
    assert got.scale.shape == ref.scale.shape and got.q.shape == ref.q.shape
    assert torch.allclose(got.scale, ref.scale, rtol=2**-7, atol=0)
    k = ref.q.shape[1]
    sa, sb = expand_groups(got.scale, k, G), expand_groups(ref.scale, k, G)
    a, b = got.q.float() * sa, ref.q.float() * sb
    step = 2.0 ** (torch.floor(torch.log2((b.abs() / sb).clamp(min=2**-6))) - 3) * sb
    assert bool(((a - b).abs() <= step * 1.01 + 1e-12).all())
    assert (got.q.float() == ref.q.float()).float().mean().item() >= 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k"), SIZES)
@pytest.mark.parametrize("residual", [False, True])
def test_fused_rms_norm_group_quant(dtype: torch.dtype, m: int, k: int, residual: bool) -> None:
    x = _x(m, k, seed=k, dtype=dtype)
    w = (torch.rand(k, generator=_gen(2)) + 0.5).to(DEV, dtype)
    r = _x(m, k, seed=k + 9, dtype=dtype) if residual else None
    got, got_r = qa.rms_norm_quant_triton(x, w, 1e-5, r, "fp8", group=G)
    ref, ref_r = qa.rms_norm_quant_ref(x, w, 1e-5, r, "fp8", group=G)
    _close(got, ref)
    assert got.scale.stride(0) == 1
    if residual:
        assert torch.equal(got_r, ref_r)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k"), SIZES)
def test_fused_silu_mul_group_quant(dtype: torch.dtype, m: int, k: int) -> None:
    x = torch.randn(m, 2 * k, generator=_gen(k)).mul(2).to(DEV, dtype)
    got = qa.silu_and_mul_quant_triton(x, "fp8", group=G)
    ref = qa.silu_and_mul_quant_ref(x, "fp8", group=G)
    _close(got, ref)


def test_group_quantizer_refusals() -> None:
    x = torch.randn(2, 256, device=DEV)
    with pytest.raises(ValueError, match="power of two"):
        qa.quantize_rows_triton(x, "fp8", group=100)
    with pytest.raises(ValueError, match="power of two"):
        qa.quantize_rows_triton(x, "int8", group=G)
    with pytest.raises(ValueError, match="per-token quantization only"):
        qa.quantize_rows_triton(x, "fp8", outliers=torch.tensor([1, 2]), group=G)


# ---------------------------------------------------------------- GPTQ and QuantLinear


def test_gptq_block_rounds_with_less_output_error_than_nearest() -> None:
    n, k, t = 160, 320, 2048  # ragged tiles both ways
    g = _gen(11)  # correlated inputs with a few large channels, as real activations
    x = torch.randn(t, k, generator=g) @ (torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k))
    x[:, :4] *= 20.0
    w = torch.randn(n, k, generator=_gen(12)) * 0.05
    h = x.t() @ x / t
    q, s = gptq_fp8_block(w, h)
    assert q.dtype == qf.FP8_DTYPE and s.shape == (2, 3)
    deq = qf.dequantize_rows(q, s)
    # the tile scales cover the weights GPTQ wrote: no code saturates past the tile's amax
    assert float(q.float().abs().amax()) <= 448.0
    rq, rs = qf.quantize_fp8_block_weight(w)
    err_gptq = ((deq - w) @ x.t()).norm()
    err_rtn = ((qf.dequantize_rows(rq, rs) - w) @ x.t()).norm()
    assert float(err_gptq) < 0.8 * float(err_rtn)


def _lin(n: int, k: int, seed: int) -> Linear:
    lin = Linear(k, n, dtype=torch.float32)
    lin.weight.data = torch.randn(n, k, generator=_gen(seed))
    return lin


def test_quant_linear_block_forward_and_prequantized_input() -> None:
    lin = _lin(384, 576, seed=3)
    q = QuantLinear.from_linear(lin, "fp8", weight_block=G)
    assert q.weight_scale.shape == (3, 5) and q.weight_block == G
    assert "weight_block=128" in repr(q)
    x = _x(7, 576, seed=8).cpu()
    a = qa.quantize_rows_ref(x, "fp8", group=G)
    want = qf.act_matmul_ref(a, q.weight, q.weight_scale, None, torch.float32)
    assert torch.equal(q(x), want)
    assert torch.equal(q(a), want)  # quantized by a producer (the fused kernels)
    ref = x @ lin.weight.t()
    assert float((q(x) - ref).norm() / ref.norm()) < 0.05
    with pytest.raises(TypeError, match="takes 5 activation scale"):
        q(qa.quantize_rows_ref(x, "fp8"))  # one scale per token: not this layer's input


@pytest.mark.parametrize(
    "kwargs", [dict(static_input=True), dict(smooth=True), dict(act_outliers=8)]
)
def test_quant_linear_block_refuses_other_activation_options(kwargs: dict) -> None:
    with pytest.raises(ConfigError, match=r"quant\.activation_scheme"):
        QuantLinear(256, 256, "fp8", weight_block=G, **kwargs)
    with pytest.raises(ConfigError, match=r"quant\.activation_scheme"):
        QuantLinear(256, 256, "int8-wo", weight_block=G)


def test_config_block_scheme() -> None:
    q = QuantConfig(algo="fp8", activation_scheme="block")
    assert q.weight_block == G
    assert QuantConfig(algo="fp8").weight_block is None
    assert QuantConfig(algo="fp8", activation_scheme="block", act_scale_search=8).act_scale_search
    with pytest.raises(ConfigError, match=r"quant\.act_outliers"):
        QuantConfig(algo="fp8", activation_scheme="block", act_outliers=8)
    with pytest.raises(ConfigError, match=r"quant\.activation_scheme"):
        QuantConfig(algo="int8-wo", activation_scheme="block")


# ---------------------------------------------------------------- a build


@pytest.fixture(scope="module")
def block_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.util import save_tiny_llama

    # q / k / v rows 256 / 128 / 128 and inputs 256 / 384: whole tiles, as on the GPU
    cfg = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4)
    return save_tiny_llama(tmp_path_factory.mktemp("hf"), config=cfg)


def test_build_block_engine(block_hf: Path, tmp_path: Path) -> None:
    from kiln.build.builder import build_engine
    from kiln.build.loader import load_engine
    from kiln.config import BuildConfig
    from kiln.quant.passes import fuse_activation_quant
    from tests.util import prefill_logits

    qcfg = QuantConfig(algo="fp8", activation_scheme="block", calib_tokens=256, quality_tokens=64)
    m = build_engine(str(block_hf), tmp_path / "e", BuildConfig(device="cpu", quant=qcfg), 0, False)
    assert m["quant"]["activation_scheme"] == "block"
    assert m["quant"]["quality"]["ppl_increase_pct"] < 1.0
    build_engine(str(block_hf), tmp_path / "p", BuildConfig(device="cpu"), 0, False)
    eng, plain = load_engine(tmp_path / "e", "cpu"), load_engine(tmp_path / "p", "cpu")
    qkv = eng.model.get_submodule("layers.1.attn.qkv")
    assert isinstance(qkv, QuantLinear) and qkv.weight_block == G
    assert qkv.weight_scale.shape == (4, 2) and qkv.weight.dtype == qf.FP8_DTYPE
    ids = list(range(1, 40))
    a, ref = prefill_logits(eng, ids), prefill_logits(plain, ids)
    assert float((a - ref).norm() / ref.norm()) < 0.1
    # the producers' fused quantization (RMSNorm, SiLU-mul) computes the same
    n = fuse_activation_quant(eng.model, enable=False)
    assert n == 0
    b = prefill_logits(eng, ids)
    assert fuse_activation_quant(eng.model) == 3 * 2
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_block_cli_choice_and_inspect(block_hf: Path, tmp_path: Path) -> None:
    out = tmp_path / "e"
    cmd = [sys.executable, "-m", "kiln.cli", "build", "--model", str(block_hf), "--output",
           str(out), "--device", "cpu", "--quant", "fp8", "--activation-scheme", "block",
           "--calib-tokens", "64", "--quality-tokens", "32"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    shown = subprocess.run([sys.executable, "-m", "kiln.cli", "inspect", str(out)], check=True,
                           capture_output=True, text=True).stdout  # fmt: skip
    assert "block" in shown
    bad = subprocess.run([*cmd[:-4], "--act-outliers", "8"], capture_output=True, text=True)
    assert bad.returncode != 0 and "quant.act_outliers" in bad.stderr


# ---------------------------------------------------------------- GPU


@pytest.mark.parametrize("m", [1, 7, 8])
def test_block_matmul_pads_for_cublas(m: int, monkeypatch) -> None:
    """The call ``_block_matmul_cuda`` makes, checked on the CPU by a stand-in for
    ``torch._scaled_mm`` that asserts what cuBLAS needs on sm_90 (A's scales (M, K / 128)
    with strides (1, M), M a multiple of 4; B's (K / 128, N / 128) transposed; N and K
    whole multiples of four tiles) and computes the block-scaled product: shapes of fewer
    or ragged tiles (384 x 256, 200 x 576) are zero-padded, codes and scales alike, and
    the output cut back."""
    calls, seen = [], []

    def fake(q, wt, scale_a, scale_b, out_dtype):
        mp, k = q.shape
        assert mp % 4 == 0 and scale_a.shape == (mp, k // G) and scale_a.stride() == (1, mp)
        assert k % (4 * G) == 0 and wt.shape[1] % (4 * G) == 0
        assert scale_b.shape == (k // G, wt.shape[1] // G)
        calls.append((mp, k, wt.shape[1], scale_a.data_ptr()))
        xs = scale_a.repeat_interleave(G, dim=1)
        ws = scale_b.t().repeat_interleave(G, dim=0).repeat_interleave(G, dim=1)
        return ((q.float() * xs) @ (wt.t().float() * ws).t()).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", fake)
    for n, k in ((512, 1024), (384, 256), (200, 576)):
        w = torch.randn(n, k, generator=_gen(n)) * 0.02
        wq, ws = qf.quantize_fp8_block_weight(w)
        # on the CPU wherever the suite runs: the stand-in is the check, not cuBLAS
        a = qa.quantize_rows_ref(_x(m, k, seed=m).cpu(), "fp8", group=G)
        if m == 8:  # column-major scales, as the GPU quantizers write them: passed as they are
            a = qa.QuantAct(a.q, a.scale.t().contiguous().t())
        seen.append(a.scale.data_ptr())
        got = qf._block_matmul_cuda(a, wq, ws, None, torch.float32)
        want = qf.act_matmul_ref(a, wq, ws, None, torch.float32)
        assert got.shape == (m, n) and got.is_contiguous()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)
    mp = -(-m // 4) * 4
    assert [c[:3] for c in calls] == [(mp, 1024, 512), (mp, 512, 512), (mp, 1024, 512)]
    assert (calls[0][3] == seen[0]) == (m == 8)  # no copy of scales already in place
    assert qf.block_gemm_ok(4096, 14336) and not qf.block_gemm_ok(384, 256)


def test_block_weight_padded_once(monkeypatch) -> None:
    """``QuantLinear.pad_block_weight`` pads a ragged layer's weight and tile scales once:
    ``weight`` / ``weight_scale`` stay views of their real extent in the padded storage (the
    CPU emulation and the state dict unchanged), and ``_block_matmul_cuda`` on the padded
    pair (the forward's GPU route) gives the emulation's product, the weight not copied
    again (checked by the cuBLAS stand-in)."""
    from kiln.quant.passes import pad_block_weights

    lin = _lin(200, 576, seed=5)
    q = QuantLinear.from_linear(lin, "fp8", weight_block=G)
    x = _x(3, 576, seed=9).cpu()
    before, state = q(x), {k: v.clone() for k, v in q.state_dict().items()}
    assert pad_block_weights(q) == 0  # the loader's pass: GPU layers only
    q.pad_block_weight()
    wp, ws = q.block_padded
    assert wp.shape == (512, 1024) and ws.shape == (4, 8)
    assert q.weight.shape == (200, 576) and q.weight.data_ptr() == wp.data_ptr()
    assert q.weight_scale.shape == (2, 5) and q.weight_scale.data_ptr() == ws.data_ptr()
    assert not wp[200:].any() and not wp[:, 576:].any() and bool((ws[:, 5:] == 1).all())
    assert torch.equal(q(x), before)
    assert all(torch.equal(v, state[k]) for k, v in q.state_dict().items())
    seen = []

    def fake(a_q, wt, scale_a, scale_b, out_dtype):
        seen.append(wt.data_ptr())
        xs = scale_a.repeat_interleave(G, dim=1)
        wsx = scale_b.t().repeat_interleave(G, dim=0).repeat_interleave(G, dim=1)
        return ((a_q.float() * xs) @ (wt.t().float() * wsx).t()).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", fake)
    a = qa.quantize_rows_ref(x, "fp8", group=G)
    got = qf._block_matmul_cuda(a, wp, ws, None, torch.float32, n=200)
    want = qf.act_matmul_ref(a, q.weight, q.weight_scale, None, torch.float32)
    tol = 1e-6 * float(want.abs().max())  # float32 sums in another order
    assert got.shape == (3, 200) and torch.allclose(got, want, rtol=1e-5, atol=tol)
    assert seen == [wp.data_ptr()]  # the padded weight itself, no copy
    q2 = QuantLinear.from_linear(_lin(512, 1024, seed=6), "fp8", weight_block=G)
    q2.pad_block_weight()  # whole multiples of four tiles: nothing to pad
    assert q2.block_padded is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_block_weight_padded_once_on_gpu() -> None:
    """On the GPU the padded-once layer gives the per-call padding's bits and the
    emulation's product."""
    from kiln.quant.passes import pad_block_weights

    lin = _lin(200, 576, seed=5).to("cuda", torch.bfloat16)
    q = QuantLinear.from_linear(lin, "fp8", weight_block=G)
    x = _x(7, 576, seed=9, dtype=torch.bfloat16)
    per_call = q(x)
    assert pad_block_weights(q) == 1 and q.block_padded is not None
    got = q(x)
    assert torch.equal(got, per_call)
    a = qa.quantize_rows(x, "fp8", group=G)
    want = qf.act_matmul_ref(a, q.weight, q.weight_scale, None, torch.float32)
    assert torch.allclose(got.float(), want, rtol=2**-7, atol=1e-3 * float(want.abs().amax()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("m", [1, 7, 300])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (384, 256), (512, 1536)])
def test_block_scaled_mm_matches_emulation_on_gpu(m: int, n: int, k: int) -> None:
    w = torch.randn(n, k, device="cuda") * 0.02
    wq, ws = qf.quantize_fp8_block_weight(w)
    x = _x(m, k, seed=m + n, dtype=torch.bfloat16)
    a = qa.quantize_rows(x, "fp8", group=G)
    assert a.scale.stride(0) == 1
    got = qf.act_matmul_cuda(a, wq, ws, None, torch.bfloat16)
    want = qf.act_matmul_ref(a, wq, ws, None, torch.float32)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert torch.allclose(got.float(), want, rtol=2**-7, atol=1e-3 * float(want.abs().amax()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_block_ragged_shapes_padded_on_gpu() -> None:
    """Ragged shapes run cuBLAS on zero-padded operands; a row's output does not depend on
    the other rows (eager and graph decode pad their batches differently)."""
    w = torch.randn(200, 576, device="cuda")
    wq, ws = qf.quantize_fp8_block_weight(w)
    assert not qf.block_gemm_ok(200, 576)
    x = _x(6, 576, seed=1, dtype=torch.bfloat16)
    a = qa.quantize_rows(x, "fp8", group=G)
    got = qf.act_matmul_cuda(a, wq, ws, None, torch.bfloat16)
    want = qf.act_matmul_ref(a, wq, ws, None, torch.float32)
    assert got.shape == (6, 200) and got.is_contiguous()
    assert torch.allclose(got.float(), want, rtol=2**-7, atol=1e-3 * float(want.abs().amax()))
    more = qa.quantize_rows(torch.cat([x, x[:2] * 3]), "fp8", group=G)
    assert torch.equal(qf.act_matmul_cuda(more, wq, ws, None, torch.bfloat16)[:6], got)


# ---------------------------------------------------------------- sm_90 compile


def test_group_quantizer_compiles_for_sm90_without_spills() -> None:
    """SiLU-mul + per-group quantization of a 14,336-wide row (Llama-3.1-8B's down input),
    with and without a search of 8 candidates per group, compiled for sm_90 offline: no
    spilled registers; without the search at most 64 a thread (two 16-warp programs an SM,
    as the per-token kernel) and one e4m3 conversion an element; with it at most 128 (one
    program an SM: its GPU cost is not measured)."""
    from tests import sm90

    got = sm90.run(_COMPILE_GROUP)
    for variant, r in got.items():  # the search: (groups x candidates) scalars, 128 regs
        cap = 128 if variant.endswith("/8") else 64
        assert r["stack"] == 0 and r["regs"] <= cap, (variant, r)
    assert got["128/0"]["e4m3"] == got["0/0"]["e4m3"], got


_COMPILE_GROUP = """
import json
from kiln.kernels import quant_act as qa
from tests.sm90 import compile_sm90

sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "sm_ptr": "*fp32",
       "idx_ptr": "*fp32", "stride_x": "i32", "stride_q": "i32", "stride_sg": "i32",
       "inter": "i32"}
out = {}
for group, search in ((0, 0), (128, 0), (128, 8)):
    consts = dict(HAS_SMOOTH=False, INT8=False, EMULATE=False, C=0, CP=16, SEARCH=search,
                  GROUP=group, BLOCK=16384)
    k = compile_sm90(qa._silu_mul_quant_kernel, sig, consts, 16,
                     divisible=("x_ptr", "q_ptr", "stride_x", "stride_q", "inter"),
                     options={"enable_fp_fusion": False} if search else None)
    out[f"{group}/{search}"] = {"regs": k["regs"], "stack": k["stack"],
                                "e4m3": 2 * k["ptx"].count("e4m3x2")}
print(json.dumps(out))
"""
