"""Quality measurement (kiln.quant.quality), the calibration / held-out corpus
(kiln.quant.calib) and ``kiln eval``."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path
from unittest import mock

import pytest
import torch

from kiln import LLM
from kiln.cli import main
from kiln.errors import ConfigError
from kiln.quant.calib import TextFileError, default_corpus, load_text, paragraphs, split_corpus
from kiln.quant.calibration import MIN_CALIB_TEXT_TOKENS, calibration_token_ids
from kiln.quant.quality import compare, evaluate, token_windows

from .util import save_tiny_llama

# ---- corpus ------------------------------------------------------------------------------


def test_corpus_is_deterministic_long_and_splits_into_disjoint_interleaved_halves() -> None:
    text = default_corpus()
    assert text == default_corpus.__wrapped__()  # computed again, not the cached copy
    assert len(text) >= 40_000
    paras = paragraphs(text)
    assert len(paras) == len(set(paras))
    calib, heldout = split_corpus(text)
    c, h = paragraphs(calib), paragraphs(heldout)
    assert not set(c) & set(h)
    assert abs(len(c) - len(h)) <= 1 and sorted(c + h) == sorted(paras)
    assert h[0] == paras[0] and c[0] == paras[1] and h[1] == paras[2]  # interleaved
    assert split_corpus(text) == (calib, heldout)
    quarter, _ = split_corpus(text, calib_fraction=0.25)
    assert abs(len(paragraphs(quarter)) - len(paras) / 4) <= 1
    assert load_text() == heldout and load_text(part="calib") == calib
    with pytest.raises(ConfigError, match="calib_fraction"):
        split_corpus(text, calib_fraction=1.0)


def test_load_text_names_the_path_of_a_bad_file(tmp_path: Path) -> None:
    good = tmp_path / "good.txt"
    good.write_text("Some text.\n", encoding="utf-8")
    assert load_text(good) == "Some text.\n"
    empty, binary = tmp_path / "empty.txt", tmp_path / "binary.txt"
    empty.write_text("  \n")
    binary.write_bytes(b"\xff\xfe\x00bad")
    for path, why in [
        (tmp_path / "missing.txt", "does not exist"),
        (empty, "is blank"),
        (binary, "not UTF-8"),
        (tmp_path, "directory"),
    ]:
        with pytest.raises(ConfigError, match=why) as e:
            load_text(path)
        assert str(path) in str(e.value)
        # the short reason --calib-text quotes: the path and the problem, no advice
        assert isinstance(e.value, TextFileError) and why in e.value.reason
        assert str(path) in e.value.reason and "give a file" not in e.value.reason


def test_calibration_text_too_short_refused_with_its_token_count(tmp_path: Path) -> None:
    class Words:  # one token a word
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [len(w) for w in text.split()]

    f = tmp_path / "calib.txt"
    f.write_text("one two three")
    with pytest.raises(ConfigError) as e:
        calibration_token_ids(Words(), f, 64)
    msg = str(e.value)
    assert "quant.calib_text=" in msg and f"at least {MIN_CALIB_TEXT_TOKENS} tokens" in msg, msg
    assert "(this one has 3)" in msg, msg
    f.write_text(" ".join(["word"] * MIN_CALIB_TEXT_TOKENS))  # the shortest allowed
    assert calibration_token_ids(Words(), f, 64) == [4] * 64  # repeated to length
    # the text given (read already) instead of the file; fewer tokens are a prefix of more
    f.write_text(" ".join(["a", "bb", "ccc"] * 7))
    text = " ".join(["dddd", "e"] * 9)
    ids = calibration_token_ids(Words(), f, 50, text=text)
    assert ids == ([4, 1] * 25) and calibration_token_ids(Words(), f, 17, text=text) == ids[:17]
    assert calibration_token_ids(Words(), f, 50)[:21] == [1, 2, 3] * 7


# ---- windows -----------------------------------------------------------------------------


@pytest.mark.parametrize("bos", [None, 7])
@pytest.mark.parametrize("window,stride", [(8, None), (8, 3), (5, 1)])
def test_token_windows_score_every_token_once(
    bos: int | None, window: int, stride: int | None
) -> None:
    ids = list(range(100, 131))
    scored: list[int] = []
    for w in token_windows(ids, window, stride, bos):
        assert 2 <= len(w.ids) <= window and w.score_from >= 1
        if bos is not None:
            assert w.ids[0] == bos
        scored += w.ids[w.score_from :]
    assert len(scored) == len(set(scored)) and set(scored) <= set(ids)
    span = window - (bos is not None)
    if bos is not None and stride is not None:
        assert scored == ids
    elif stride is not None:  # overlapping windows: only the very first token lacks context
        assert scored == ids[1:]
    elif bos is None:  # the first token of every window has no context
        assert scored == [t for i, t in enumerate(ids) if i % span]


# ---- metrics on dummy and tiny models ----------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("dummy:tiny", progress=False)


def test_model_against_itself(tiny: LLM) -> None:
    r = compare(tiny, tiny, load_text(), max_tokens=400, window=96, stride=64)
    assert r.num_tokens == 399 and r.window == 96
    assert r.ppl_ref == r.ppl_test and r.ppl_increase_pct == 0.0
    assert r.top1_agreement == 1.0 and abs(r.mean_kl) < 1e-6
    assert r.ppl_increase_ci95 == (0.0, 0.0)
    p = evaluate(tiny, load_text(), max_tokens=400, window=96, stride=64)
    assert p.ppl == pytest.approx(r.ppl_ref, rel=1e-9) and p.num_tokens == 399
    assert math.exp(p.mean_nll) == pytest.approx(p.ppl)


def test_perplexity_increase_interval_over_windows(tiny: LLM) -> None:
    other = LLM("dummy:tiny,num_hidden_layers=1", progress=False)
    r = compare(tiny, other, load_text(), max_tokens=600, window=64)
    lo, hi = r.ppl_increase_ci95
    assert r.num_windows >= 9 and lo < r.ppl_increase_pct < hi
    assert r.to_dict()["ppl_increase_ci95"] == (lo, hi)
    # the interval is the spread of the windows' own increases, resampled
    from kiln.quant.quality import _bootstrap_ci

    same = [(10.0, 11.0, 5)] * 8  # every window +20 % (exp(1/5) - 1)
    assert _bootstrap_ci(same) == pytest.approx((100 * math.expm1(0.2),) * 2)
    spread = [(10.0, 11.0, 5), (10.0, 10.0, 5)] * 4
    lo2, hi2 = _bootstrap_ci(spread)
    assert 0.0 <= lo2 < 100 * math.expm1(0.1) < hi2 <= 100 * math.expm1(0.2)
    assert _bootstrap_ci(spread) == (lo2, hi2)  # a fixed seed


def test_vocabulary_mismatch_refused(tiny: LLM) -> None:
    other = LLM("dummy:tiny,vocab_size=256", progress=False)
    with pytest.raises(ConfigError, match="vocabulary"):
        compare(tiny, other, "some text to score")


@pytest.mark.parametrize("add_bos", [False, True])
def test_perplexity_matches_transformers(tmp_path: Path, add_bos: bool) -> None:
    from transformers import LlamaForCausalLM

    hf_dir = save_tiny_llama(tmp_path / "hf")
    llm = LLM(hf_dir, progress=False)
    text = load_text()[:700]
    window, stride = 64, 40
    report = evaluate(llm, text, window=window, stride=stride, add_bos=add_bos)

    ids = list(text.encode("utf-8"))  # engines without a tokenizer read UTF-8 bytes
    hf = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    total, count = 0.0, 0
    bos = hf.config.bos_token_id if add_bos else None
    for w in token_windows(ids, window, stride, bos):
        labels = torch.tensor([w.ids])
        labels[0, : w.score_from] = -100
        with torch.no_grad():
            loss = hf(torch.tensor([w.ids]), labels=labels).loss
        total += loss.item() * w.num_scored
        count += w.num_scored
    assert report.num_tokens == count
    assert report.ppl == pytest.approx(math.exp(total / count), rel=1e-4)


# ---- the embedded SmolLM2 ----------------------------------------------------------------


def test_smollm2_fake_quantized_weights_raise_perplexity(smollm2_llm: LLM) -> None:
    """Round-to-nearest int4 (per output row) of every MLP down-projection: a copy of the
    model that shares every other tensor with the original."""
    engine = smollm2_llm.engine
    params = dict(engine.model.named_parameters())
    targets = [n for n in params if n.endswith("mlp.down.weight")]
    assert targets
    shared = {id(p): p for n, p in params.items() if n not in targets}
    noisy = copy.deepcopy(engine.model, memo=shared)
    with torch.no_grad():
        for name, w in noisy.named_parameters():
            if name in targets:
                scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 7
                w.copy_((w / scale).round().clamp(-8, 7) * scale)
    assert not torch.equal(params[targets[0]], dict(noisy.named_parameters())[targets[0]])
    perturbed = dataclasses.replace(engine, model=noisy)
    ids = smollm2_llm.tokenizer.encode(load_text(), add_special_tokens=False)[:200]
    r = compare(smollm2_llm, perturbed, ids)
    assert r.num_tokens == 199 and r.num_windows == 1
    assert 1.0 < r.ppl_ref < 200.0  # a real model on English text
    assert r.ppl_increase_pct > 0.0 and r.top1_agreement < 1.0 and r.mean_kl > 0.0


# ---- kiln eval ---------------------------------------------------------------------------


def test_cli_eval_perplexity(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--model", "dummy:tiny", "--max-tokens", "300", "--window", "128"]) == 0
    out = capsys.readouterr().out
    assert "297 tokens scored in 3 windows" in out
    assert float(out.split("perplexity")[1].split()[0]) > 1.0


def test_cli_eval_against_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["eval", "--model", "dummy:tiny", "--against", "dummy:tiny,num_hidden_layers=1"]
    assert main([*argv, "--max-tokens", "200", "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["num_tokens"] == 199 and report["against"] == "dummy:tiny,num_hidden_layers=1"
    for key in ("ppl_ref", "ppl_test", "ppl_increase_pct", "top1_agreement", "mean_kl"):
        assert math.isfinite(report[key])
    assert report["ppl_increase_pct"] != 0.0 and "increase" in captured.err

    assert main(["eval", "--model", "dummy:tiny", "--against", "dummy:tiny", "--json"]) == 0
    same = json.loads(capsys.readouterr().out)
    assert same["ppl_increase_pct"] == 0.0 and same["top1_agreement"] == 1.0


def test_cli_eval_interval_needs_two_windows(capsys: pytest.CaptureFixture[str]) -> None:
    """A resample of one window is that window, so one window prints no interval (and
    says how to get one); several print theirs. ``kiln inspect`` words it the same way."""
    from kiln.quant.cli_options import quant_desc
    from kiln.quant.eval_cli import summary

    argv = ["eval", "--model", "dummy:tiny", "--against", "dummy:tiny,num_hidden_layers=1"]
    assert main([*argv, "--max-tokens", "200", "--window", "256"]) == 0
    out = capsys.readouterr().out
    assert "scored in 1 window of up to" in out and "one window of text: no interval" in out
    assert "95 % interval" not in out
    assert main([*argv, "--max-tokens", "300", "--window", "128"]) == 0
    assert "95 % interval over the text's windows" in capsys.readouterr().out
    one = {"num_tokens": 1, "num_windows": 1, "window": 256, "ppl": 2.0, "mean_nll": 0.69}
    assert (
        summary(one, "m", None, "t")[0] == "text        t: 1 token scored in 1 window of up to 256"
    )
    quality = {"ppl_increase_pct": 1.5, "ppl_increase_ci95": [1.5, 1.5], "top1_agreement": 0.9}
    q = {"algo": "int8-wo", "quality": {**quality, "num_windows": 1}}
    assert "one window of text: no interval" in quant_desc(q)
    q["quality"]["num_windows"] = 4
    assert "(95 % interval +1.50 to +1.50)" in quant_desc(q)


def test_cli_eval_bad_text_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-file.txt"
    assert main(["eval", "--model", "dummy:tiny", "--text", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kiln eval: error: ") and str(missing) in err[-1]


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["--window", "0"], "window=0 is invalid: at least 2 tokens"),
        (["--max-tokens", "1"], "max_tokens=1 is invalid: at least 2 tokens"),
        (["--stride", "0"], "stride=0 is invalid"),
        (["--against", "/no/such/model"], "against='/no/such/model' is invalid: an existing path"),
        (["--model", "/no/such/model"], "model='/no/such/model' is invalid: an existing path"),
    ],
)
def test_cli_eval_refuses_before_loading_a_model(
    argv: list[str], expect: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kiln import llm as llm_mod

    with mock.patch.object(llm_mod.LLM, "__init__", side_effect=AssertionError("loaded")):
        assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kiln eval: error: ") and expect in err[0], err
