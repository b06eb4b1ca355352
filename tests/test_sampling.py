"""Sampling parameters, the batched sampler (penalties, filters, logprobs, seeds) and the
incremental detokenizer (UTF-8 hold-back, stop strings). Expected values are computed
independently of the code under test: by hand, or by plain-Python reference versions."""

from __future__ import annotations

import math
import random
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln import LLM, ConfigError, SamplingParams
from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.sampler import Sampler, filter_batch, filter_logits, prompt_logprobs
from kiln.runtime.sequence import Sequence
from kiln.tokenizer import ByteTokenizer, HFTokenizer

from .util import costly_sampling_params

EMOJI_TEXT = "Héllo 🦀 wörld 日本語 👨‍👩‍👧 café — naïve ✓ Ωmega 🎉🎉"


def _seq(
    params: SamplingParams,
    prompt: list[int] | None = None,
    out: list[int] | None = None,
    seed: int | None = None,
) -> Sequence:
    s = Sequence("r", list(prompt or [0]), params, 1000, sample_seed=seed)
    s.output_token_ids = list(out or [])
    return s


def _sampler(eos: tuple[int, ...] = (), seed: int = 0) -> Sampler:
    return Sampler(eos, seed)


# ---- SamplingParams -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"n": 2.0}, "n"),
        ({"n": True}, "n"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.01}, "min_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"presence_penalty": 2.01}, "presence_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
        ({"frequency_penalty": "0.1"}, "frequency_penalty"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": float("inf")}, "top_p"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ["s"] * 65}, "stop"),
        ({"stop": "x" * 257}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": 1.5}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_new_sampling_params_reject_out_of_range(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}=.* is invalid: .+\.$"):
        SamplingParams(**kwargs)


def test_stop_message_states_the_limits() -> None:
    for bad in (["s"] * 65, "x" * 257):
        with pytest.raises(ConfigError) as e:
            SamplingParams(stop=bad)
        assert "at most 64" in str(e.value) and "at most 256 characters" in str(e.value)


def test_sampling_params_accept_boundaries_and_normalize_stop() -> None:
    p = SamplingParams(
        n=128,
        min_p=1.0,
        repetition_penalty=0.01,
        presence_penalty=-2,
        frequency_penalty=2.0,
        logprobs=20,
        prompt_logprobs=0,
        stop=("a", "b" * 256),
    )
    assert p.stop == ["a", "b" * 256] and p.n == 128
    assert SamplingParams(stop="</s>").stop == ["</s>"]
    assert SamplingParams().stop == [] and SamplingParams(stop=["x"] * 64).stop == ["x"] * 64
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.5).greedy
    assert not SamplingParams().has_penalties
    assert SamplingParams(frequency_penalty=0.1).has_penalties


# ---- penalties ------------------------------------------------------------------------

ROW = [2.0, -1.0, 0.5, -0.5, 3.0, 0.0]
PROMPT, OUTPUT = [0, 1], [2, 2, 3]  # output counts: token 2 twice, token 3 once


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        # HF repetition: seen = prompt+output = {0,1,2,3}; positives / 2, negatives * 2
        ({"repetition_penalty": 2.0}, [1.0, -2.0, 0.25, -1.0, 3.0, 0.0]),
        ({"repetition_penalty": 0.5}, [4.0, -0.5, 1.0, -0.25, 3.0, 0.0]),
        # OpenAI presence: - 0.25 once for each token present in the output (2, 3)
        ({"presence_penalty": 0.25}, [2.0, -1.0, 0.25, -0.75, 3.0, 0.0]),
        # OpenAI frequency: - 0.5 * count (prompt tokens 0, 1 untouched)
        ({"frequency_penalty": 0.5}, [2.0, -1.0, -0.5, -1.0, 3.0, 0.0]),
        ({"frequency_penalty": -0.5}, [2.0, -1.0, 1.5, 0.0, 3.0, 0.0]),
        # all three: repetition first, then 0.25 - 2*0.5 - 0.25 and -1.0 - 0.5 - 0.25
        (
            {"repetition_penalty": 2.0, "frequency_penalty": 0.5, "presence_penalty": 0.25},
            [1.0, -2.0, -1.0, -1.75, 3.0, 0.0],
        ),
    ],
)
def test_penalties_match_hand_computed_values(kwargs: dict, expected: list[float]) -> None:
    seq = _seq(SamplingParams(**kwargs), PROMPT, OUTPUT)
    plain = _seq(SamplingParams(), PROMPT, OUTPUT)
    logits = torch.tensor([ROW, ROW])
    got = _sampler().adjusted_logits(logits, [seq, plain])
    assert got[0].tolist() == pytest.approx(expected)
    assert got[1].tolist() == ROW  # a row without penalties is untouched
    assert logits[0].tolist() == ROW  # the caller's tensor is not modified


def test_penalties_apply_to_greedy_rows() -> None:
    # token 4 wins unpenalized; frequency 2.0 over three outputs of token 4 makes it 3 - 6
    logits = torch.tensor([ROW, ROW])
    plain = _seq(SamplingParams(temperature=0), [1], [4, 4, 4])
    penalized = _seq(SamplingParams(temperature=0, frequency_penalty=2.0), [1], [4, 4, 4])
    assert _sampler()(logits, [plain, penalized]).token_ids == [4, 0]


def test_penalty_counts_track_a_growing_output_and_a_rewritten_one() -> None:
    """The sampler keeps counts per sequence between calls; they must equal a fresh count."""
    torch.manual_seed(0)
    vocab = 40
    p = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3)
    sampler = _sampler()
    seq = _seq(p, [3, 3, 7], [])
    rng = random.Random(1)
    for step in range(12):
        logits = torch.randn(1, vocab)
        got = sampler.adjusted_logits(logits, [seq])
        want = _sampler().adjusted_logits(logits, [_seq(p, [3, 3, 7], seq.output_token_ids)])
        assert torch.equal(got, want), step
        seq.output_token_ids.extend(rng.randrange(vocab) for _ in range(rng.choice([1, 1, 3])))
    seq.output_token_ids[:] = [5, 5]  # rewritten (e.g. a preempted sequence recomputed)
    logits = torch.randn(1, vocab)
    want = _sampler().adjusted_logits(logits, [_seq(p, [3, 3, 7], [5, 5])])
    assert torch.equal(sampler.adjusted_logits(logits, [seq]), want)


# ---- filters --------------------------------------------------------------------------


def _ref_keep(row: list[float], k: int, p: float, m: float) -> set[int]:
    """Plain-Python min-p, top-k, then top-p over what is left (float64)."""
    mx = max(row)
    probs = [math.exp(x - mx) for x in row]
    total = sum(probs)
    probs = [q / total for q in probs]
    keep = set(range(len(row)))
    if m > 0:
        keep = {i for i in keep if probs[i] >= m * max(probs)}
    if 0 < k < len(row):
        kth = sorted(row, reverse=True)[k - 1]
        keep = {i for i in keep if row[i] >= kth}
    if p < 1.0:
        mass = sum(probs[i] for i in keep)
        cum, nucleus = 0.0, set()
        for i in sorted(keep, key=lambda i: -row[i]):
            if cum >= p and nucleus:
                break
            nucleus.add(i)
            cum += probs[i] / mass
        keep = nucleus
    return keep


def _kept(x: torch.Tensor) -> set[int]:
    return set(torch.isfinite(x).nonzero().flatten().tolist())


def test_min_p_keeps_tokens_at_least_min_p_times_the_top() -> None:
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert _kept(filter_logits(logits, -1, 1.0, 0.25)) == {0, 1, 2}  # >= 0.125
    assert _kept(filter_logits(logits, -1, 1.0, 0.19)) == {0, 1, 2, 3}  # >= 0.095
    assert _kept(filter_logits(logits, -1, 1.0, 1.0)) == {0}
    assert _kept(filter_logits(logits, -1, 1.0, 0.0)) == {0, 1, 2, 3, 4}
    # min-p is a ratio: temperature 0.5 squares the ratios, 0.2/0.5 = 0.4 -> 0.16 < 0.25
    assert _kept(filter_logits(logits / 0.5, -1, 1.0, 0.25)) == {0}


def test_top_k_top_p_min_p_combined_match_a_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(8, 64, generator=gen) * 2
    combos = [(5, 0.8, 0.0), (20, 0.5, 0.05), (-1, 0.9, 0.1), (0, 1.0, 0.3), (3, 1.0, 0.0)]
    combos += [(10, 0.95, 0.02), (64, 0.7, 0.0), (1, 0.99, 0.5)]
    for row, (k, p, m) in zip(rows, combos, strict=True):
        assert _kept(filter_logits(row, k, p, m)) == _ref_keep(row.tolist(), k, p, m), (k, p, m)
    # the batched filter gives each row its own parameters
    ks, ps, ms = (list(c) for c in zip(*combos, strict=True))
    batch = filter_batch(rows, ks, ps, ms)
    for i, (k, p, m) in enumerate(combos):
        assert _kept(batch[i]) == _ref_keep(rows[i].tolist(), k, p, m)
        assert torch.equal(batch[i][torch.isfinite(batch[i])], rows[i][torch.isfinite(batch[i])])


def test_batched_filter_of_many_rows_matches_single_rows_and_the_reference() -> None:
    """37 rows (the keep counts are summed an eighth of the rows at a time, the last chunk
    shorter) with random top-k / top-p / min-p: each row as filtered alone, ties included,
    and the plain-Python reference on rows without ties (it cuts a tie where top-p's mass
    is reached; kiln keeps the whole tie)."""
    gen = torch.Generator().manual_seed(11)
    smooth = torch.randn(37, 50, generator=gen) * 2
    ks = [int(k) for k in torch.randint(-1, 60, (37,), generator=gen)]
    ps = [1.0 if i % 5 == 0 else float(p) for i, p in enumerate(torch.rand(37, generator=gen))]
    ms = [0.0 if i % 3 else float(m) / 4 for i, m in enumerate(torch.rand(37, generator=gen))]
    for rows in (smooth, smooth.round(decimals=1)):  # the second with ties
        batch = filter_batch(rows, ks, ps, ms)
        for i in range(37):
            assert torch.equal(batch[i], filter_logits(rows[i], ks[i], ps[i], ms[i])), i
    batch = filter_batch(smooth, ks, ps, ms)
    for i in range(37):
        assert _kept(batch[i]) == _ref_keep(smooth[i].tolist(), ks[i], ps[i], ms[i]), i


def _ref_probs(row: list[float], t: float, k: int, p: float, m: float) -> list[float]:
    scaled = [x / t for x in row]
    keep = _ref_keep(scaled, k, p, m)
    w = [math.exp(scaled[i]) if i in keep else 0.0 for i in range(len(row))]
    return [x / sum(w) for x in w]


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    assert all(c == 0 for c, q in zip(counts, probs, strict=True) if q == 0), counts
    return sum((c - n * q) ** 2 / (n * q) for c, q in zip(counts, probs, strict=True) if q > 0)


def test_sampled_frequencies_match_the_filtered_softmax() -> None:
    row = [2.0, 1.6, 1.2, 0.9, 0.3, -0.5, -1.0, 1.4]
    cases = [
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.3, min_p=0.2),
        SamplingParams(temperature=1.0, top_p=0.75),
    ]
    draws = 20000
    for p in cases:
        expected = _ref_probs(row, p.temperature, p.top_k, p.top_p, p.min_p)
        assert sum(q > 0 for q in expected) >= 3  # a real test of the mixture
        seqs = [_seq(p) for _ in range(draws)]
        toks = _sampler(seed=11)(torch.tensor([row]).expand(draws, -1), seqs).token_ids
        counts = [toks.count(i) for i in range(len(row))]
        # df <= 7: P(chi2 > 30) < 1e-4, while a wrong mixture gives hundreds
        assert _chi_square(counts, expected) < 30, (p, counts, expected)
    # seeded rows, one seed per row
    p = cases[0]
    seqs = [_seq(p, seed=s) for s in range(4000)]
    toks = _sampler()(torch.tensor([row]).expand(4000, -1), seqs).token_ids
    counts = [toks.count(i) for i in range(len(row))]
    expected = _ref_probs(row, p.temperature, p.top_k, p.top_p, p.min_p)
    assert _chi_square(counts, expected) < 30, counts


# ---- seeds ----------------------------------------------------------------------------


def test_seeded_rows_are_reproducible_whatever_the_batch() -> None:
    vocab, steps = 300, 6
    gen = torch.Generator().manual_seed(5)
    logits = [torch.randn(1, vocab, generator=gen) for _ in range(steps)]
    p = SamplingParams(temperature=0.9, top_k=100, top_p=0.95, min_p=0.01, seed=42)

    def run(others: list[SamplingParams], pos: int, sampler_seed: int) -> list[int]:
        seq = _seq(p, seed=42)
        mates = [_seq(q, seed=q.seed) for q in others]
        sampler = _sampler(seed=sampler_seed)
        toks = []
        for lg in logits:
            batch = [*mates[:pos], seq, *mates[pos:]]
            rows = torch.cat([lg] + [torch.randn(1, vocab) for _ in mates])
            rows[[pos, 0]] = rows[[0, pos]]  # our row sits at pos
            toks.append(sampler(rows, batch).token_ids[pos])
            seq.output_token_ids.append(toks[-1])
        return toks

    alone = run([], 0, 0)
    mixed = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.5, top_k=3, seed=7),
        SamplingParams(temperature=2.0, frequency_penalty=1.0, logprobs=2),
    ]
    assert run(mixed, 2, 123) == alone
    assert run(mixed[:1], 1, 9) == alone
    assert len(set(alone)) > 1  # it really sampled
    other = _seq(SamplingParams(temperature=0.9, seed=43), seed=43)
    assert [_sampler()(lg, [other]).token_ids[0] for lg in logits] != alone


# ---- min_tokens -----------------------------------------------------------------------


def test_one_transfer_of_typed_views_and_tokens_into_a_buffer() -> None:
    """The per-step upload is one buffer viewed in the kernels' dtypes (float32 parameter
    rows, a -inf threshold row, exact int64 seed halves and steps, the index lists): no
    conversion on the device. ``out`` receives the tokens, and a result read after the
    buffer is rewritten (the next step's sampling) still gives this step's tokens."""
    from kiln.kernels.sampling import split_seed

    sampler = _sampler()
    big = 2**64 - 3  # both halves past float32's and int32's exact range
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5, logprobs=2),
        SamplingParams(temperature=1.3, top_p=0.9),
    ]
    seqs = [_seq(p, out=[1] * i, seed=big - i) for i, p in enumerate(params)]
    step = sampler._plan(seqs, 50, torch.device("cpu"), sampling=True)
    sent = step.send(torch.device("cpu"))
    base = sent.cols.untyped_storage().data_ptr()
    for t in (sent.thr, sent.keys, *sent.idx.values()):
        assert t.untyped_storage().data_ptr() == base  # one buffer
    assert sent.cols.dtype == torch.float32 and sent.cols.shape == (7, 3)
    for t in (*sent.cols, sent.thr, sent.keys):  # 16-byte aligned, as fresh tensors are
        assert t.data_ptr() % 16 == 0  # (Triton compiles a variant per pointer alignment)
    assert sent.cols[0].is_contiguous() and torch.equal(
        sent.cols[0], torch.tensor([0.0, 1 / 0.7, 1 / 1.3], dtype=torch.float32)
    )
    assert sent.cols[1].tolist()[1] == 5.0
    assert sent.thr.tolist() == [float("-inf")] * 3
    assert sent.keys.dtype == torch.int64
    assert sent.keys.tolist() == [[*split_seed(big - i), i] for i in range(3)]
    assert sent.idx["lp_rows"].tolist() == [1]
    logits = torch.randn(3, 50)
    buf = torch.full((3,), -1, dtype=torch.int64)
    pending = sampler.sample_async(logits, seqs, out=buf)
    assert pending.tokens_device is buf and buf[0] == logits[0].argmax()
    want = buf.tolist()
    buf.fill_(7)  # the next step's sampling into the same buffer
    assert pending.result().token_ids == want
    assert pending.result().logprobs[1] is not None


def test_min_tokens_bans_eos_and_stop_token_ids() -> None:
    row = torch.tensor([[0.0, 9.0, 8.0, 7.0, 1.0]])  # eos=1 first, stop id 2 second
    sampler = _sampler(eos=(1,))
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    assert sampler(row, [_seq(p, out=[])]).token_ids == [3]
    assert sampler(row, [_seq(p, out=[4])]).token_ids == [3]
    assert sampler(row, [_seq(p, out=[4, 4])]).token_ids == [1]
    # with ignore_eos the eos token does not end the sequence, so it is not banned
    q = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2], ignore_eos=True)
    assert sampler(row, [_seq(q, out=[])]).token_ids == [1]
    # sampled rows never draw a banned token
    s = SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[2])
    toks = sampler(row.expand(3000, -1), [_seq(s) for _ in range(3000)]).token_ids
    assert 1 not in toks and 2 not in toks and 3 in toks


# ---- logprobs -------------------------------------------------------------------------


def test_logprobs_are_the_raw_distribution_with_ranks() -> None:
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(5, 200, generator=gen) * 3
    params = [
        SamplingParams(temperature=0.3, top_k=5, logprobs=3, repetition_penalty=1.5),
        SamplingParams(temperature=0, logprobs=0, frequency_penalty=2.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, top_p=0.5, logprobs=20),
        SamplingParams(temperature=1.0, min_p=0.5, logprobs=1),
    ]
    seqs = [_seq(p, [1, 2, 3], [4, 5, 5]) for p in params]
    res = _sampler()(logits, seqs)
    raw = torch.log_softmax(logits.double(), -1)
    assert res.logprobs[2] is None
    for r, p in enumerate(params):
        d = res.logprobs[r]
        if p.logprobs is None:
            continue
        assert d is not None
        tok = res.token_ids[r]
        assert tok in d
        order = raw[r].argsort(descending=True).tolist()
        top = set(order[: p.logprobs])
        assert top <= set(d) and set(d) <= top | {tok}
        assert len(d) == p.logprobs + (tok not in top)
        for t, lp in d.items():
            assert lp.logprob == pytest.approx(raw[r, t].item(), abs=1e-5)
            assert lp.rank == order.index(t) + 1
            assert lp.decoded_token is None


def test_prompt_logprobs() -> None:
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 50, generator=gen)
    nxt = [7, 0, 49, 7]
    out = prompt_logprobs(logits, nxt, 2)
    raw = torch.log_softmax(logits.double(), -1)
    assert len(out) == 4
    for m, d in enumerate(out):
        order = raw[m].argsort(descending=True).tolist()
        assert set(d) == set(order[:2]) | {nxt[m]}
        assert d[nxt[m]].rank == order.index(nxt[m]) + 1
        for t, lp in d.items():
            assert lp.logprob == pytest.approx(raw[m, t].item(), abs=1e-5)
    assert [list(d) for d in prompt_logprobs(logits, nxt, 0)] == [[t] for t in nxt]


# ---- detokenizer ----------------------------------------------------------------------


class _CountingTokenizer(ByteTokenizer):
    """ByteTokenizer that records the longest id list it was asked to decode."""

    longest = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return super().decode(ids, skip_special_tokens)


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    deltas = [detok.update(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detok.flush()]


def test_byte_tokenizer_holds_a_split_emoji_until_complete() -> None:
    tok = _CountingTokenizer()
    ids = list("a🦀b".encode())
    detok = IncrementalDetokenizer(tok, [104, 105], SamplingParams())
    deltas = _stream(detok, ids)
    assert deltas == ["a", "", "", "", "🦀", "b", ""]
    assert detok.text == "a🦀b" and not detok.finished
    long = list(("xé🦀" * 300).encode())
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    tok.longest = 0
    deltas = _stream(detok, long)
    assert "".join(deltas) == "xé🦀" * 300 and all("\ufffd" not in d for d in deltas)
    assert tok.longest <= 10  # a window, not the whole output: O(1) per token


def test_invisible_and_invalid_tokens_keep_the_window_bounded() -> None:
    tok = _CountingTokenizer()
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    ids = [300] * 200 + list(b"ok")  # ByteTokenizer decodes ids >= 256 to nothing
    assert "".join(detok.update([i]) for i in ids) == "ok"
    assert tok.longest <= 20
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    ids = [0xFF] * 200 + list(b"ok")  # invalid bytes never complete: released as U+FFFD
    tok.longest = 0
    text = "".join(detok.update([i]) for i in ids)
    assert text.endswith("ok") and set(text[:-2]) == {"\ufffd"} and tok.longest <= 20


def test_flush_releases_an_incomplete_character() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), [], SamplingParams())
    assert detok.update(list(b"ok\xf0\x9f")) == "ok"
    rest = detok.flush()
    assert rest.startswith("\ufffd") and "ok" + rest == detok.text
    assert detok.update([65]) == "" and detok.flush() == ""


@pytest.fixture(scope="module")
def smol_tokenizer() -> HFTokenizer:
    """The embedded SmolLM2 tokenizer (byte-level BPE), read from the GGUF (~15 s)."""
    from transformers import AutoTokenizer

    from kiln.checkpoint import default_model_path
    from kiln.errors import CheckpointError

    try:
        path = default_model_path()
    except CheckpointError as e:
        pytest.skip(str(e))
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    with tempfile.TemporaryDirectory() as d:
        tok.save_pretrained(d)
        return HFTokenizer(Path(d))


@pytest.mark.slow
def test_hf_tokenizer_streams_valid_utf8(smol_tokenizer: HFTokenizer) -> None:
    tok = smol_tokenizer
    prompt = tok.encode("Say something: ", add_special_tokens=False)
    ids = tok.encode(EMOJI_TEXT * 3, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert sum("\ufffd" in p for p in pieces) > 10  # characters really span tokens
    longest = 0

    class Counting:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            nonlocal longest
            longest = max(longest, len(ids))
            return tok.decode(ids, skip_special_tokens)

    counting: Any = Counting()
    for chunk in (1, 2, 3, 7):
        detok = IncrementalDetokenizer(counting, prompt, SamplingParams())
        deltas = _stream(detok, ids, chunk)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == detok.text == tok.decode(ids) == EMOJI_TEXT * 3
        if chunk == 1:  # the engine's case: a window of a few tokens, not the whole output
            assert longest <= 10 < len(ids)


@pytest.mark.slow
def test_hf_tokenizer_special_tokens_and_stop_across_tokens(smol_tokenizer: HFTokenizer) -> None:
    tok = smol_tokenizer
    ids = [*tok.encode("Hi there", add_special_tokens=False), 2, 0]  # <|im_end|>, eos
    detok = IncrementalDetokenizer(tok, [1], SamplingParams())
    assert "".join(_stream(detok, ids)) == "Hi there"
    detok = IncrementalDetokenizer(tok, [1], SamplingParams(skip_special_tokens=False))
    assert "".join(_stream(detok, ids)) == tok.decode(ids, skip_special_tokens=False)
    assert detok.text.endswith("<|im_end|><|endoftext|>")
    # "wörld 日" spans several tokens, two of them partial characters
    ids = tok.encode(EMOJI_TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["wörld 日"]))
    deltas = [detok.update([i]) for i in ids]
    assert detok.finished and detok.stop_reason == "wörld 日"
    assert "".join(deltas) == detok.text == "Héllo 🦀 " and detok.flush() == ""


def _detok(stop: list[str], include: bool = False) -> IncrementalDetokenizer:
    params = SamplingParams(stop=stop, include_stop_str_in_output=include)
    return IncrementalDetokenizer(ByteTokenizer(), [], params)


def _ref_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Scan character by character: the first stop string to complete wins."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return text[: end if include else end - len(s)], s
    return text, None


@pytest.mark.parametrize(
    "text,stops,expected,reason",
    [
        ("hello world STOP here", ["STOP"], "hello world ", "STOP"),
        ("xabcdef", ["abcde", "bcd"], "xa", "bcd"),  # "bcd" completes first
        ("xabcdef", ["bc", "abc"], "x", "abc"),  # both complete at once: the longer
        ("hello world", ["world", "lo w"], "hel", "lo w"),
        ("aaab", ["aab"], "a", "aab"),  # overlapping partial matches
        ("no stop here", ["STOP", "xyz"], "no stop here", None),
    ],
)
def test_stop_strings(text: str, stops: list[str], expected: str, reason: str | None) -> None:
    assert _ref_stop(text, stops, False) == (expected, reason)
    ids = list(text.encode())
    for chunk in (1, 2, 5, len(ids)):
        detok = _detok(stops)
        deltas = _stream(detok, ids, chunk)
        assert "".join(deltas) == detok.text == expected, chunk
        assert detok.stop_reason == reason and detok.finished == (reason is not None)
    detok = _detok(stops, include=True)
    _stream(detok, ids, 3)
    assert detok.text == _ref_stop(text, stops, True)[0]


def test_include_stop_str_in_output_drops_text_after_it() -> None:
    detok = _detok(["STOP"], include=True)
    assert detok.update(list(b"abc ST")) == "abc ST"  # nothing to hold back: kept anyway
    assert detok.update(list(b"OP and more")) == "OP"
    assert detok.text == "abc STOP" and detok.stop_reason == "STOP"
    assert detok.update(list(b"zzz")) == "" and detok.flush() == ""


def test_hold_back_then_flush() -> None:
    detok = _detok(["STOP", "<end>"])
    assert detok.update(list(b"abc ST")) == "abc "  # "ST" may start "STOP"
    assert detok.update(list(b"O")) == ""
    assert detok.update(list(b" <e")) == "STO "  # "STO " can no longer start a stop
    assert detok.text == "abc STO <e"
    assert detok.flush() == "<e" and not detok.finished and detok.stop_reason is None
    detok = _detok(["STOP"])
    assert detok.update(list(b"ab")) == "ab"  # not a prefix of any stop: nothing held
    assert detok.update(list(b"STx")) == "STx"  # the candidate failed: released


def test_random_streams_never_emit_text_that_is_later_cut() -> None:
    rng = random.Random(0)
    alphabet = "ab c🦀é"
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 30)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 5)))
            for _ in range(rng.randrange(1, 4))
        ]
        include = rng.random() < 0.3
        expected, reason = _ref_stop(text, stops, include)
        ids = list(text.encode())
        detok = _detok(stops, include)
        sent, chunk = "", rng.randrange(1, 4)
        for i in range(0, len(ids), chunk):
            sent += detok.update(ids[i : i + chunk])
            assert expected.startswith(sent), (text, stops, sent)
            assert "\ufffd" not in sent
        sent += detok.flush()
        assert sent == detok.text == expected and detok.stop_reason == reason, (text, stops)


def test_a_full_batch_of_sampling_stays_within_the_samplers_memory_reserve() -> None:
    """The GPU's KV cache is sized leaving eight float32 (max(max_batch_size, 256), vocab)
    arrays for the sampler (``kiln.runtime.memory``). On the CPU the same torch ops allocate
    the same sizes, so the allocation peak of a run with every costly option on each row
    (penalties and their pool, top-p's whole-row sort, min-p, seeds, min_tokens bans, 20
    logprobs) is measured here by the profiler's allocation events; before the sampler's
    (R, V) work went in row chunks and in place it was 9.8 arrays."""
    from torch.profiler import ProfilerActivity, profile

    rows, vocab = 256, 8192
    llm = LLM(f"dummy:tiny,vocab_size={vocab}", max_seq_len=64, max_num_tokens=1024,
              max_batch_size=rows, progress=False)  # fmt: skip
    params = costly_sampling_params(rows, max_tokens=3, min_tokens=2)
    prompts = [[(31 * i + 7 * j) % vocab for j in range(3)] for i in range(rows)]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].logprobs or []) == len(o.outputs[0].token_ids) for o in outs)
    events = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    allocs = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    assert allocs, "the profiler recorded no allocations"
    live = peak = 0
    for _, nbytes in allocs:
        live += nbytes
        peak = max(peak, live)
    array = rows * vocab * 4
    assert peak <= 8 * array, f"{peak / array:.2f} arrays"
