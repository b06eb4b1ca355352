"""Split-K sums left to the consuming kernel (``kiln.kernels.partials``): SiLU·mul and the
residual add + RMSNorm add a projection's partials exactly as ``split_k_reduce`` would,
so the results are the same bits; the weight-only launchers return partials only when
asked, split and without bias; projections ask only inside ``split_sums_deferred``."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import ConfigError
from kiln.kernels import partials as pt
from kiln.kernels import wq_gemm as wq
from kiln.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kiln.kernels.partials import SplitPartials
from kiln.kernels.rmsnorm import rms_norm_ref, rms_norm_triton
from kiln.quant import formats as qf

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _parts(split: int, t: int, n: int) -> SplitPartials:
    return SplitPartials(torch.randn(split, t, n, device=DEV), torch.bfloat16)


@pytest.mark.parametrize("t,inter,split", [(1, 100, 4), (3, 257, 2), (2, 64, 1)])
def test_silu_mul_adds_partials_as_the_reduction_does(t: int, inter: int, split: int) -> None:
    p = _parts(split, t, 2 * inter)
    got = silu_and_mul_triton(p)
    assert got.shape == (t, inter) and got.dtype == torch.bfloat16
    assert torch.equal(got, silu_and_mul_triton(p.finish()))
    ref = silu_and_mul_ref(p.part.sum(0).bfloat16().float())
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("t,h,split", [(1, 100, 4), (3, 96, 3)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_adds_partials_as_the_reduction_does(
    t: int, h: int, split: int, with_residual: bool
) -> None:
    p = _parts(split, t, h)
    w = torch.randn(h, device=DEV).bfloat16()
    res = torch.randn(t, h, device=DEV).bfloat16() if with_residual else None
    got, got_r = rms_norm_triton(p, w, 1e-5, res)
    want, want_r = rms_norm_triton(p.finish(), w, 1e-5, res)
    assert torch.equal(got, want)
    assert (got_r is None) == (not with_residual)
    if with_residual:
        assert torch.equal(got_r, want_r)
    ref, _ = rms_norm_ref(p.finish(), w, 1e-5, res)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


def _int4(n: int, k: int, g: int) -> tuple[torch.Tensor, ...]:
    u, s, z = qf.quantize_int4(torch.randn(n, k, device=DEV) / k**0.5, g)
    return qf.pack_int4(u), s.float().contiguous(), z


def test_weight_only_launcher_returns_partials_only_when_split_and_asked() -> None:
    n, k, g = 40, 1024, 128
    p, s, z = _int4(n, k, g)
    x = torch.randn(2, k, device=DEV).bfloat16()
    cfg = wq.wq_default_config(n, k, 2, g, mma=False) | {"SPLIT_K": 4}
    whole = wq.wq_linear_triton(x, p, s, z, config=cfg)
    y = wq.wq_linear_triton(x, p, s, z, config=cfg, partials=True)
    assert isinstance(y, SplitPartials) and y.part.shape == (4, 2, n) and y.shape == (2, n)
    assert torch.equal(y.finish(), whole)
    bias = torch.randn(n, device=DEV).bfloat16()
    assert isinstance(wq.wq_linear_triton(x, p, s, z, bias=bias, config=cfg, partials=True),
                      torch.Tensor)  # fmt: skip
    one = cfg | {"SPLIT_K": 1}
    assert torch.is_tensor(wq.wq_linear_triton(x, p, s, z, config=one, partials=True))


def test_deferral_only_inside_the_block(monkeypatch) -> None:
    assert pt.enabled_by({}) and pt.enabled_by({"KILN_DEFER_SPLIT": "1"})
    assert not pt.enabled_by({"KILN_DEFER_SPLIT": "0"})
    with pytest.raises(ConfigError, match=r"KILN_DEFER_SPLIT='off' is invalid: .* 0 to 1"):
        pt.enabled_by({"KILN_DEFER_SPLIT": "off"})
    monkeypatch.setattr(pt, "ENABLED", True)  # the default
    assert not pt.deferring()
    with pt.split_sums_deferred():
        assert pt.deferring()
        with pytest.raises(RuntimeError), pt.split_sums_deferred():
            raise RuntimeError
        assert pt.deferring()
    assert not pt.deferring()
    monkeypatch.setattr(pt, "ENABLED", False)  # KILN_DEFER_SPLIT=0
    with pt.split_sums_deferred():
        assert not pt.deferring()


def test_finished_passes_tensors_through() -> None:
    x = torch.randn(2, 3)
    assert pt.finished(x) is x


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 5, 12])
def test_mlp_chain_with_partials_is_bit_identical_on_gpu(m: int) -> None:
    """gate_up → SiLU·mul → down → residual add + RMSNorm on the tensor-core int4 kernel
    split 4 ways, with the sums left to the consumers and without: the same bits."""
    h, inter, g = 512, 384, 128
    gu, dn = _int4(2 * inter, h, g), _int4(h, inter, g)
    x = torch.randn(m, h, device=DEV).bfloat16()
    res = torch.randn(m, h, device=DEV).bfloat16()
    w = torch.randn(h, device=DEV).bfloat16()
    cfg = wq.mma_config(2, 1, 4)

    def chain(partials: bool) -> tuple[torch.Tensor, torch.Tensor]:
        a = wq.wq_linear_triton(x, *gu, config=cfg, partials=partials)
        assert isinstance(a, SplitPartials) == partials
        d = wq.wq_linear_triton(silu_and_mul_triton(a), *dn, config=cfg, partials=partials)
        out, r = rms_norm_triton(d, w, 1e-5, res)
        return out, r

    (o1, r1), (o0, r0) = chain(True), chain(False)
    assert torch.equal(o1, o0) and torch.equal(r1, r0)


def test_mlp_and_norm_modules_pass_partials_inside_the_block(monkeypatch) -> None:
    """The modules' plumbing, on the CPU through the interpreter (the dispatchers forced to
    Triton): an int4 GatedMLP whose projections are tuned to split K returns down's
    partials only inside ``split_sums_deferred`` (SiLU·mul takes gate_up's), and RMSNorm
    takes them; the outputs are the same bits as without."""
    from kiln.kernels import activation, rmsnorm, tuning
    from kiln.kernels.wq_config import wq_shape_key
    from kiln.layers.mlp import GatedMLP
    from kiln.layers.norm import RMSNorm
    from kiln.quant.layers import QuantLinear

    for mod in (wq, activation, rmsnorm):
        monkeypatch.setattr(mod, "use_triton", lambda x: True)
    monkeypatch.setattr(pt, "ENABLED", True)
    h, inter, g = 256, 192, 64
    torch.manual_seed(0)
    mlp = GatedMLP(h, inter, dtype=torch.bfloat16, device=DEV)
    for name in ("gate_up", "down"):
        lin = getattr(mlp, name)
        lin.weight.copy_(torch.randn_like(lin.weight) / lin.in_features**0.5)
        setattr(mlp, name, QuantLinear.from_linear(lin, "int4-awq", group_size=g))
    norm = RMSNorm(h, 1e-5, dtype=torch.bfloat16, device=DEV)
    norm.weight.copy_(torch.randn(h))
    x = torch.randn(3, h, device=DEV).bfloat16()
    res = torch.randn(3, h, device=DEV).bfloat16()
    cfg = wq.wq_default_config(2 * inter, h, 3, g, mma=False) | {"SPLIT_K": 2, "BLOCK_K": 64}
    by_shape = {wq_shape_key(n, k, g): {"4": cfg} for n, k in ((2 * inter, h), (h, inter))}
    tuning.set_tuning({"weight_only": {"by_shape": by_shape}})
    try:
        plain = mlp(x, partials=True)
        with pt.split_sums_deferred():
            deferred = mlp(x, partials=True)
            finished_here = mlp(x)  # a caller that cannot take partials gets a tensor
    finally:
        tuning.set_tuning(None)
    assert torch.is_tensor(plain) and torch.is_tensor(finished_here)
    assert isinstance(deferred, SplitPartials) and deferred.part.shape == (2, 3, h)
    assert torch.equal(deferred.finish(), plain) and torch.equal(finished_here, plain)
    (a, ra), (b, rb) = norm(deferred, res), norm(plain, res)
    assert torch.equal(a, b) and torch.equal(ra, rb)


def test_model_forward_with_partials_is_the_same_bits(monkeypatch) -> None:
    """A whole int4 model (``dummy:tiny`` in bfloat16, every projection tuned to split K)
    on the CPU through the interpreter for the projections, SiLU·mul and RMSNorm: inside
    ``split_sums_deferred`` o's, gate_up's and down's partials reach SiLU·mul and the
    norms, across layers too, and the logits are the same bits as without."""
    from kiln import LLM
    from kiln.config import QuantConfig
    from kiln.kernels import activation, rmsnorm, tuning
    from kiln.kernels.wq_config import wq_shape_key
    from kiln.quant.passes import quantize_model
    from kiln.quant.stats import forward_sequence

    model = LLM("dummy:tiny", device=DEV, dtype="bfloat16").engine.model
    quantize_model(model, QuantConfig(algo="int4-awq", group_size=16))
    for mod in (wq, activation, rmsnorm):
        monkeypatch.setattr(mod, "use_triton", lambda x: True)
    monkeypatch.setattr(pt, "ENABLED", True)
    seen: list[str] = []
    real_norm, real_silu = rmsnorm.rms_norm_triton, activation.silu_and_mul_triton
    monkeypatch.setattr(rmsnorm, "rms_norm_triton", lambda x, *a: seen.append(
        f"norm:{type(x).__name__}") or real_norm(x, *a))  # fmt: skip
    monkeypatch.setattr(activation, "silu_and_mul_triton", lambda x: seen.append(
        f"silu:{type(x).__name__}") or real_silu(x))  # fmt: skip
    by_shape = {}
    for name, m in model.named_modules():
        if name.startswith("layers.0.") and hasattr(m, "weight_zero"):
            n, k = m.out_features, m.in_features
            cfg = wq.wq_default_config(n, k, 32, 16, mma=False) | {"SPLIT_K": 2, "BLOCK_K": 16}
            if DEV == "cuda":  # tl.dot needs K tiles of 32: the broadcast kernel there
                cfg = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 2, "FMA": True,
                       "num_warps": 4, "num_stages": 2}  # fmt: skip
            by_shape[wq_shape_key(n, k, 16)] = {"32": cfg}
    assert len(by_shape) == 4
    tuning.set_tuning({"weight_only": {"by_shape": by_shape}})
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    try:
        plain = forward_sequence(model, ids)
        assert "norm:SplitPartials" not in seen and "silu:SplitPartials" not in seen
        with pt.split_sums_deferred():
            deferred = forward_sequence(model, ids)
    finally:
        tuning.set_tuning(None)
    layers = len(model.layers)  # o's partials to mlp_norm, down's to the next layer's norm
    assert seen.count("norm:SplitPartials") == 2 * layers
    assert seen.count("silu:SplitPartials") == layers
    assert torch.equal(deferred, plain)


def test_consumers_decide_pdl_by_the_steps_rows(monkeypatch) -> None:
    """Programmatic dependent launch goes by a step's rows (``pdl.MAX_ROWS``): with
    partials the consumers ask about their (T, N) output, not the (SPLIT, T, N) buffer."""
    from kiln.kernels import pdl

    asked: list[int] = []
    real = pdl.kwargs
    monkeypatch.setattr(pdl, "kwargs", lambda x: asked.append(x.shape[0]) or real(x))
    silu_and_mul_triton(_parts(3, 5, 64))
    rms_norm_triton(_parts(3, 5, 32), torch.ones(32, device=DEV), 1e-5)
    assert asked == [5, 5]
