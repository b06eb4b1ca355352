"""AWQ smoothing folded into the producers of each projection's input (kiln/quant/fold.py):
the model computes the same function with no division at run time; factors that cannot
fold stay at run time; identity factors are skipped by ``QuantLinear``."""

from __future__ import annotations

import torch

from kiln.config import QuantConfig
from kiln.quant.build import quantize_loaded
from kiln.quant.fold import fold_smoothing, tie_heads
from kiln.quant.layers import QuantLinear
from kiln.quant.passes import quantize_model
from kiln.quant.stats import InputStats


def _tiny() -> torch.nn.Module:
    from kiln import LLM

    return LLM("dummy:tiny", device="cpu").engine.model


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    from kiln.quant.stats import forward_sequence

    return forward_sequence(model, ids.tolist()).float()


def _same_function(after: torch.Tensor, before: torch.Tensor) -> None:
    """The fold's logits against the unfolded model's: the same function but for the
    scaled int4 row scales' rounding back onto float16's grid (2**-12 of each at most;
    1.3e-4 of the logits' norm measured)."""
    assert float((after - before).norm() / before.norm()) < 5e-4


def _random_factors(model: torch.nn.Module, tie_o: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = {}
    for name, m in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if name.startswith("layers.") and kind in ("qkv", "gate_up", "down", "o"):
            s = torch.rand(m.in_features, generator=g) + 0.5
            if name.endswith(".o") and tie_o:
                attn = model.get_submodule(name.removesuffix(".o"))
                rep = attn.num_heads // attn.num_kv_heads
                s = s.reshape(attn.num_kv_heads, rep, -1)[:, :1].expand(-1, rep, -1).reshape(-1)
            out[name] = s
    return out


def test_folding_keeps_the_function_and_removes_run_time_division() -> None:
    model = _tiny()
    attn = model.layers[0].attn
    assert attn.num_heads > attn.num_kv_heads  # grouped-query: o's factors need tying
    qcfg = QuantConfig(algo="int4-awq", group_size=16)
    quantize_model(model, qcfg, input_scales=_random_factors(model, tie_o=True))
    ids = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(1))
    before = _logits(model, ids)
    folded = fold_smoothing(model)
    assert len(folded) == 4 * len(model.layers)
    qs = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert qs and not any(q.smooth_active for q in qs)
    assert all(bool((q.smooth == 1).all()) and q.smooth_inv is None for q in qs)
    _same_function(_logits(model, ids), before)
    assert all(torch.equal(q.weight_scale.half().float(), q.weight_scale) for q in qs)


def test_loading_folds_all_but_o() -> None:
    """What loading an engine built before the fold does: o keeps its factors (folding them
    would change v, on which an fp8 cache's scales were calibrated)."""
    model = _tiny()
    quantize_model(model, QuantConfig(algo="int4-awq", group_size=16),
                   input_scales=_random_factors(model, tie_o=True))  # fmt: skip
    ids = torch.randint(0, 256, (19,), generator=torch.Generator().manual_seed(4))
    before = _logits(model, ids)
    folded = fold_smoothing(model, o=False)
    assert len(folded) == 3 * len(model.layers) and not any("attn.o" in n for n in folded)
    assert all(layer.attn.o.smooth_active for layer in model.layers)
    _same_function(_logits(model, ids), before)


def test_untied_o_factors_stay_at_run_time() -> None:
    model = _tiny()
    quantize_model(model, QuantConfig(algo="int4-awq", group_size=16),
                   input_scales=_random_factors(model, tie_o=False))  # fmt: skip
    ids = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(2))
    before = _logits(model, ids)
    folded = fold_smoothing(model)
    assert not any(n.endswith("attn.o") for n in folded)
    assert all(model.get_submodule(f"layers.{i}.attn.o").smooth_active
               for i in range(len(model.layers)))  # fmt: skip
    _same_function(_logits(model, ids), before)


def test_tie_heads_averages_over_the_heads_of_a_group() -> None:
    mean = torch.arange(12.0)  # 4 query heads of 3 channels, 2 key-value heads
    st = InputStats(absmax=mean, mean_abs=mean, samples=torch.zeros(1, 12), num_rows=1)
    tied = tie_heads(st, num_heads=4, num_kv_heads=2).mean_abs.reshape(2, 2, 3)
    assert torch.equal(tied[:, 0], tied[:, 1])
    assert torch.equal(tied[0, 0], torch.tensor([1.5, 2.5, 3.5]))
    assert torch.equal(st.mean_abs, torch.arange(12.0))  # a copy


def test_identity_factors_are_skipped_and_loading_refreshes() -> None:
    model = _tiny()
    lin = model.layers[0].mlp.down
    plain = QuantLinear.from_linear(lin, "int4-awq", 16)
    assert not plain.smooth_active and plain.smooth_inv is None
    s = torch.rand(lin.in_features) + 0.5
    smoothed = QuantLinear.from_linear(lin, "int4-awq", 16, smooth=s)
    assert smoothed.smooth_active
    torch.testing.assert_close(smoothed.smooth_inv, 1 / s)
    shell = QuantLinear(lin.in_features, lin.out_features, "int4-awq", group_size=16)
    shell.load_state_dict(smoothed.state_dict())
    assert shell.smooth_active and "smooth_inv" not in smoothed.state_dict()
    shell.load_state_dict(plain.state_dict())
    assert not shell.smooth_active and shell.smooth_inv is None
    # w8a8-sq smooths x as it quantizes it: no reciprocals kept
    sq = QuantLinear.from_linear(lin, "w8a8-sq", smooth=s)
    assert sq.smooth_active and sq.smooth_inv is None


def test_build_folds_every_awq_factor_of_a_grouped_query_model() -> None:
    model = _tiny()
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5))
    report = quantize_loaded(model, QuantConfig(algo="int4-awq", group_size=16), n_tokens=256)
    entries = [e for e in report.values() if e["mode"] == "int4-awq"]
    assert entries and not any(e["runtime_smoothing"] for e in entries)
    assert not any(m.smooth_active for m in model.modules() if isinstance(m, QuantLinear))
    assert torch.isfinite(_logits(model, ids)).all()


def test_quantize_state_leaves_the_converted_state_alone() -> None:
    """A build's model shares the converted state dict's tensors, which the quality gate's
    unquantized reference reuses: folding must not change them in place."""
    from kiln.quant.build import quantize_state

    model = _tiny()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    before = {k: v.clone() for k, v in state.items()}
    qcfg = QuantConfig(algo="int4-awq", group_size=16, calib_tokens=256)
    out, _, _ = quantize_state(model.config, state, qcfg)
    assert any(k.endswith("attn_norm.weight") and not torch.equal(out[k], before[k]) for k in out)
    for k, v in before.items():
        assert torch.equal(state[k], v), k


def test_off_grid_scales_fold_exactly() -> None:
    """Scales off float16's grid (an engine built before it, loading) are multiplied as
    they are, in float32: the folded model is the same function up to float32 rounding."""
    model = _tiny()
    quantize_model(model, QuantConfig(algo="int4-awq", group_size=16),
                   input_scales=_random_factors(model, tie_o=True))  # fmt: skip
    for q in (m for m in model.modules() if isinstance(m, QuantLinear)):
        q.weight_scale = q.weight_scale.float() * (1 + 2**-13)  # off the grid
    ids = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(6))
    before = _logits(model, ids)
    fold_smoothing(model)
    up = model.layers[0].mlp.gate_up.weight_scale
    assert up.dtype == torch.float32 and not torch.equal(up.half().float(), up)
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-4, atol=1e-4)
