"""The build's quality gate: every quantized build scores itself against the unquantized
model on held-out tokens, records it in the manifest, and refuses past --max-quality-loss,
naming the projections that lose most."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.build.builder import build_engine
from kiln.config import BuildConfig, QuantConfig
from kiln.errors import ConfigError

from .util import save_tiny_llama


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tinyhf"))


def _build(src: Path, out: Path, **q: object) -> dict:
    qc = QuantConfig(quality_tokens=64, **q)  # type: ignore[arg-type]
    return build_engine(str(src), out, BuildConfig(device="cpu", quant=qc), progress=False)


@pytest.mark.parametrize("algo", ["fp8", "int8-wo", "int4-awq", "w8a8-sq"])
def test_quality_is_measured_and_recorded(tiny_hf: Path, tmp_path: Path, algo: str) -> None:
    extra = {"group_size": 32} if algo == "int4-awq" else {}
    m = _build(tiny_hf, tmp_path / algo, algo=algo, **extra)
    q = m["quant"]["quality"]
    assert q["num_tokens"] == 63  # every token but the first is scored
    assert q["ppl_ref"] > 0 and q["ppl_test"] > 0
    assert abs(q["ppl_increase_pct"] - 100 * (q["ppl_test"] / q["ppl_ref"] - 1)) < 1e-6
    assert 0.0 <= q["top1_agreement"] <= 1.0 and q["mean_kl"] >= 0.0
    costly = q["costliest_modules"]
    assert costly and all(c["rel_output_error"] > 0 for c in costly)
    # ranked by the estimated perplexity cost of each projection alone
    est = [c["est_ppl_increase_pct"] for c in costly]
    assert est == sorted(est, reverse=True) and est[0] > 0


def test_gate_refuses_and_names_the_costliest_modules(tiny_hf: Path, tmp_path: Path) -> None:
    out = tmp_path / "refused"
    # rounded to nearest: on this random model GPTQ's int4 (act order) happens to lower the
    # perplexity (-0.05 %), which no limit refuses; so does AWQ calibrated on 16,384 tokens,
    # hence the 2,048 here (the test is about the refusal, not the calibration)
    with pytest.raises(ConfigError) as e:
        _build(tiny_hf, out, algo="int4-awq", group_size=32, weight_rounding="nearest",
               max_quality_loss=0.0, calib_tokens=2048)  # fmt: skip
    msg = str(e.value)
    assert "--max-quality-loss 0" in msg and "layers." in msg and "--exclude-modules" in msg
    assert "estimated perplexity increase of each alone" in msg
    assert not out.exists()  # nothing written


def test_gate_passes_within_the_limit(tiny_hf: Path, tmp_path: Path) -> None:
    m = _build(tiny_hf, tmp_path / "ok", algo="fp8", max_quality_loss=1000.0)
    assert m["quant"]["quality"]["ppl_increase_pct"] <= 1000.0
    assert m["quant"]["max_quality_loss"] == 1000.0


def test_gate_option_is_validated() -> None:
    with pytest.raises(ConfigError, match="max_quality_loss"):
        QuantConfig(algo="fp8", max_quality_loss=-1)


def test_fp8_kv_cache_build_calibrates_scales_and_is_measured(
    tiny_hf: Path, tmp_path: Path
) -> None:
    import torch

    from kiln import LLM, SamplingParams

    m = _build(tiny_hf, tmp_path / "kv", kv_cache_dtype="fp8")
    scales = m["quant"]["kv_scales"]
    assert len(scales) == m["model"]["num_hidden_layers"]
    assert all(k > 0 and v > 0 for k, v in scales)
    q = m["quant"]["quality"]
    assert q["ppl_test"] > 0 and q["costliest_modules"] == []  # no projection quantized
    llm = LLM(str(tmp_path / "kv"), device="cpu", progress=False)
    assert llm.kv.layers[0].dtype == torch.float8_e4m3fn
    assert torch.allclose(llm.kv.scales.cpu(), torch.tensor(scales, dtype=torch.float32))
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5


def test_auto_exclude_keeps_the_costliest_projections_until_the_gate_passes(
    tiny_hf: Path, tmp_path: Path
) -> None:
    """Past --max-quality-loss, --auto-exclude restores projections in the gate's order,
    re-measuring after each, until the loss fits; the engine records them, stores their
    unquantized weights, loads and runs."""
    from safetensors import safe_open

    from kiln import LLM, SamplingParams

    # per token: the tiny model's loss with outlier channels (fp8's default) is too small
    base = _build(tiny_hf, tmp_path / "base", algo="fp8", activation_scheme="dynamic")
    loss = base["quant"]["quality"]["ppl_increase_pct"]
    first = base["quant"]["quality"]["costliest_modules"][0]["module"]
    assert loss > 0
    limit = loss * 0.5
    m = _build(tiny_hf, tmp_path / "auto", algo="fp8", activation_scheme="dynamic",
               max_quality_loss=limit, auto_exclude=100)  # fmt: skip
    q = m["quant"]
    kept = q["auto_excluded"]
    assert kept and kept[0]["module"] == first  # the gate's own ranking
    assert [k["ppl_increase_pct_after"] for k in kept][-1] == q["quality"]["ppl_increase_pct"]
    assert q["quality"]["ppl_increase_pct"] <= limit
    assert all(k["ppl_increase_pct_after"] > limit for k in kept[:-1])  # stopped when it fit
    names = [k["module"] for k in kept]
    assert set(names) <= set(q["exclude_modules"])
    assert not set(names) & set(q["report"]["modules"])
    assert set(names) <= set(q["report"]["excluded"])
    assert all(c["module"] not in names for c in q["quality"]["costliest_modules"])
    with safe_open(str(tmp_path / "auto" / "rank0.safetensors"), "pt") as f:
        keys = set(f.keys())
        for n in names:
            assert f"{n}.weight" in keys and f"{n}.weight_scale" not in keys
            assert f.get_tensor(f"{n}.weight").dtype == f.get_tensor("embed.weight").dtype
    llm = LLM(str(tmp_path / "auto"), device="cpu", progress=False)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    from kiln.cli import describe

    assert f"kept in full precision by --auto-exclude: {names[0]}" in describe(m, tmp_path)


def test_auto_exclude_refuses_when_its_budget_is_spent(tiny_hf: Path, tmp_path: Path) -> None:
    out = tmp_path / "refused"
    with pytest.raises(ConfigError) as e:
        _build(tiny_hf, out, algo="fp8", activation_scheme="dynamic", max_quality_loss=0.0,
               auto_exclude=1)  # fmt: skip
    msg = str(e.value)
    assert "--auto-exclude kept 1 in full precision (layers." in msg
    assert "--max-quality-loss 0" in msg
    assert not out.exists()


def test_refusal_shows_the_loss_above_the_limit() -> None:
    """A loss just past the limit is printed with the digits that show it past (a refusal
    at 1 % read "rises 1.00 %"), and a spent --auto-exclude asks for a larger one."""
    from kiln.quant.build import enforce_quality_limit

    res = {"ppl_increase_pct": 1.0042, "costliest_modules": []}
    q = QuantConfig(algo="fp8", max_quality_loss=1.0, auto_exclude=2)
    kept = [{"module": "layers.1.mlp.down"}, {"module": "layers.0.attn.qkv"}]
    with pytest.raises(ConfigError) as e:
        enforce_quality_limit(res, q, kept)
    msg = str(e.value)
    assert "rises 1.004 % over" in msg and "a larger --auto-exclude (it was 2)" in msg
    with pytest.raises(ConfigError, match=r"rises 1\.50 % over .* or --auto-exclude, or"):
        enforce_quality_limit({**res, "ppl_increase_pct": 1.5}, q)
    enforce_quality_limit({**res, "ppl_increase_pct": 1.0}, q)  # at the limit: passes


@pytest.mark.parametrize(
    ("kw", "allowed"),
    [
        ({"algo": "fp8", "auto_exclude": 2}, "unless --max-quality-loss"),
        ({"algo": "int4-awq", "auto_exclude": 2, "max_quality_loss": 5.0}, "int4-awq folds"),
        ({"algo": "fp8", "auto_exclude": -1, "max_quality_loss": 5.0}, "an integer >= 0"),
        ({"algo": "fp8", "auto_exclude": True, "max_quality_loss": 5.0}, "an integer >= 0"),
    ],
)
def test_auto_exclude_is_validated(kw: dict, allowed: str) -> None:
    with pytest.raises(ConfigError, match=r"quant\.auto_exclude") as e:
        QuantConfig(**kw)
    assert allowed in str(e.value)


@pytest.mark.parametrize("algo", ["int8-wo", "w8a8-sq"])
def test_auto_exclude_restores_every_mode_it_serves(
    tiny_hf: Path, tmp_path: Path, algo: str
) -> None:
    """With a limit of 0 and room for every projection, the other modes it serves end with
    the unquantized model's perplexity: each restored projection (w8a8-sq's with its
    smoothing) is the original one. (int8-wo on the seed-0 checkpoint lowers the
    perplexity, which no limit refuses; seed 3 raises it, +0.006 %.)"""
    src = tiny_hf if algo == "w8a8-sq" else save_tiny_llama(tmp_path / "hf", seed=3)
    base = _build(src, tmp_path / "base", algo=algo)
    assert base["quant"]["quality"]["ppl_increase_pct"] > 0
    n = len(base["quant"]["report"]["modules"])
    m = _build(src, tmp_path / "auto", algo=algo, max_quality_loss=0.0, auto_exclude=n)
    q = m["quant"]
    assert q["auto_excluded"] and q["quality"]["ppl_increase_pct"] <= 0.0
    assert len(q["report"]["modules"]) == n - len(q["auto_excluded"])
