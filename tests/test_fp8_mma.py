"""The tensor-core fp8 matmul for one to 32 rows (``kiln.kernels.fp8_mma``): compiled for
sm_90 without a GPU (its ``mma`` count per token tile, 16-byte loads, one PDL wait, no
spills), its launch arguments, its candidates, the dispatch from the fp8 skinny path, and
on a GPU the kernel against ``fp8_skinny_ref`` on fresh random e4m3 inputs (odd N, one to
32 rows, per-row and per-tensor activation scales, bias, split-K)."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.kernels import fp8_mma
from kiln.kernels.fp8_gemv import fp8_skinny_ref, fp8_skinny_triton
from kiln.kernels.fp8_mma import CHUNK, fp8_mma_candidates, fp8_mma_ok
from kiln.quant.formats import FP8_DTYPE

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(m: int, n: int, k: int, per_row: bool, bias: bool):
    xq = (torch.randn(m, k, device=DEV) * 60).clamp(-448, 448).to(FP8_DTYPE)
    wq = (torch.randn(n, k, device=DEV) * 60).clamp(-448, 448).to(FP8_DTYPE)
    sx = torch.rand(m if per_row else 1, 1, device=DEV) * 0.01 + 1e-3
    sw = (torch.rand(n, device=DEV) * 0.01 + 1e-3).to(torch.bfloat16)
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16) if bias else None
    return xq, sx, wq, sw, b


def test_candidates() -> None:
    """MMA configurations for K in whole 64-code chunks only, split-K only where each split
    has at least two steps of its warps."""
    assert fp8_mma_candidates(4096, 4000) == []
    cands = fp8_mma_candidates(4096, 4096)
    assert cands and all(c["MMA"] for c in cands)
    for c in cands:
        assert c["SPLIT_K"] == 1 or 4096 // (CHUNK * c["num_warps"]) >= 2 * c["SPLIT_K"]
    assert max(c["SPLIT_K"] for c in fp8_mma_candidates(4096, 192)) == 1


def test_launch_arguments(monkeypatch) -> None:
    """An ``MMA`` configuration reaches ``_fp8_mma_kernel`` through the fp8 skinny entry:
    x and w as int32 words (strides in words), one x scale per row or one in all, whole
    chunks per split, a grid of 16 R rows by splits, then the split-K reduction
    (recorded on the CPU)."""
    calls, reduced = [], []

    class Rec:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))

    import kiln.kernels.gemv as gemv

    monkeypatch.setattr(fp8_mma, "_fp8_mma_kernel", Rec())
    monkeypatch.setattr(fp8_mma, "fp8_mma_ok", lambda xq, wq: True)
    monkeypatch.setattr(gemv, "split_k_reduce", lambda part, out, b: reduced.append(part))
    m, n, k = 3, 100, 640
    xq, sx, wq, sw, b = _case(m, n, k, True, True)
    cfg = {"MMA": True, "R": 2, "SPLIT_K": 3, "num_warps": 4}
    fp8_skinny_triton(xq, sx, wq, sw, b, torch.bfloat16, cfg)
    ((grid, a, kw),) = calls
    xi, wi, sxa, swa, bias, out, part, mm, nn, kk, sxm, swn, som, sx_row, kps = a
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert grid == (4, 3)  # ceil(100 / 32) row blocks; 10 chunks in splits of 4, 4, 2
    assert xi.dtype == wi.dtype == torch.int32 and xi.shape == (m, k // 4)
    assert (sxm, swn, som, sx_row, kps) == (k // 4, k // 4, n, 1, 256)
    assert (mm, nn, kk) == (m, n, k) and bias is b and part.shape == (3, m, n)
    assert sxa.dtype == torch.float32 and sxa.numel() == m and swa.numel() == n
    assert kw["R"] == 2 and kw["NW"] == 4 and kw["SPLIT_K"] == 3 and kw["HAS_BIAS"]
    assert kw["NT"] == 1  # one token tile of eight for three rows
    assert len(reduced) == 1 and reduced[0] is part
    calls.clear()
    fp8_skinny_triton(xq, sx[:1], wq, sw, None, torch.bfloat16, {**cfg, "SPLIT_K": 1})
    assert calls[0][1][13] == 0 and calls[0][0] == (4, 1)  # one scale in all; no split
    for m, nt in ((9, 2), (16, 2), (17, 3), (32, 4)):  # a token tile per eight rows
        calls.clear()
        xq, sx, wq, sw, b = _case(m, n, k, True, True)
        fp8_skinny_triton(xq, sx, wq, sw, b, torch.bfloat16, cfg)
        assert calls[0][2]["NT"] == nt and calls[0][1][7] == m


def test_refusals(monkeypatch) -> None:
    """The kernel refuses what it cannot take (CPU tensors, K past whole chunks, more than
    32 rows) with the shapes and the limits in the message; the decode path then keeps
    ``torch._scaled_mm`` rather than raising (``formats.fp8_small``)."""
    from kiln.quant import formats
    from kiln.quant.formats import QuantAct

    xq, sx, wq, sw, _ = _case(2, 64, 192, True, False)
    if DEV == "cpu":
        assert not fp8_mma_ok(xq, wq)
    with pytest.raises(ValueError, match="fp8 mma: x \\(2, 100\\)"):
        fp8_mma.fp8_mma(xq[:, :100], sx, wq[:, :100], sw, None, torch.bfloat16,
                        {"R": 1, "SPLIT_K": 1, "num_warps": 4})  # fmt: skip
    x33 = _case(33, 64, 192, True, False)[0]
    if DEV == "cuda":
        assert fp8_mma_ok(x33[:32], wq) and not fp8_mma_ok(x33, wq)
    with pytest.raises(ValueError, match=r"x \(33, 192\).*at most 32 rows"):
        fp8_mma.fp8_mma(x33, sx[:1], wq, sw, None, torch.bfloat16,
                        {"R": 1, "SPLIT_K": 1, "num_warps": 4})  # fmt: skip
    monkeypatch.setattr(formats, "fp8_skinny_config", lambda n, k, m: {"MMA": True, "R": 1,
                                                                       "SPLIT_K": 1,
                                                                       "num_warps": 4})  # fmt: skip
    monkeypatch.setattr(formats, "fp8_mma_ok", lambda xq, wq: False)
    assert formats.fp8_small(QuantAct(xq, sx), wq, sw, None, torch.bfloat16) is None


_COMPILE = """
import json, os
from kiln.kernels import fp8_mma
from tests.sm90 import compile_sm90

sig = {"x_ptr": "*i32", "w_ptr": "*i32", "sx_ptr": "*fp32", "sw_ptr": "*bf16",
       "b_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32"}
for a in "M N K stride_xm stride_wn stride_om sx_row k_per_split".split():
    sig[a] = "i32"
div = ("x_ptr", "w_ptr", "sx_ptr", "sw_ptr", "b_ptr", "out_ptr", "part_ptr", "N", "K",
       "stride_xm", "stride_wn", "stride_om", "k_per_split")
out = []
for r, nw, split, nt in json.loads(os.environ["CFGS"]):
    consts = {"R": r, "SPLIT_K": split, "NW": nw, "HAS_BIAS": True, "PDL": True, "NT": nt}
    p = compile_sm90(fp8_mma._fp8_mma_kernel, sig, consts, nw, gluon=True, divisible=div)
    ptx = p["ptx"]
    out.append({"stack": p["stack"], "regs": p["regs"],
                "mma": ptx.count("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32"),
                "v4": sum(ln.count(".v4.b32") for ln in ptx.splitlines() if "ld.global" in ln),
                "wait": ptx.count("griddepcontrol.wait")})
print(json.dumps(out))
"""


def test_compiles_for_sm90(monkeypatch) -> None:
    """Without a GPU: every candidate compiles for sm_90 without spills at one and at four
    token tiles (8 and 32 rows), with two e4m3 ``mma`` per group of sixteen rows and token
    tile in the loop, 16-byte loads of weights and x (two weight rows a group, before the
    loop and in it, and x once per token tile), and one PDL wait."""
    from tests import sm90

    cfgs = sorted({(c["R"], c["num_warps"], c["SPLIT_K"], nt)
                   for c in fp8_mma_candidates(4096, 14336) for nt in (1, 4)})  # fmt: skip
    monkeypatch.setenv("CFGS", json.dumps(cfgs))
    got = sm90.run(_COMPILE)
    assert len(got) == len(cfgs)
    for (r, _, _, nt), g in zip(cfgs, got, strict=True):
        assert g["stack"] == 0 and g["wait"] == 1, g
        assert g["mma"] == 2 * r * nt, g
        assert g["v4"] == 4 * r + nt, g


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 2, 4, 5, 8, 9, 16, 23, 32])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 4160), (6144, 4096), (4096, 14336),
                                 (37, 192)])  # fmt: skip
def test_matches_reference_on_gpu(m: int, n: int, k: int) -> None:
    """Every candidate against the reference (per-row scales and bias; per-tensor without
    bias), and in a CUDA graph."""
    torch.manual_seed(m * 7 + n)
    for per_row, bias in ((True, True), (False, False)):
        xq, sx, wq, sw, b = _case(m, n, k, per_row, bias)
        ref = fp8_skinny_ref(xq, sx, wq, sw, b, torch.bfloat16).float()
        for cfg in fp8_mma_candidates(n, k):
            out = fp8_mma.fp8_mma(xq, sx, wq, sw, b, torch.bfloat16, cfg)
            torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2, msg=str(cfg))
    cfg = fp8_mma_candidates(n, k)[0]
    fp8_mma.fp8_mma(xq, sx, wq, sw, b, torch.bfloat16, cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_mma.fp8_mma(xq, sx, wq, sw, b, torch.bfloat16, cfg)
    xq.copy_(((torch.randn(m, k, device=DEV) * 60).clamp(-448, 448)).to(FP8_DTYPE))
    graph.replay()
    torch.cuda.synchronize()
    ref = fp8_skinny_ref(xq, sx, wq, sw, b, torch.bfloat16).float()
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
