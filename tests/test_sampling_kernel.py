"""The fused sampling kernel (kiln.kernels.sampling) against its torch reference, the
counter-based noise, and the sampler's draws against the filtered softmax. On the CPU the
kernel runs under the Triton interpreter (tests/conftest.py); on a GPU the compiled kernel
runs, at larger sizes too, and the sampler is checked to make no host synchronization."""

from __future__ import annotations

import math

import pytest
import torch

from kiln import SamplingParams
from kiln.kernels.sampling import (
    NOISE_BITS,
    hash_bits_ref,
    hash_bits_triton,
    sample_ref,
    sample_splits,
    sample_triton,
    split_seed,
)
from kiln.runtime.sampler import Sampler
from tests.util import sampler_seq

DEV = "cuda" if torch.cuda.is_available() else "cpu"
VOCABS = [1, 97, 1000, 50257] + ([152064] if DEV == "cuda" else [])
SEEDS = [0, 1, 42, -1, -(2**63), 2**63 - 1, 2**64 - 1, 2**64 + 5, 123456789012345678901]


def _keys(seeds: list[int], steps: list[int]) -> torch.Tensor:
    rows = [[*split_seed(s), j] for s, j in zip(seeds, steps, strict=True)]
    return torch.tensor(rows, dtype=torch.int64, device=DEV)


def _mix_py(x: int) -> int:
    """The 32-bit finalizer in plain Python, written from the module's description."""
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def _hash_py(seed: int, step: int, v: int) -> int:
    lo, hi = split_seed(seed)
    a = _mix_py(_mix_py(_mix_py(step ^ 0x9E3779B9) ^ hi) ^ lo)
    b = _mix_py(a ^ 0x85EBCA6B)
    return _mix_py((_mix_py(v ^ a) + b) & 0xFFFFFFFF)


# ---- the hash ----------------------------------------------------------------------------


def test_hash_is_the_same_in_python_torch_and_triton() -> None:
    steps = [0, 1, 7, 2**31 - 1, 2**32 - 1, 3, 5, 11, 0]
    keys = _keys(SEEDS, steps)
    vocab = 3001
    ref = hash_bits_ref(keys, vocab)
    assert torch.equal(hash_bits_triton(keys, vocab), ref)
    assert torch.equal(hash_bits_ref(keys.cpu(), vocab), ref.cpu())
    for r, (s, j) in enumerate(zip(SEEDS, steps, strict=True)):
        for v in (0, 1, 2, 1000, vocab - 1):
            assert ref[r, v].item() == _hash_py(s, j, v), (s, j, v)
    # pinned values: a seeded request keeps its tokens from one version of kiln to the next
    assert hash_bits_ref(_keys([42], [0]), 3)[0].tolist() == [2864430410, 978337471, 75414161]
    assert hash_bits_ref(_keys([0], [5]), 49152)[0, [0, -1]].tolist() == [737112289, 2987038570]


def test_hash_bits_look_uniform_and_independent() -> None:
    """Coarse checks: uniform top bits, no repeats within a row, rows and steps unrelated."""
    keys = _keys(list(range(64)), [0] * 32 + [1] * 32)
    bits = hash_bits_ref(keys, 4096).cpu()
    u = (bits >> (32 - NOISE_BITS)).double().add(0.5) / 2**NOISE_BITS
    assert u.min() > 0 and u.max() < 1
    counts = torch.histc(u, bins=64, min=0, max=1)
    expected = u.numel() / 64
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 150, chi2  # df 63: P(chi2 > 150) < 1e-8
    assert all(len(set(row.tolist())) == 4096 for row in bits)  # a bijection per row
    c = torch.corrcoef(u[:, :4096])
    off = c - torch.eye(64, dtype=c.dtype)
    assert off.abs().max() < 0.08, off.abs().max()  # 1/sqrt(4096) = 0.016


# ---- kernel vs reference -------------------------------------------------------------


def _scores64(x: torch.Tensor, inv: torch.Tensor, thr: torch.Tensor, keys: torch.Tensor):
    """The perturbed scores in float64 from the same hash bits (greedy rows: x)."""
    bits = hash_bits_ref(keys, x.shape[1]) >> (32 - NOISE_BITS)
    u = (bits.double() + 0.5) / 2**NOISE_BITS
    s = x.double() * inv.double()[:, None] - torch.log(-torch.log(u))
    s = s.masked_fill(~(x >= thr[:, None]), float("-inf"))
    return torch.where(inv[:, None] == 0, x.double(), s)


def _case(vocab: int, gen: torch.Generator, rows: int = 8):
    x = (torch.randn(rows, vocab, generator=gen) * 3).to(DEV)
    x[torch.rand(rows, vocab, generator=gen).to(DEV) < 0.05] = float("-inf")
    x[-1] = float("-inf")  # nothing finite: index 0, as torch.argmax says
    temps = [0.0, 1.0, 0.7, 1.5, 0.05, 0.0, 2.0, 1.0]
    inv = torch.tensor([0.0 if t == 0 else 1 / t for t in temps], device=DEV)
    qs = [0.0, 0.5, 0.9, 0.99, 0.0, 0.3, 0.999, 0.0]
    finite = torch.where(torch.isinf(x), torch.nan, x).cpu()
    thr = torch.tensor(
        [float(torch.nanquantile(finite[r], q)) if q else float("-inf") for r, q in enumerate(qs)]
    )
    thr = thr.nan_to_num(float("-inf")).to(DEV)
    thr[3] = x[3].max() + 1  # a threshold above every logit: no survivor -> index 0
    keys = _keys([int(s) for s in torch.randint(0, 2**62, (rows,), generator=gen)], [9] * rows)
    return x, inv, thr, keys


@pytest.mark.parametrize("vocab", VOCABS)
def test_kernel_matches_reference(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    rows = 8
    x, inv, thr, keys = _case(vocab, gen, rows)
    got, want = sample_triton(x, inv, thr, keys), sample_ref(x, inv, thr, keys)
    scores = _scores64(x, inv, thr, keys)
    best = scores.max(-1).values
    for r in range(rows):
        g, w = int(got[r]), int(want[r])
        if g == w:
            continue
        # only a near-tie of two perturbed scores may go either way
        assert inv[r] != 0 and best[r] > float("-inf"), (r, g, w)
        assert scores[r, g] >= best[r] - 1e-4 and scores[r, w] >= best[r] - 1e-4, (r, g, w)
    assert (got == want).float().mean() >= 0.75
    for r in range(rows):
        if best[r] == float("-inf"):
            assert int(got[r]) == 0 and int(want[r]) == 0
        else:
            assert bool(x[r, int(got[r])] >= thr[r]) or inv[r] == 0
    assert torch.equal(got[inv == 0], x[inv == 0].argmax(-1))


@pytest.mark.parametrize("vocab", [1, 2049, 5003])
def test_vocabulary_split_across_programs_picks_the_same_tokens(vocab: int) -> None:
    """A row's vocabulary cut into 1-64 slices (empty slices too) with a second kernel
    taking the best: the same tokens as one program per row, bit for bit. 64 slices (the
    count at batch 1) on four of the rows (greedy, sampled with a keep-threshold, no
    survivor, nothing finite): the interpreter takes about 23 ms a program."""
    gen = torch.Generator().manual_seed(vocab + 1)
    x, inv, thr, keys = _case(vocab, gen, 8)
    one = sample_triton(x, inv, thr, keys, splits=1)
    assert torch.equal(one[inv == 0], x[inv == 0].argmax(-1))
    for sp in (2, 4):
        assert torch.equal(sample_triton(x, inv, thr, keys, splits=sp), one), sp
    r = torch.tensor([0, 2, 3, 7], device=DEV)
    assert torch.equal(sample_triton(x[r], inv[r], thr[r], keys[r], splits=64), one[r])
    with pytest.raises(ValueError, match="power of two"):
        sample_triton(x, inv, thr, keys, splits=3)
    # into a caller's buffer (the CUDA graphs' next input): the same tokens, in place
    buf = torch.full((8,), -1, dtype=torch.int64, device=DEV)
    assert sample_triton(x, inv, thr, keys, splits=2, out=buf) is buf and torch.equal(buf, one)
    with pytest.raises(ValueError, match="int64"):
        sample_triton(x, inv, thr, keys, out=buf[:7])


def test_split_count_fills_the_gpu_at_small_batches() -> None:
    assert sample_splits(1, 128256) == 64
    assert sample_splits(8, 128256) == 64  # cdiv(264, 8) = 33 -> 64
    assert sample_splits(40, 128256) == 8  # 7 -> 8
    assert sample_splits(66, 128256) == 4
    assert sample_splits(88, 128256) == 1  # three slices: not worth a second kernel
    assert sample_splits(300, 128256) == 1
    assert sample_splits(1, 1000) == 1  # one chunk of the vocabulary
    assert sample_splits(2, 4099) == 1  # three chunks: fewer than four slices
    assert sample_splits(2, 8193) == 8  # five chunks -> 8 (three empty)


def test_kernel_ties_go_to_the_lowest_index() -> None:
    x = torch.zeros(3, 4099, device=DEV)
    x[0, [5, 3000, 4098]] = 2.0
    x[2, [2049, 4097]] = 7.0
    inv = torch.zeros(3, device=DEV)
    thr = torch.full((3,), float("-inf"), device=DEV)
    keys = _keys([1, 2, 3], [0, 0, 0])
    for fn in (sample_triton, sample_ref):
        assert fn(x, inv, thr, keys).tolist() == [5, 0, 2049]


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    assert all(c == 0 for c, q in zip(counts, probs, strict=True) if q == 0), counts
    return sum((c - n * q) ** 2 / (n * q) for c, q in zip(counts, probs, strict=True) if q > 0)


def test_draws_follow_the_softmax_of_the_survivors() -> None:
    """Many rows with the same logits and their own seeds; and one seed over many steps.
    The Triton interpreter is slow per row, so on the CPU the counts come from the reference
    and the kernel is checked to pick the same tokens on a slice of the rows."""
    row = torch.tensor([2.0, 1.6, 1.2, 0.9, 0.3, -0.5, -1.0, 1.4, float("-inf"), 0.0, -3.0])
    t, thr = 0.8, 0.25  # survivors: logits >= 0.25
    w = [math.exp(v / t) if v >= thr else 0.0 for v in row.tolist()]
    probs = [q / sum(w) for q in w]
    n = 3000
    x = row.to(DEV).expand(n, -1).contiguous()
    inv = torch.full((n,), 1 / t, device=DEV)
    th = torch.full((n,), thr, device=DEV)
    part = n if DEV == "cuda" else 60
    for keys in (_keys(list(range(n)), [0] * n), _keys([77] * n, list(range(n)))):
        toks = sample_ref(x, inv, th, keys).tolist()
        assert sample_triton(x[:part], inv[:part], th[:part], keys[:part]).tolist() == toks[:part]
        counts = [toks.count(i) for i in range(len(probs))]
        # df 6: P(chi2 > 30) < 1e-4, while a wrong mixture gives hundreds
        assert _chi_square(counts, probs) < 30, counts


# ---- the sampler ------------------------------------------------------------------------


def test_sampler_frequencies_with_filters_and_penalties() -> None:
    """End to end: frequency penalty, then min-p, top-k and top-p, then the draw."""
    row = [2.0, 1.6, 1.2, 0.9, 0.3, -0.5, -1.0, 1.4]
    p = SamplingParams(temperature=0.9, top_k=6, top_p=0.9, min_p=0.1, frequency_penalty=1.0)
    n = 4000
    seqs = [sampler_seq(p, seed=s) for s in range(n)]
    for s in seqs:
        s.output_token_ids = [0]  # token 0 penalized: 2.0 - 1.0
    toks = Sampler((), seed=3)(torch.tensor([row], device=DEV).expand(n, -1), seqs).token_ids
    pen = [1.0, *row[1:]]
    scaled = [v / 0.9 for v in pen]
    order = sorted(range(8), key=lambda i: -scaled[i])
    e = [math.exp(v - max(scaled)) for v in scaled]
    keep = {i for i in order[:6] if e[i] >= 0.1 * max(e)}
    mass, cum, nucleus = sum(e[i] for i in keep), 0.0, set()
    for i in [i for i in order if i in keep]:
        if cum >= 0.9:
            break
        nucleus.add(i)
        cum += e[i] / mass
    w = [e[i] if i in nucleus else 0.0 for i in range(8)]
    probs = [q / sum(w) for q in w]
    assert sum(q > 0 for q in probs) >= 3
    assert _chi_square([toks.count(i) for i in range(8)], probs) < 30


@pytest.mark.gpu
def test_sample_async_makes_no_host_synchronization() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 32000, generator=gen).to(DEV)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, logprobs=3),
        SamplingParams(temperature=1.0, min_p=0.05, seed=5, repetition_penalty=1.2),
        SamplingParams(temperature=0.7, top_p=0.8, min_tokens=3, stop_token_ids=[7]),
    ]
    seqs = [sampler_seq(params[i % 4]) for i in range(64)]
    sampler = Sampler((2,), seed=0)
    want = sampler(logits, seqs)  # warm-up: kernels compiled, penalty pool grown
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = sampler.sample_async(logits, seqs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = pending.result()
    assert got.token_ids == want.token_ids


@pytest.mark.gpu
def test_cuda_sampler_matches_the_cpu_one() -> None:
    """The whole pipeline (penalties, bans, thresholds, kernel, logprobs) on the GPU picks
    the CPU's tokens, but for near-ties of two perturbed scores."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(96, 49152, generator=gen) * 4
    params = [
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, logprobs=3),
        SamplingParams(temperature=1.0, min_p=0.05, seed=5, repetition_penalty=1.2),
        SamplingParams(temperature=0.7, top_p=0.8, min_tokens=3, stop_token_ids=[7]),
        SamplingParams(temperature=1.3, frequency_penalty=0.5, presence_penalty=0.3),
    ]
    results = []
    for dev in ("cpu", "cuda"):
        seqs = [sampler_seq(params[i % 5], seed=1000 + i) for i in range(96)]
        for s in seqs:
            s.output_token_ids = [3, 3, 9]
        results.append(Sampler((2,), seed=0)(logits.to(dev), seqs))
    cpu, gpu = results
    same = sum(a == b for a, b in zip(cpu.token_ids, gpu.token_ids, strict=True))
    assert same >= 94, (cpu.token_ids, gpu.token_ids)
    for a, b in zip(cpu.logprobs, gpu.logprobs, strict=True):
        assert (a is None) == (b is None)
        for tok in set(a or {}) & set(b or {}):
            assert a[tok].logprob == pytest.approx(b[tok].logprob, abs=1e-4)


def test_sampler_through_the_kernel_matches_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatcher sends the sampler's rows through the kernel (interpreted on the CPU)
    and the reference alike: same tokens on well-separated random logits."""
    import kiln.kernels.sampling as ks

    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(16, 1000, generator=gen) * 4).to(DEV)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, logprobs=3),
        SamplingParams(temperature=1.0, min_p=0.05, seed=5, repetition_penalty=1.2),
        SamplingParams(temperature=0.7, top_p=0.8, min_tokens=3, stop_token_ids=[7]),
    ]
    results = []
    for triton_on in (False, True):
        monkeypatch.setattr(ks, "use_triton", lambda x, on=triton_on: on)
        seqs = [sampler_seq(params[i % 4], seed=i) for i in range(16)]
        results.append(Sampler((2,), seed=0)(logits, seqs).token_ids)
    assert results[0] == results[1]
