"""The sort-free top-p kernel (kiln.kernels.top_p) against its reference, the sampler's sort
path (kiln.runtime.filters._tail_thresholds on rows with top-p and no top-k), on fresh random
rows with ties, banned (-inf) tokens and min-p; and against the definition in float64,
which holds for both wherever rounding lets them differ. On the CPU the kernel runs under
the Triton interpreter (tests/conftest.py); on a GPU compiled, at Llama-3's vocabulary."""

from __future__ import annotations

import pytest
import torch

from kiln import SamplingParams
from kiln.kernels.top_p import top_p_thresholds_triton
from kiln.runtime.filters import _tail_thresholds
from kiln.runtime.sampler import Sampler
from tests.util import sampler_seq

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# min-p off is log(0) = -inf in the kernel, which numpy (the interpreter) warns about
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log")


def _case(
    rows: int, vocab: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, V) logits of random spread, some with a third of the row tied, some with banned
    tokens; each row's inverse temperature, top-p in (0, 1) and min-p (off on most)."""
    x = torch.randn(rows, vocab, generator=gen) * (torch.rand(rows, 1, generator=gen) * 8 + 0.1)
    for r in range(0, rows, 3):
        x[r, : max(1, vocab // 3)] = x[r, -1]  # a tie group
    if vocab > 4:
        x[1::4, 2::5] = float("-inf")  # banned tokens
    inv = torch.rand(rows, generator=gen) * 2 + 0.2
    p = torch.rand(rows, generator=gen).clamp(0.02, 0.995)
    p[0] = 0.999  # the sum's tail
    m = torch.where(torch.rand(rows, generator=gen) < 0.3, torch.rand(rows, generator=gen) * 0.2, 0)
    return x.to(DEV), inv.to(DEV), p.to(DEV), m.float().to(DEV)


def _reference(x: torch.Tensor, rows: torch.Tensor, inv: torch.Tensor, p: torch.Tensor,
               m: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The sampler's sort path on the rows ``rows`` (called directly, so that it is the
    sort whatever ``KILN_TOP_P_KERNEL`` says)."""
    n, vocab = x.shape
    k = torch.full((n,), vocab, dtype=torch.int64, device=x.device)
    return _tail_thresholds(x, rows, vocab, inv, k, p, m)


def _check_definition(x: torch.Tensor, inv: float, p: float, m: float, thr: float) -> None:
    """In float64: thr is a value of the row kept by min-p; the kept mass above it is below
    p, and above the next lower kept value it is not (within rounding of float32 sums)."""
    v = x.double()
    mx = v.max()
    keep = v >= mx + torch.log(torch.tensor(m, dtype=torch.float64)) / inv
    w = torch.where(keep, torch.exp((v - mx) * inv), 0.0)
    w = w / w.sum()
    assert bool((v == thr).any()) and bool(keep[v == thr].all()), thr
    tol = 1e-4
    assert float(w[v > thr].sum()) < p + tol, (thr, float(w[v > thr].sum()), p)
    lower = v[keep & (v < thr)]
    if lower.numel():
        nxt = lower.max()
        assert float(w[v > nxt].sum()) >= p - tol, (thr, float(w[v > nxt].sum()), p)


def _compare(n: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    x, inv, p, m = _case(n, vocab, gen)
    rows = torch.tensor([r for r in range(n) if r != 5], dtype=torch.int64, device=DEV)
    if DEV == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    got = top_p_thresholds_triton(x, rows, inv, p, m)
    if DEV == "cuda":  # the output alone (one 512-byte block): no (R, V) temporary
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - base <= 4096 + 4 * n
    want = _reference(x, rows, inv, p, m)
    same = 0
    for i, r in enumerate(rows.tolist()):
        args = (float(inv[r]), float(p[r]), float(m[r]))
        _check_definition(x[r], *args, float(got[i]))
        _check_definition(x[r], *args, float(want[i]))
        same += bool(got[i] == want[i])
    # a row whose boundary sits within rounding of p may differ (row 0, at p = 0.999)
    assert same >= len(rows) - max(1, len(rows) // 50), (got, want)


@pytest.mark.parametrize("vocab", [1, 2, 97, 1000, 4099])
def test_kernel_matches_the_sort_path(vocab: int) -> None:
    _compare(12, vocab)


@pytest.mark.gpu
def test_kernel_matches_the_sort_path_at_llama3s_vocabulary() -> None:
    _compare(256, 128256)


def test_rows_at_the_edges() -> None:
    """The top token alone (p tiny), every token (a flat row), a row whose mass is all in one
    tie group, and min-p leaving one token: each as the definition says."""
    vocab = 300
    x = torch.zeros(4, vocab)
    x[0] = torch.linspace(-5, 5, vocab)
    x[2, :50] = 3.0  # fifty tokens tied at the top, the rest far below
    x[2, 50:] = -30.0
    x[3] = torch.linspace(-20, 0, vocab)
    x = x.to(DEV)
    inv = torch.ones(4, device=DEV)
    p = torch.tensor([1e-6, 0.5, 0.3, 0.9], device=DEV)
    m = torch.tensor([0.0, 0.0, 0.0, 0.99], device=DEV)
    rows = torch.arange(4, device=DEV)
    got = top_p_thresholds_triton(x, rows, inv, p, m)
    assert float(got[0]) == float(x[0].max())
    assert float(got[1]) == 0.0  # a flat row: ties with the top, all kept
    assert float(got[2]) == 3.0  # the tie group whole
    assert float(got[3]) == float(x[3].max())  # min-p leaves the top token only
    assert torch.equal(got, _reference(x, rows, inv, p, m))


def test_the_kernel_takes_64_rows_or_more_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatch rule: CUDA (Triton) and at least ``MIN_ROWS`` rows (below, the sort was
    faster on an H100), unless switched off; a row-strided x keeps the sort."""
    from kiln.kernels import top_p

    monkeypatch.setattr(top_p, "use_triton", lambda x: True)
    x = torch.zeros(70, 16)
    assert top_p.MIN_ROWS == 64
    assert top_p.use_top_p_kernel(x, 64) and not top_p.use_top_p_kernel(x, 63)
    assert not top_p.use_top_p_kernel(x.t(), 64)
    monkeypatch.setattr(top_p, "ENABLED", False)
    assert not top_p.use_top_p_kernel(x, 256)


def test_sampler_takes_the_kernel_for_top_p_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernel switched on, the sampler's rows with top-p and no top-k get it (the
    others keep their paths) and draw the tokens the sort path draws."""
    import kiln.runtime.filters as filters

    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(12, 1000, generator=gen) * 4).to(DEV)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.7, min_p=0.05, seed=5),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9),
        SamplingParams(temperature=0),
    ]
    calls: list[int] = []

    def kernel(x: torch.Tensor, rows: torch.Tensor, *a: torch.Tensor) -> torch.Tensor:
        calls.append(rows.numel())
        return top_p_thresholds_triton(x, rows, *a)

    results = []
    for on in (False, True):
        monkeypatch.setattr(filters, "use_top_p_kernel", lambda x, rows, on=on: on)
        monkeypatch.setattr(filters, "top_p_thresholds_triton", kernel)
        seqs = [sampler_seq(params[i % 4], seed=i) for i in range(12)]
        results.append(Sampler((2,), seed=0)(logits, seqs).token_ids)
    assert calls == [6]  # rows 0, 1, 4, 5, 8, 9
    assert results[0] == results[1]


_COMPILE = """
import json
from kiln.kernels import top_p
from tests.sm90 import compile_sm90

sig = {"x_ptr": "*fp32", "stride": "i32", "rows_ptr": "*i64", "inv_temp_ptr": "*fp32",
       "top_p_ptr": "*fp32", "min_p_ptr": "*fp32", "out_ptr": "*fp32"}
k = compile_sm90(top_p._top_p_kernel, sig, {"V": 128256, "BLOCK": top_p._BLOCK,
                 "WAYS": top_p._WAYS}, top_p._NUM_WARPS, divisible=("x_ptr", "stride"))
print(json.dumps({"regs": k["regs"], "stack": k["stack"]}))
"""


def test_kernel_compiles_for_sm90() -> None:
    """Compiled for the GPU in CI (Triton's frontend and ptxas, no GPU): its search loop
    and the (BLOCK, WAYS) partial sums fit the registers without spilling (98 a thread)."""
    from tests import sm90

    got = sm90.run(_COMPILE)
    assert got["stack"] == 0 and got["regs"] <= 128, got
