"""Quantization math (kiln/quant/algorithms.py) and calibration statistics (stats.py)."""

from __future__ import annotations

import pytest
import torch

from kiln.quant.algorithms import (
    awq_layer_scales,
    awq_output_error,
    awq_scales,
    awq_search,
    int4_dequant,
    int8_per_channel,
    int8_per_token,
    rtn_int4_dequant,
    rtn_int4_quant,
    smoothquant_factors,
    w8a8_output_error,
)
from kiln.quant.stats import (
    InputStats,
    collect_input_stats,
    make_kv_cache,
    single_sequence_metadata,
)

# --- int4 RTN -------------------------------------------------------------------------------


def test_rtn_int4_error_within_half_step() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 512)
    q, scale, zero = rtn_int4_quant(w, 128)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert scale.shape == zero.shape == (48, 4)
    assert torch.equal(zero, zero.round()) and zero.min() >= 0 and zero.max() <= 15
    w_hat = rtn_int4_dequant(w, 128)
    assert torch.equal(w_hat, int4_dequant(q, scale, zero, 128))
    err = (w - w_hat).abs().reshape(48, 4, 128)
    # every group straddles 0 here, so nothing is clipped by more than half a step
    assert (err <= scale.unsqueeze(-1) / 2 * (1 + 1e-5) + 1e-7).all()
    assert (err.amax(dim=-1) > scale / 4).all()  # and the bound is not vacuous
    # coarser groups: larger steps, larger error
    assert (w - rtn_int4_dequant(w, 512)).pow(2).mean() > (w - w_hat).pow(2).mean()


def test_rtn_int4_exact_on_grid() -> None:
    g = torch.Generator().manual_seed(1)
    n, k, gs = 8, 256, 64
    q = torch.randint(0, 16, (n, k), generator=g)
    q[:, ::gs], q[:, 1::gs] = 0, 15  # every group spans the full code range
    zero = torch.randint(0, 16, (n, k // gs), generator=g).float()
    scale = 2.0 ** torch.randint(-8, 0, (n, k // gs), generator=g).float()
    w = int4_dequant(q, scale, zero, gs)
    q2, scale2, zero2 = rtn_int4_quant(w, gs)
    assert torch.equal(q2.long(), q) and torch.equal(scale2, scale) and torch.equal(zero2, zero)
    assert torch.equal(rtn_int4_dequant(w, gs), w)


def test_rtn_int4_degenerate_and_bad_shapes() -> None:
    w = torch.zeros(2, 32)
    w[1] = 0.25  # constant nonzero group: no NaN, value clipped to the top code
    w_hat = rtn_int4_dequant(w, 16)
    assert torch.isfinite(w_hat).all() and torch.equal(w_hat[0], w[0])
    with pytest.raises(ValueError):
        rtn_int4_dequant(torch.randn(4, 100), 128)
    with pytest.raises(ValueError):
        rtn_int4_dequant(torch.randn(4, 8, 8), 8)


# --- AWQ ------------------------------------------------------------------------------------


def _salient_acts(s: int, k: int, salient: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(s, k, generator=gen)
    x[:, salient] *= 30.0  # a few input channels with large activations
    return x


def test_awq_beats_rtn_on_salient_channels() -> None:
    g = torch.Generator().manual_seed(2)
    n, k = 96, 512
    w = torch.randn(n, k, generator=g) * 0.02
    salient = torch.randperm(k, generator=g)[:8]
    x_cal = _salient_acts(256, k, salient, g)
    x_held = _salient_acts(256, k, salient, g)
    res = awq_search(w, x_cal, x_cal.abs().mean(dim=0), group_size=128, grid=20)
    rtn_cal = awq_output_error(w, x_cal, None, 128)
    assert res.rtn_error == pytest.approx(rtn_cal, rel=1e-6)
    assert res.alpha > 0 and res.error < 0.8 * rtn_cal  # strictly (and clearly) better
    s = awq_scales(w, x_cal, x_cal.abs().mean(dim=0), group_size=128, grid=20)
    assert torch.equal(s, res.scales) and s.shape == (k,)
    # salient channels are scaled up relative to the rest
    assert s[salient].min() > s[~torch.isin(torch.arange(k), salient)].max()
    held_rtn = awq_output_error(w, x_held, None, 128)
    held_awq = awq_output_error(w, x_held, s, 128)
    assert held_awq < 0.8 * held_rtn
    print(
        f"AWQ/RTN output MSE: calibration {res.error / rtn_cal:.3f}, "
        f"held-out {held_awq / held_rtn:.3f} (alpha {res.alpha})"
    )


def test_awq_never_worse_than_rtn() -> None:
    g = torch.Generator().manual_seed(3)
    for trial in range(4):
        w = torch.randn(32, 256, generator=g)
        x = torch.randn(64, 256, generator=g)  # no salient channels
        # a misleading activation statistic: candidates other than alpha 0 may all be worse
        stat = torch.rand(256, generator=g) ** 4 if trial % 2 else x.abs().mean(dim=0)
        res = awq_search(w, x, stat, group_size=64, grid=10)
        assert res.error <= res.rtn_error
        if res.alpha == 0:
            assert torch.equal(res.scales, torch.ones(256))
        assert awq_output_error(w, x, res.scales, 64) == pytest.approx(res.error, rel=1e-6)


def test_awq_fused_weight_and_bad_samples() -> None:
    g = torch.Generator().manual_seed(4)
    q, kv = torch.randn(64, 128, generator=g), torch.randn(32, 128, generator=g)
    x = _salient_acts(64, 128, torch.tensor([3, 77]), g)
    s = awq_scales(torch.cat([q, kv]), x, x.abs().mean(dim=0), group_size=64, grid=8)
    assert s.shape == (128,)
    with pytest.raises(ValueError):
        awq_scales(q, torch.randn(8, 64), torch.ones(64), group_size=64)


# --- SmoothQuant ----------------------------------------------------------------------------


def _outlier_case(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    t, k, n = 128, 256, 64
    x = torch.randn(t, k, generator=gen)
    x[:, torch.randperm(k, generator=gen)[:6]] *= 60.0  # outlier channels, as in LLMs
    w = torch.randn(n, k, generator=gen) * 0.05
    return x, w


def test_smoothquant_identity_before_quantization() -> None:
    x, w = _outlier_case(torch.Generator().manual_seed(5))
    s = smoothquant_factors(x.abs().amax(dim=0), w, alpha=0.5)
    assert s.dtype == torch.float32 and s.shape == (x.shape[1],) and (s > 0).all()
    ref = x @ w.T
    out = (x / s) @ (w * s).T
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # in float64 the only difference is s's own rounding
    x64, w64, s64 = x.double(), w.double(), s.double()
    torch.testing.assert_close((x64 / s64) @ (w64 * s64).T, x64 @ w64.T, rtol=1e-12, atol=1e-10)
    # the smoothed activation maxima equal the smoothed weight maxima at alpha 0.5
    torch.testing.assert_close(
        (x / s).abs().amax(dim=0), (w * s).abs().amax(dim=0), rtol=1e-5, atol=1e-6
    )


def test_smoothquant_reduces_w8a8_error() -> None:
    x, w = _outlier_case(torch.Generator().manual_seed(6))
    s = smoothquant_factors(x.abs().amax(dim=0), w, alpha=0.5)
    plain, smooth = w8a8_output_error(w, x), w8a8_output_error(w, x, s)
    assert smooth < 0.5 * plain
    print(f"SmoothQuant/none w8a8 output MSE: {smooth / plain:.3f}")
    # factors stay finite and in range with dead channels
    s0 = smoothquant_factors(torch.zeros(256), torch.zeros(8, 256))
    assert torch.isfinite(s0).all() and (s0 > 0).all()


def test_int8_helpers() -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(16, 64, generator=g)
    xq = int8_per_token(x)
    step = x.abs().amax(dim=1, keepdim=True) / 127
    assert ((x - xq).abs() <= step / 2 + 1e-6).all()
    assert torch.allclose(xq.abs().amax(dim=1), x.abs().amax(dim=1))  # row max is a code
    w = torch.randn(8, 64, generator=g)
    wq = int8_per_channel(w)
    assert ((w - wq).abs() <= w.abs().amax(dim=1, keepdim=True) / 254 + 1e-6).all()
    assert torch.equal(int8_per_token(torch.zeros(2, 4)), torch.zeros(2, 4))


# --- calibration statistics -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    from kiln import LLM

    return LLM("dummy:tiny", device="cpu").engine.model


def _windows() -> list[list[int]]:
    g = torch.Generator().manual_seed(8)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in (20, 33, 7)]


@torch.inference_mode()
def _layer1_qkv_input(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The input of layers.1.attn.qkv, computed without hooks."""
    n = len(ids)
    kv = make_kv_cache(model, n)
    meta = single_sequence_metadata(n, kv.tokens_per_block, torch.device("cpu"))
    x = model.embed(torch.tensor(ids))
    x, residual = model.layers[0](torch.arange(n), x, None, kv.layers[0], meta)
    x, _ = model.layers[1].attn_norm(x, residual)
    return x.float()


def test_collect_input_stats(tiny_model: torch.nn.Module) -> None:
    model, windows = tiny_model, _windows()
    cfg = model.config
    stats = collect_input_stats(model, windows, keep_samples=512)
    h, i = cfg.hidden_size, cfg.intermediate_size
    expect_k = {"attn.qkv": h, "attn.o": cfg.q_size, "mlp.gate_up": h, "mlp.down": i}
    names = {f"layers.{li}.{m}" for li in range(cfg.num_hidden_layers) for m in expect_k}
    assert set(stats) == names
    rows = sum(len(w) for w in windows)
    for name, st in stats.items():
        k = expect_k[name.split(".", 2)[2]]
        assert isinstance(st, InputStats) and st.num_rows == rows
        assert st.absmax.shape == st.mean_abs.shape == (k,)
        assert st.samples.shape == (rows, k)  # fewer rows than keep_samples: all kept
        for t in (st.absmax, st.mean_abs, st.samples):
            assert t.dtype == torch.float32 and t.device.type == "cpu"
        assert (st.mean_abs <= st.absmax).all() and (st.absmax > 0).all()

    x = torch.cat([_layer1_qkv_input(model, w) for w in windows])
    st = stats["layers.1.attn.qkv"]
    torch.testing.assert_close(st.absmax, x.abs().amax(dim=0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(st.mean_abs, x.abs().mean(dim=0), rtol=1e-5, atol=1e-6)
    # the samples are the rows themselves (in some order)
    order = lambda t: t[torch.argsort(t[:, 0])]  # noqa: E731
    torch.testing.assert_close(order(st.samples), order(x), rtol=1e-5, atol=1e-6)

    # a subset of modules and a small sample budget: distinct real rows
    few = collect_input_stats(model, windows, modules=["layers.1.attn.qkv"], keep_samples=16)
    assert list(few) == ["layers.1.attn.qkv"]
    sub = few["layers.1.attn.qkv"].samples
    assert sub.shape == (16, h)
    d = torch.cdist(sub, x, compute_mode="donot_use_mm_for_euclid_dist")
    assert (d.min(dim=1).values < 1e-4).all()
    assert len(set(d.argmin(dim=1).tolist())) == 16
    torch.testing.assert_close(few["layers.1.attn.qkv"].absmax, st.absmax)
    with pytest.raises(KeyError):
        collect_input_stats(model, windows, modules=["layers.0.nope"])


def test_awq_layer_scales_on_tiny_model(tiny_model: torch.nn.Module) -> None:
    stats = collect_input_stats(tiny_model, _windows(), keep_samples=64)
    weights = {n: m.weight for n, m in tiny_model.named_modules() if n in stats}
    scales = awq_layer_scales(weights, stats, group_size=16, grid=10)
    assert set(scales) == set(stats)
    for name, s in scales.items():
        w, st = weights[name], stats[name]
        assert s.shape == (w.shape[1],)
        assert awq_output_error(w, st.samples, s, 16) <= awq_output_error(w, st.samples, None, 16)
