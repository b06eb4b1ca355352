"""W4A16 / W8A16 kernels (kiln.kernels.wq_gemm) against their float32 reference on fresh
random inputs of odd sizes: group sizes, smoothing factors, bias, split-K (even and
uneven), and the dequantizing kernel of the large-M path. Interpreter on the CPU; on a GPU
the compiled kernels at real sizes, in bfloat16, and the dispatcher.
Tolerance, relative to the largest output: float32 1e-5; bfloat16 4 ulp (2^-6)."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import wq_gemm as wq
from kiln.quant import formats as qf

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 4 * 2**-8, torch.float16: 4 * 2**-11}
CFG = {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    rel = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
    assert rel <= TOL[dtype], f"relative error {rel:.3e} > {TOL[dtype]:.1e}"


def _int4(n: int, k: int, g: int) -> tuple[torch.Tensor, ...]:
    u, s, z = qf.quantize_int4(torch.randn(n, k, device=DEV), g)
    return qf.pack_int4(u), s, z


SHAPES = [(1, 40, 128, 32), (3, 70, 224, 32), (17, 33, 192, 64), (5, 9, 256, 128), (2, 11, 192, 96)]
if DEV == "cuda":
    SHAPES += [(1, 4096, 4096, 128), (8, 6144, 4096, 128), (16, 4096, 14336, 128),
               (64, 28672, 4096, 64), (33, 512, 1024, 32)]  # fmt: skip


@pytest.mark.parametrize("m,n,k,g", SHAPES)
@pytest.mark.parametrize("split", [1, 2, 3])
@pytest.mark.parametrize("smooth,bias", [(False, False), (True, True)])
@pytest.mark.parametrize("fma", [False, True])
def test_int4_kernel(
    m: int, n: int, k: int, g: int, split: int, smooth: bool, bias: bool, fma: bool
) -> None:
    dtypes = [torch.float32] + ([torch.bfloat16] if DEV == "cuda" or not smooth else [])
    dtypes += [torch.float16] if DEV == "cuda" else []  # the float16 bias of the codes
    p, s, z = _int4(n, k, g)
    sm = torch.rand(k, device=DEV) + 0.5 if smooth else None
    for dtype in dtypes:
        x = torch.randn(m, k, device=DEV).to(dtype)
        b = torch.randn(n, device=DEV).to(dtype) if bias else None
        # the broadcast kernel's K tiles may hold two groups
        bk = 2 * g if fma and g in (32, 64) else min(64, g & -g)
        cfg = CFG | {"SPLIT_K": split, "BLOCK_K": bk, "FMA": fma}
        got = wq.wq_linear_triton(x, p, s, z, sm, b, config=cfg)
        _close(got, wq.wq_linear_ref(x, p, s, z, sm, b), dtype)
        if DEV == "cuda":  # the default configuration too
            _close(
                wq.wq_linear_triton(x, p, s, z, sm, b), wq.wq_linear_ref(x, p, s, z, sm, b), dtype
            )


@pytest.mark.parametrize("m,n,k", [(1, 40, 100), (7, 33, 259), (16, 64, 512)]
                         + ([(1, 4096, 4096), (12, 14336, 4096), (64, 4096, 14336)]
                            if DEV == "cuda" else []))  # fmt: skip
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("fma", [False, True])
def test_int8_kernel(m: int, n: int, k: int, split: int, fma: bool) -> None:
    wq8, ws = qf.quantize_int8_weight(torch.randn(n, k, device=DEV))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(m, k, device=DEV).to(dtype)
        b = torch.randn(n, device=DEV).to(dtype)
        got = wq.wq_linear_triton(x, wq8, ws, bias=b, config=CFG | {"SPLIT_K": split, "FMA": fma})
        _close(got, wq.wq_linear_ref(x, wq8, ws, bias=b), dtype)


@pytest.mark.parametrize("n,k,g", [(33, 192, 64), (7, 256, 32), (5, 288, 96)])
def test_dequantize_kernel_is_exact(n: int, k: int, g: int) -> None:
    p, s, z = _int4(n, k, g)
    want = qf.dequantize_int4(qf.unpack_int4(p), s, z)
    assert torch.equal(wq.dequantize_triton(p, s, z, k, torch.float32), want)
    w8, s8 = qf.quantize_int8_weight(torch.randn(n, k, device=DEV))
    assert torch.equal(
        wq.dequantize_triton(w8, s8, None, k, torch.float32), qf.dequantize_rows(w8, s8)
    )


def test_block_k_must_divide_the_group() -> None:
    p, s, z = _int4(8, 192, 96)
    x = torch.randn(1, 192, device=DEV)
    with pytest.raises(ValueError, match=r"group size 96$"):
        wq.wq_linear_triton(x, p, s, z, config=CFG | {"SPLIT_K": 1, "BLOCK_K": 64})
    with pytest.raises(ValueError, match="group size 96 or be a multiple of it"):
        wq.wq_linear_triton(x, p, s, z, config=CFG | {"SPLIT_K": 1, "BLOCK_K": 64, "FMA": True})


@pytest.mark.parametrize("g", [128, 96])
def test_default_config_one_row(g: int) -> None:
    """One int4 row takes the tensor-core kernel where the group is whole 128-code chunks
    (``wq_mma``; its own tests), else, and without it, the 32-bit-word kernel, 64 columns by
    K tiles of 512 (four groups of 128), or of 32 where the group is 96; it matches the
    reference (the call with smoothing factors falls back to the broadcast kernel, which
    matches too)."""
    n, k = 19, 1536
    assert wq.wq_default_config(n, k, 1, g).get("MMA", False) is (g == 128)
    cfg = wq.wq_default_config(n, k, 1, g, mma=False)
    assert cfg["FMA"] and cfg["WORDS"] and cfg["BLOCK_K"] == (512 if g == 128 else 32)
    assert cfg["BLOCK_N"] == 64
    assert not wq.wq_default_config(n, k, 2, g, mma=False)["FMA"]
    assert "WORDS" not in wq.wq_default_config(n, k, 1, None)  # int8
    p, s, z = _int4(n, k, g)
    sm = torch.rand(k, device=DEV) + 0.5
    for x in (torch.randn(1, k, device=DEV), torch.randn(1, k, device=DEV).bfloat16()):
        _close(wq.wq_linear_triton(x, p, s, z), wq.wq_linear_ref(x, p, s, z), x.dtype)
        _close(wq.wq_linear_triton(x, p, s, z, sm), wq.wq_linear_ref(x, p, s, z, sm), x.dtype)


def _spy(monkeypatch, module, name: str) -> list:
    """Record the grids a Triton / Gluon kernel of ``module`` is launched with."""
    taken, kernel = [], getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            taken.append(grid)
            return kernel[grid]

    monkeypatch.setattr(module, name, Spy())
    return taken


WORDS_CASES = [(1, 40, 256, 32, 64, 16, 2), (1, 33, 512, 128, 128, 16, 1),
               (3, 70, 1024, 64, 256, 16, 4), (2, 9, 384, 128, 128, 16, 3),
               (1, 13, 192, 64, 32, 16, 3), (1, 21, 768, 256, 128, 64, 2)]  # fmt: skip
if DEV == "cuda":  # Llama-3.1-8B's projections at the tuner's tiles
    WORDS_CASES += [(1, 6144, 4096, 128, 512, 64, 4), (1, 4096, 4096, 128, 512, 64, 8),
                    (1, 28672, 4096, 128, 512, 128, 4), (1, 4096, 14336, 128, 512, 64, 7),
                    (4, 4096, 4096, 128, 1024, 32, 2)]  # fmt: skip


@pytest.mark.parametrize("m,n,k,g,bk,bn,split", WORDS_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_int4_words_kernel(
    m: int, n: int, k: int, g: int, bk: int, bn: int, split: int, bias: bool, monkeypatch
) -> None:
    """The 32-bit-word kernel (one row of x per program) against the reference in bfloat16
    (x read as int32 pairs) and float16; K tiles within a group or holding several, split-K
    (the launcher spreads the tiles: 3 splits of 12 tiles, 2 of 6); the launcher is checked
    to have taken it rather than its fallback."""
    from kiln.kernels import wq_fma

    taken = _spy(monkeypatch, wq_fma, "_wq4_words_kernel")
    p, s, z = _int4(n, k, g)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(m, k, device=DEV).to(dtype)
        b = torch.randn(n, device=DEV).to(dtype) if bias else None
        cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "FMA": True, "WORDS": True,
               "num_warps": 4, "num_stages": 2}  # fmt: skip
        _close(wq.wq_linear_triton(x, p, s, z, None, b, config=cfg),
               wq.wq_linear_ref(x, p, s, z, None, b), dtype)  # fmt: skip
    assert len(taken) == 2


GLUON_CASES = [(1, 40, 2048, 128, 1024, 8, 1, 2), (3, 70, 4096, 64, 2048, 4, 2, 1),
               (1, 13, 1024, 32, 1024, 8, 1, 1), (2, 33, 6144, 128, 2048, 8, 2, 3),
               (1, 6144, 4096, 128, 2048, 8, 2, 1), (1, 4096, 14336, 128, 1024, 8, 1, 7),
               (1, 28672, 4096, 128, 2048, 8, 2, 1),
               (4, 4096, 4096, 128, 4096, 8, 4, 1),
               # two and four chunks of 32 codes per thread
               (1, 6144, 4096, 128, 4096, 8, 2, 1), (2, 40, 8192, 64, 4096, 8, 2, 1),
               (1, 100, 4096, 128, 4096, 4, 1, 2)]  # fmt: skip


@pytest.mark.skipif(DEV != "cuda", reason="Gluon runs on the GPU only")
@pytest.mark.parametrize("m,n,k,g,bk,bn,nw,split", GLUON_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_int4_rows_gluon_kernel(
    m: int, n: int, k: int, g: int, bk: int, bn: int, nw: int, split: int, bias: bool,
    monkeypatch,
) -> None:  # fmt: skip
    """The word kernel's Gluon form (every thread holding all rows of its chunks) against
    the reference in bfloat16: groups of 32-128, 1-4 rows of x, 1-4 warps, split-K of
    whole tiles; checked to have been launched."""
    from kiln.kernels import wq_gluon

    taken = _spy(monkeypatch, wq_gluon, "_wq4_rows_kernel")
    p, s, z = _int4(n, k, g)
    x = torch.randn(m, k, device=DEV).bfloat16()
    b = torch.randn(n, device=DEV).bfloat16() if bias else None
    cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "FMA": True, "WORDS": True,
           "GLUON": True, "num_warps": nw, "num_stages": 2}  # fmt: skip
    _close(wq.wq_linear_triton(x, p, s, z, None, b, config=cfg),
           wq.wq_linear_ref(x, p, s, z, None, b), torch.bfloat16)  # fmt: skip
    assert len(taken) == 1


_COMPILE_ROWS = """
import json, sys
from kiln.kernels import wq_gluon
from tests.sm90 import compile_sm90
ints = "M N stride_xm stride_wn stride_sn stride_om k_per_split magic".split()
sig = {"x_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "b_ptr": "*bf16",
       "out_ptr": "*bf16", "part_ptr": "*fp32", **dict.fromkeys(ints, "i32")}
div = ("x_ptr", "w_ptr", "s_ptr", "z_ptr", "stride_wn", "stride_sn")
out = []
for bn, bk, nw in json.loads(sys.argv[1]):
    consts = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1, "GROUP": 128, "NW": nw,
              "HAS_BIAS": False, "PDL": True}
    k = compile_sm90(wq_gluon._wq4_rows_kernel, sig, consts, nw, gluon=True, divisible=div)
    out.append({"waits": k["ptx"].count("griddepcontrol.wait"), "regs": k["regs"],
                "stack": k["stack"]})
print(json.dumps(out))
"""


def test_int4_rows_gluon_compiles_for_sm90() -> None:
    """Without a GPU: the rows kernel under programmatic dependent launch compiles for
    sm_90 with one wait; 4 and 8 rows of 2,048-value tiles on 2 warps spill nothing."""
    import json

    from tests import sm90

    cfgs = [(4, 2048, 2), (8, 2048, 2)]
    got = sm90.run(_COMPILE_ROWS, json.dumps(cfgs))
    assert all(g["waits"] == 1 and g["regs"] <= 255 and g["stack"] == 0 for g in got), got


def test_int4_gluon_config_off_the_gpu(monkeypatch) -> None:
    """A Gluon configuration takes the Triton word kernel with the same tiles where Gluon
    cannot run (the interpreter, CPU tensors; on a GPU, float16 x) and matches."""
    from kiln.kernels import wq_fma

    taken = _spy(monkeypatch, wq_fma, "_wq4_words_kernel")
    n, k, g = 21, 2048, 128
    p, s, z = _int4(n, k, g)
    x = torch.randn(2, k, device=DEV).to(torch.float16 if DEV == "cuda" else torch.bfloat16)
    cfg = wq.wq_default_config(n, k, 1, g, mma=False)
    assert cfg["GLUON"] and (cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]) == (8, 2048, 2)
    assert wq.wq_default_config(n, 4096, 1, g, mma=False)["BLOCK_K"] == 4096
    _close(wq.wq_linear_triton(x, p, s, z, config=cfg), wq.wq_linear_ref(x, p, s, z), x.dtype)
    assert len(taken) == 1


@pytest.mark.parametrize("pdl", [False, True])
def test_int4_gluon_dispatch_arguments(pdl: bool, monkeypatch) -> None:
    """Where Gluon can run, a Gluon configuration launches ``_wq4_rows_kernel`` (not the
    Triton word kernel) with the arguments its signature expects: x and w re-viewed as
    int32 with their strides in pairs and words, the split's partial buffer, and the
    configuration's constants (checked on the CPU by recording the launch); where
    programmatic dependent launch is on, the kernel both launches as a dependent and
    waits inside (one without the other would race or gain nothing)."""
    from kiln.kernels import wq_fma, wq_gluon

    calls = []

    class Rec:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))

    monkeypatch.setattr(wq_fma, "INTERPRET", False)
    monkeypatch.setattr(wq_gluon, "rows_ok", lambda x, group, block_k: True)
    monkeypatch.setattr(wq_gluon, "_wq4_rows_kernel", Rec())
    monkeypatch.setattr(wq_fma, "_wq4_words_kernel", None)  # taking it would raise
    monkeypatch.setattr(wq_gluon.pdl, "pdl", lambda x: pdl)
    n, k, g = 21, 4096, 128
    p, s, z = _int4(n, k, g)
    x, b = torch.randn(2, k).bfloat16(), torch.randn(n).bfloat16()
    cfg = {"BLOCK_N": 8, "BLOCK_K": 1024, "SPLIT_K": 2, "FMA": True, "WORDS": True,
           "GLUON": True, "num_warps": 1, "num_stages": 2}  # fmt: skip
    monkeypatch.setattr(wq, "split_k_reduce", lambda part, out, bias: None)
    wq.wq_linear_triton(x, p, s, z, None, b, config=cfg)
    ((grid, a, kw),) = calls
    assert grid == (2, 3, 2)  # rows of x, column blocks, splits
    xi, wi, sc, zp, bias, out, part, m, nn, sxm, swn, ssn, som, kps, magic = a
    assert xi.dtype == wi.dtype == torch.int32 and xi.shape == (2, k // 2)
    assert wi.shape == (n, k // 8) and (sxm, swn, ssn, som) == (k // 2, k // 8, k // g, n)
    assert sc is not None and zp is z and bias is b and out.shape == (2, n)
    assert part.shape == (2, 2, n) and (m, nn, kps, magic) == (2, n, k // 2, 0x43000000)
    assert kw == {"BLOCK_N": 8, "BLOCK_K": 1024, "SPLIT_K": 2, "GROUP": g, "NW": 1,
                  "HAS_BIAS": True, "PDL": pdl, "num_warps": 1, "launch_pdl": pdl}  # fmt: skip


@pytest.mark.parametrize("case", ["float32", "smooth", "uneven", "odd stride", "odd start"])
def test_int4_words_falls_back(case: str, monkeypatch) -> None:
    """Calls the word kernel cannot take (float32 x, smoothing factors, splits that are not
    whole tiles, bfloat16 rows at an odd stride or starting at an odd element) take the
    broadcast kernel and still match."""
    from kiln.kernels import wq_fma

    monkeypatch.setattr(wq_fma, "_wq4_words_kernel", None)  # taking it would raise
    n, k, g = 24, 640, 64
    p, s, z = _int4(n, k, g)
    x = torch.randn(1, k, device=DEV).bfloat16()
    sm = torch.rand(k, device=DEV) + 0.5 if case == "smooth" else None
    if case == "float32":
        x = x.float()
    if case == "odd stride":  # rows 641 elements apart
        x = torch.randn(2, k + 1, device=DEV).bfloat16()[:1, :k]
    if case == "odd start":  # rows 642 apart, starting at element 1
        x = torch.randn(1, k + 2, device=DEV).bfloat16()[:, 1 : k + 1]
    split = 3 if case == "uneven" else 1  # 5 tiles of 128: splits of 2, 2 and 1 tiles
    bk = 128 if case == "uneven" else 64
    cfg = {"BLOCK_N": 8, "BLOCK_K": bk, "SPLIT_K": split, "FMA": True, "WORDS": True,
           "num_warps": 4, "num_stages": 2}  # fmt: skip
    _close(wq.wq_linear_triton(x, p, s, z, sm, config=cfg), wq.wq_linear_ref(x, p, s, z, sm),
           x.dtype)  # fmt: skip


def test_default_config_int4_tensor_cores() -> None:
    """More rows, int4, where the tensor-core int4 kernel cannot run (its fallback): tl.dot
    tiles with sixteen programs per SM, at least four K tiles per split, three stages. The
    H200 sweep at Llama-3.1-8B's projections (16 rows) found split 8 best for all four; the
    heuristic gives down 16 (tuned builds measure both). Where it can, the default is it."""
    assert wq.wq_default_config(28672, 4096, 16, 128)["MMA"]
    for (n, k), split in (((28672, 4096), 8), ((6144, 4096), 8), ((4096, 14336), 16)):
        cfg = wq.wq_default_config(n, k, 16, 128, mma=False)
        assert not cfg["FMA"] and (cfg["BLOCK_N"], cfg["BLOCK_K"]) == (128, 128)
        assert (cfg["SPLIT_K"], cfg["num_stages"]) == (split, 3)
    assert wq.wq_default_config(28672, 4096, 16, None)["num_stages"] == 4  # int8 unchanged


def test_tuned_configs_are_looked_up_by_shape_and_rows() -> None:
    from kiln.kernels.tuning import set_tuning

    key = wq.wq_shape_key(6144, 4096, 128)
    assert key == "int4g128:6144x4096" and wq.wq_shape_key(10, 20, None) == "int8:10x20"
    one, four = {"BLOCK_N": 8, "FMA": True}, {"BLOCK_N": 64}
    set_tuning({"weight_only": {"by_shape": {key: {"1": one, "4": four}}}})
    try:
        assert wq.wq_config(6144, 4096, 1, 128) == one
        assert wq.wq_config(6144, 4096, 3, 128) == four
        assert wq.wq_config(6144, 4096, 40, 128) == four  # the largest tuned
        assert wq.wq_config(6144, 4096, 1, 64) == wq.wq_default_config(6144, 4096, 1, 64)
    finally:
        set_tuning(None)


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 16, 64, 65, 128, 129, 300])
def test_dispatcher_both_paths(m: int) -> None:
    """Up to WQ_MAX_M["int4"] rows the fused kernel, beyond it dequantize + cuBLAS: both
    match."""
    p, s, z = _int4(1024, 2048, 128)
    sm = torch.rand(2048, device=DEV) + 0.5
    x = torch.randn(2, m, 2048, device=DEV, dtype=torch.bfloat16)[1]
    _close(wq.wq_linear(x, p, s, z, sm), wq.wq_linear_ref(x, p, s, z, sm), torch.bfloat16)


def test_weight_only_tuner_candidates() -> None:
    """int4 up to ``mma_rows()`` rows (96) with groups of whole chunks: the tensor-core
    kernel (past 16 rows its many-token-tile candidates beside four wide tl.dot tiles); at
    one row besides it the word kernel's Gluon and Triton forms only (the broadcast kernel
    measured 1.3-1.6x slower); at 4 rows the broadcast kernel and tensor cores; int8
    keeps the broadcast kernel at one row. Every candidate is a valid launch on the CPU
    (the Gluon ones through their Triton fallback) and matches the reference."""
    from kiln.bench.quant_bench import wq_config_candidates

    one, four = wq_config_candidates(1, 128), wq_config_candidates(4, 128)
    rows = wq.mma_rows()
    for m, g, want in ((1, 128, True), (8, 256, True), (16, 128, True), (rows, 128, True),
                       (rows + 1, 128, False), (1, 96, False), (32, 96, False)):  # fmt: skip
        assert any(c.get("MMA") for c in wq_config_candidates(m, g)) is want, (m, g)
    many = wq_config_candidates(32, 128, 4096)
    assert {c.get("NT") for c in many if c.get("MMA")} == {4, 8}
    assert sum(not c.get("MMA") for c in many) == 4 and not any(c.get("PF") for c in many)
    assert not any(c.get("MMA") for c in wq_config_candidates(1, None))
    # 2-8 rows of a shape the MMA kernel takes time it alone; K of 640 + 64 keeps the rest
    assert all(c.get("MMA") for c in wq_config_candidates(4, 128, 4096))
    assert all(c.get("MMA") for c in wq_config_candidates(8, 128, 4096))
    assert not all(c.get("MMA") for c in wq_config_candidates(4, 128, 704))
    assert not all(c.get("MMA") for c in wq_config_candidates(1, 128, 4096))
    assert {c.get("GLUON", False) for c in one} == {True, False}
    assert all(c.get("WORDS") or c.get("MMA") for c in one)
    assert not any(c.get("WORDS") for c in four)
    assert any(c.get("FMA") for c in four) and any(not c.get("FMA") for c in four)
    assert all(c.get("FMA") and not c.get("WORDS") for c in wq_config_candidates(1, None))
    odd = wq_config_candidates(1, 48)  # 48 % 32 != 0: no Gluon; tiles of 16 within a group
    assert odd and not any(c.get("GLUON") for c in odd) and {c["BLOCK_K"] for c in odd} == {16}
    n, k, g = 9, 4096, 128
    p, s, z = _int4(n, k, g)
    x = torch.randn(1, k, device=DEV).bfloat16()
    ref = wq.wq_linear_ref(x, p, s, z)
    for cfg in one[:: max(1, len(one) // 6)]:  # a spread of them (the interpreter is slow)
        _close(wq.wq_linear_triton(x, p, s, z, config=cfg), ref, torch.bfloat16)


def test_split_k_plan() -> None:
    """Whole tiles per split; requests past the tile count collapse to one split per tile
    (the tuner times such requests once)."""
    assert wq.split_k_plan(4096, 4096, 4) == (4096, 1)
    assert wq.split_k_plan(4096, 512, 8) == (512, 8)
    assert wq.split_k_plan(14336, 512, 8) == (2048, 7)
    assert wq.split_k_plan(640, 128, 3) == (256, 3)  # 5 tiles: 2 + 2 + 1
