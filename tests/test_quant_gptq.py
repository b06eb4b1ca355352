"""GPTQ weight rounding (kiln/quant/gptq.py) and its use by the build."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from kiln.config import QuantConfig
from kiln.quant import formats as qf
from kiln.quant import gptq as gq
from kiln.quant.build import quantize_loaded
from kiln.quant.layers import QuantLinear
from kiln.quant.stats import collect_input_stats, decoder_linears, make_kv_cache, prefill_hidden


def _problem(n: int = 48, k: int = 128, rows: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight and correlated inputs with a few large channels (as real activations)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(n, k, generator=g) * 0.05
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    x = torch.randn(rows, k, generator=g) @ mix
    x[:, :4] *= 20.0
    return w, x


def _out_err(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> float:
    return (x @ (wq - w).T).pow(2).mean().item()


def test_gptq_fp8_layout_and_lower_output_error() -> None:
    w, x = _problem()
    q, s = gq.gptq_fp8(w, x.T @ x / x.shape[0])
    q_rtn, s_rtn = qf.quantize_fp8_weight(w)
    assert q.dtype == qf.FP8_DTYPE and q.shape == w.shape
    torch.testing.assert_close(s, s_rtn, rtol=0, atol=0)  # same row scales as round-to-nearest
    wq, w_rtn = qf.dequantize_rows(q, s), qf.dequantize_rows(q_rtn, s_rtn)
    assert not torch.equal(wq, w_rtn)
    assert _out_err(x, w, wq) < 0.7 * _out_err(x, w, w_rtn)


@pytest.mark.parametrize("group,k", [(32, 128), (64, 128), (96, 192), (256, 512)])
def test_gptq_int4_layout_and_lower_output_error(group: int, k: int) -> None:
    """Groups that divide the 128-column block, and groups that do not (96) or exceed it."""
    w, x = _problem(k=k)
    q, s, z = gq.gptq_int4(w, x.T @ x / x.shape[0], group, clip_ratios=(1.0,))
    assert q.dtype == torch.uint8 and q.shape == w.shape and int(q.max()) <= qf.INT4_MAX
    assert s.shape == z.shape == (w.shape[0], w.shape[1] // group) and z.dtype == torch.uint8
    wq = qf.dequantize_int4(q, s, z)
    w_rtn = qf.dequantize_int4(*qf.quantize_int4(w, group))
    assert _out_err(x, w, wq) < 0.8 * _out_err(x, w, w_rtn)
    # the stored (q, scale, zero) reproduce what GPTQ rounded to
    h = x.T @ x / x.shape[0]
    fits = []

    def fit(wg: torch.Tensor):  # the same fit gptq_int4 uses, recorded
        _, sg, zg = qf.quantize_int4(wg, group)
        fits.append(sg)
        return lambda c: ((torch.round(c / sg[:, 0]) + zg[:, 0]).clamp(0, 15) - zg[:, 0]) * sg[:, 0]

    got = gq.gptq_round(w, h, fit, group, act_order=gq.ACT_ORDER["int4"])
    torch.testing.assert_close(got, wq, rtol=0, atol=1e-6)
    assert len(fits) == w.shape[1] // group


@pytest.mark.parametrize("group", [None, 32])
def test_act_order_static_groups(group: int | None) -> None:
    """With the large input channels last, rounding them first (act order) leaves the
    other columns to absorb their error: a lower output error than in order. int4 groups
    are fitted to the weights as given (static groups): the round-to-nearest scales."""
    w, x = _problem(k=128)
    x = x.flip(1)
    h = x.T @ x / x.shape[0]
    errs = []
    for act_order in (False, True):
        if group is None:
            q, s = gq.gptq_fp8(w, h, act_order)
            wq = qf.dequantize_rows(q, s)
        else:
            q, s, z = gq.gptq_int4(w, h, group, act_order, clip_ratios=(1.0,))
            wq = qf.dequantize_int4(q, s, z)
            if act_order:
                _, s_rtn, z_rtn = qf.quantize_int4(w, group)
                assert torch.equal(s, s_rtn) and torch.equal(z, z_rtn)
        errs.append(_out_err(x, w, wq))
    assert errs[1] < 0.9 * errs[0], errs


def test_gptq_with_uncorrelated_inputs_is_round_to_nearest() -> None:
    """A diagonal Hessian spreads no error: GPTQ then rounds exactly like the RTN formats."""
    w, _ = _problem()
    h = torch.diag(torch.rand(w.shape[1], generator=torch.Generator().manual_seed(1)) + 0.5)
    q, _ = gq.gptq_fp8(w, h)
    q_rtn, _ = qf.quantize_fp8_weight(w)
    assert torch.equal(q.view(torch.uint8), q_rtn.view(torch.uint8))
    got = gq.gptq_int4(w, h, 64, clip_ratios=(1.0,))
    for a, b in zip(got, qf.quantize_int4(w, 64), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gptq_round_dead_columns_and_bad_groups() -> None:
    w, x = _problem()
    x[:, 5] = 0.0  # an input channel that never fires: its weights are rounded as zero
    q, _ = gq.gptq_fp8(w, x.T @ x / x.shape[0])
    assert (q[:, 5].float() == 0).all()
    with pytest.raises(ValueError, match="group_size 48 must divide K=128 in act order"):
        gq.gptq_round(w, torch.eye(w.shape[1]), lambda _w: lambda c: c, 48, act_order=True)
    with pytest.raises(ValueError, match="group_size 48 must divide K=128"):
        gq.gptq_int4(w, torch.eye(w.shape[1]), 48)
    # in order, a last group that K leaves ragged (128 = 48 + 48 + 32) is fitted on its own
    widths: list[int] = []
    eye = torch.eye(w.shape[1])
    gq.gptq_round(w, eye, lambda wg: widths.append(wg.shape[1]) or (lambda c: c), 48)
    assert widths == [48, 48, 32]


@pytest.fixture()
def tiny_model() -> torch.nn.Module:
    from kiln import LLM

    return LLM("dummy:tiny", device="cpu").engine.model


def _windows() -> list[list[int]]:
    g = torch.Generator().manual_seed(8)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in (20, 33, 7)]


def test_collect_hessians_matches_inputs_and_budget(tiny_model: torch.nn.Module) -> None:
    names = list(decoder_linears(tiny_model))
    windows = _windows()
    h = gq.collect_hessians(tiny_model, windows, names)
    stats = collect_input_stats(tiny_model, windows, keep_samples=10_000)  # every row
    for name in names:
        x = stats[name].samples
        torch.testing.assert_close(h[name], x.T @ x / x.shape[0], rtol=1e-4, atol=1e-5)
    with mock.patch.object(gq, "HESSIAN_BUDGET_BYTES", 1):  # one module per pass
        small = gq.collect_hessians(tiny_model, windows, names[:3])
    for name in names[:3]:
        torch.testing.assert_close(small[name], h[name])
    with pytest.raises(KeyError):
        gq.collect_hessians(tiny_model, windows, ["layers.0.nope"])


def test_collect_hessians_takes_the_head_input_in_the_first_pass(tiny_model) -> None:
    """lm_head's Hessian (the final hidden states') comes with the layers' in one pass,
    alone, or with the layers split over several passes, and equals x^T x / rows."""
    names = list(decoder_linears(tiny_model))
    windows = _windows()
    kv = make_kv_cache(tiny_model, max(len(w) for w in windows))
    x = torch.cat([prefill_hidden(tiny_model, w, kv).float() for w in windows])
    expected = x.T @ x / x.shape[0]
    passes = []
    real = gq._hessian_pass
    with mock.patch.object(gq, "_hessian_pass", lambda *a: passes.append(a[4]) or real(*a)):
        both = gq.collect_hessians(tiny_model, windows, names, head="lm_head")
        alone = gq.collect_hessians(tiny_model, windows, [], head="lm_head")
        with mock.patch.object(gq, "HESSIAN_BUDGET_BYTES", 1):
            split = gq.collect_hessians(tiny_model, windows, names[:3], head="lm_head")
    assert passes == ["lm_head", "lm_head", "lm_head", None, None]
    for h in (both["lm_head"], alone["lm_head"], split["lm_head"]):
        torch.testing.assert_close(h, expected, rtol=1e-4, atol=1e-5)
    assert set(both) == {*names, "lm_head"} and set(alone) == {"lm_head"}


@pytest.mark.parametrize("algo", ["fp8", "int4-awq"])
def test_build_rounds_with_gptq_load_does_not(algo: str) -> None:
    from kiln import LLM

    group = 16 if algo == "int4-awq" else None
    qcfg = QuantConfig(algo=algo, group_size=group, exclude_modules=("layers.0.mlp.*",))
    models = [LLM("dummy:tiny", device="cpu").engine.model for _ in range(2)]
    ref = {n: m.weight.detach().clone() for n, m in decoder_linears(models[0]).items()}
    with mock.patch.object(gq, "gptq_round", wraps=gq.gptq_round) as spy:
        quantize_loaded(models[0], qcfg, measure_errors=False, gptq=True)
        quantize_loaded(models[1], qcfg, measure_errors=False)
    quantized = [n for n, m in models[0].named_modules() if isinstance(m, QuantLinear)]
    assert spy.call_count == len(quantized) == len(ref) - 2  # excluded modules untouched
    built, loaded = dict(models[0].named_modules()), dict(models[1].named_modules())
    differ = 0
    for name in quantized:
        a, b = built[name], loaded[name]
        assert a.weight.dtype == b.weight.dtype and a.weight.shape == b.weight.shape
        differ += not torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
    assert differ > 0
    # forward still approximates the unquantized projection
    x = torch.randn(8, ref[quantized[0]].shape[1])
    y = built[quantized[0]](x)
    ref_y = x @ ref[quantized[0]].T
    assert (y - ref_y).norm() / ref_y.norm() < (0.3 if algo == "int4-awq" else 0.1)


def test_fit_int4_group_ratio_one_is_round_to_nearest_fit() -> None:
    w, x = _problem(k=64)
    _, s_rtn, z_rtn = qf.quantize_int4(w, 64)
    for h in (None, x.T @ x / x.shape[0]):
        s, z = gq.fit_int4_group(w, h, (1.0,))
        assert torch.equal(s, s_rtn[:, 0]) and torch.equal(z, z_rtn[:, 0].float())


@pytest.mark.parametrize("use_h", [False, True])
def test_fit_int4_group_clip_search_never_worse_per_row(use_h: bool) -> None:
    """A row with one large outlier is best served by a shrunk range; each row keeps the
    ratio with the smallest error (weighted by the group's Hessian when given), and 1.0
    first means no row does worse than without clipping."""
    w, x = _problem(k=64)
    w[0, 5] = 0.6  # far outside the other weights of row 0
    h = x.T @ x / x.shape[0] if use_h else None
    ratios = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)

    def err(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        d = w - qf.int4_qdq(w, s[:, None], z[:, None])
        return (d @ h * d).sum(1) if h is not None else d.pow(2).sum(1)

    s1, z1 = gq.fit_int4_group(w, h, (1.0,))
    s, z = gq.fit_int4_group(w, h, ratios)
    e1, e = err(s1, z1), err(s, z)
    assert bool((e <= e1).all())
    assert float(e.sum()) < float(e1.sum())
    assert bool((s <= s1 + 1e-12).all())  # only ever shrinks the range
    for r in ratios:  # no single ratio beats the per-row choice
        sr, zr = gq.fit_int4_group(w, h, (r,))
        assert bool((e <= err(sr, zr) + 1e-9).all())


def test_fit_int4_group_rejects_bad_ratios() -> None:
    w, _ = _problem(k=64)
    for bad in ((), (0.0,), (1.0, 1.2)):
        with pytest.raises(ValueError, match="clip ratios"):
            gq.fit_int4_group(w, None, bad)


def test_gptq_int4_clips_by_default() -> None:
    w, x = _problem(k=128)
    w[::7, ::13] *= 8.0
    h = x.T @ x / x.shape[0]
    assert gq.CLIP_RATIOS[0] == 1.0 and len(gq.CLIP_RATIOS) > 1
    default = gq.gptq_int4(w, h, 32)
    for a, b in zip(default, gq.gptq_int4(w, h, 32, clip_ratios=gq.CLIP_RATIOS), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(default[1], gq.gptq_int4(w, h, 32, clip_ratios=(1.0,))[1])


def test_gptq_int4_clip_ratios_layout_and_output_error() -> None:
    """With a clip search the stored (q, scale, zero) still reproduce the GPTQ result and
    the output error is no worse than that of the unclipped GPTQ, here with outliers."""
    w, x = _problem(k=128)
    w[::7, ::13] *= 8.0
    h = x.T @ x / x.shape[0]
    ratios = (1.0, 0.9, 0.8, 0.7)
    errs = []
    for act_order in (False, True):
        q0, s0, z0 = gq.gptq_int4(w, h, 32, act_order, clip_ratios=(1.0,))
        q, s, z = gq.gptq_int4(w, h, 32, act_order, clip_ratios=ratios)
        assert q.dtype == torch.uint8 and int(q.max()) <= qf.INT4_MAX and z.dtype == torch.uint8
        assert not torch.equal(s, s0)
        e0 = _out_err(x, w, qf.dequantize_int4(q0, s0, z0))
        errs.append((_out_err(x, w, qf.dequantize_int4(q, s, z)), e0))
    assert all(e < e0 for e, e0 in errs), errs
