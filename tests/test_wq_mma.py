"""The tensor-core few-row int4 kernel (``kiln.kernels.wq_mma``): its dispatch and
fallbacks on the CPU (recorded launches), and on the GPU its results against
``wq_linear_ref`` on fresh random inputs, odd shapes and every configuration knob."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kiln.kernels import wq_gemm as wq
from kiln.quant import formats as qf

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _int4(n: int, k: int, g: int) -> tuple[torch.Tensor, ...]:
    u, s, z = qf.quantize_int4(torch.randn(n, k, device=DEV) / k**0.5, g)
    return qf.pack_int4(u), s.float().contiguous(), z


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


def test_mma_default_and_eligibility() -> None:
    """The untuned default takes the tensor-core kernel for 1-8 int4 rows with groups and K
    of whole 128-code chunks, 32 rows by 4 warps by 2 chunks, split-K up to 4 while there
    are at most 8 programs per SM; 9-96 rows on 2 warps, one chunk a step past 16 rows
    (four token tiles); not for 97 rows,
    groups of 64 or 96, K of 640 + 64, int8."""
    cfg = wq.wq_default_config(4096, 4096, 1, 128)
    assert cfg["MMA"] and (cfg["R"], cfg["num_warps"], cfg["CH"], cfg["PF"]) == (2, 4, 2, False)
    assert cfg["SPLIT_K"] == 4  # 128 programs: 4 x 128 <= 8 x 132
    assert wq.wq_default_config(28672, 4096, 8, 256)["SPLIT_K"] == 1  # 896 programs
    assert wq.wq_default_config(6144, 4096, 3, 128)["SPLIT_K"] == 4
    many = wq.wq_default_config(4096, 4096, 32, 128)
    assert many["MMA"] and (many["R"], many["CH"], many["num_warps"]) == (2, 1, 2)
    assert many["SPLIT_K"] == 4  # 128 programs
    assert wq.wq_default_config(4096, 4096, 12, 128)["CH"] == 2
    assert wq.wq_default_config(28672, 4096, 96, 128)["SPLIT_K"] == 1  # 896 x 3 blocks
    for n, k, m, g in ((64, 4096, 97, 128), (64, 4096, 1, 64), (64, 4032, 1, 96),
                       (64, 704, 1, 64), (64, 4096, 1, None)):  # fmt: skip
        assert not wq.wq_default_config(n, k, m, g).get("MMA"), (n, k, m, g)


@pytest.mark.parametrize("case", ["cpu", "float16", "smooth", "odd start"])
def test_mma_config_falls_back(case: str, monkeypatch) -> None:
    """An MMA configuration where the kernel cannot run (no GPU / the interpreter, float16
    x, smoothing factors, bfloat16 rows starting at an odd element) takes the non-MMA
    default and matches the reference; the MMA kernel is never launched. (On the CPU every
    case falls back for want of a GPU; ``test_mma_ok_conditions`` checks each condition.)"""
    from kiln.kernels import wq_mma

    monkeypatch.setattr(wq_mma, "_wq4_mma_kernel", None)  # taking it would raise
    n, k, g = 19, 1024, 128
    p, s, z = _int4(n, k, g)
    x = torch.randn(2, k + 1, device=DEV).bfloat16()
    x = x[:, 1:] if case == "odd start" else x[:, :k]
    if case == "float16":
        x = x.half()
    sm = torch.rand(k, device=DEV) + 0.5 if case == "smooth" else None
    cfg = wq.mma_config(2, 4, 2)
    y = wq.wq_linear_triton(x, p, s, z, sm, None, config=cfg)
    assert _rel(y, wq.wq_linear_ref(x, p, s, z, sm)) < 2e-2


@pytest.mark.parametrize("rows", [8, 16, 96])
def test_mma_ok_conditions(rows: int, monkeypatch) -> None:
    """``mma_ok`` takes only CUDA bfloat16 rows (up to ``mma_rows()``: 96 by default,
    ``KILN_WQ_MMA_ROWS``; unit stride, even row stride and start), K and groups of whole
    chunks, no smoothing: checked on tensors' metadata."""
    from kiln.kernels import wq_config
    from kiln.kernels.wq_mma import mma_ok

    monkeypatch.setattr(wq_config, "MMA_ROWS", rows)

    x = torch.empty(8, 256, dtype=torch.bfloat16, device="meta")

    class Cuda:  # a stand-in with the attributes mma_ok reads
        def __init__(self, t: torch.Tensor) -> None:
            self.t, self.is_cuda, self.dtype, self.shape = t, True, t.dtype, t.shape

        def stride(self, i: int) -> int:
            return self.t.stride(i)

        def storage_offset(self) -> int:
            return self.t.storage_offset()

    assert mma_ok(Cuda(x), 256, 128, None)

    def rows_of(m: int) -> Cuda:
        return Cuda(torch.empty(m, 256, dtype=torch.bfloat16, device="meta"))

    for m in (9, 16, 17, 64, 96, 97):
        assert mma_ok(rows_of(m), 256, 128, None) == (m <= rows), m
    assert not mma_ok(Cuda(x), 256, 64, None) and not mma_ok(Cuda(x), 192, 128, None)
    assert not mma_ok(Cuda(x), 256, 128, torch.ones(256))
    assert not mma_ok(Cuda(x.half()), 256, 128, None) and not mma_ok(x, 256, 128, None)
    assert not mma_ok(Cuda(torch.empty(2, 257, dtype=torch.bfloat16)[:, 1:]), 256, 128, None)


@pytest.mark.parametrize("pdl", [False, True])
def test_mma_dispatch_arguments(pdl: bool, monkeypatch) -> None:
    """Where the kernel can run, an MMA configuration launches ``_wq4_mma_kernel`` with the
    arguments its signature expects (x and w as int32 with strides in pairs and words, the
    split's partial buffer, the bfloat16 ``128 + q`` magic, the configuration's constants,
    a grid of 16 R rows by splits), then the split-K reduction; launched as a programmatic
    dependent exactly when it waits (recorded on the CPU)."""
    from kiln.kernels import wq_mma

    calls, reduced = [], []

    class Rec:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))

    monkeypatch.setattr(wq, "INTERPRET", False)
    monkeypatch.setattr(wq_mma, "mma_ok", lambda x, k, group, smooth: True)
    monkeypatch.setattr(wq_mma, "_wq4_mma_kernel", Rec())
    monkeypatch.setattr(wq_mma.pdl, "pdl", lambda x: pdl)
    import kiln.kernels.gemv as gemv

    monkeypatch.setattr(gemv, "split_k_reduce", lambda part, out, bias: reduced.append(part))
    n, k, g = 100, 1280, 128
    p, s, z = _int4(n, k, g)
    x, b = torch.randn(3, k).bfloat16(), torch.randn(n).bfloat16()
    y = wq.wq_linear_triton(x, p, s, z, None, b, config=wq.mma_config(2, 4, 3, 4, False))
    ((grid, a, kw),) = calls
    assert grid == (4, 3)  # ceil(100 / 32) row blocks, 10 chunks in splits of 4, 4, 2
    xi, wi, sc, zp, bias, out, part, m, nn, kk, sxm, swn, ssn, som, kps, magic, mb = a
    assert xi.dtype == wi.dtype == torch.int32 and xi.shape == (3, k // 2)
    assert wi.shape == (n, k // 8) and (sxm, swn, ssn, som) == (k // 2, k // 8, k // g, n)
    assert sc.dtype == torch.float32 and zp is z and bias is b and out is y
    assert part.shape == (3, 3, n) and (m, nn, kk, kps, magic) == (3, n, k, 512, 0x43004300)
    assert mb == 1  # one block of rows
    assert kw == {"R": 2, "SPLIT_K": 3, "GROUP": g, "NW": 4, "CH": 4, "PF": False, "NT": 1,
                  "HAS_BIAS": True, "num_warps": 4, "PDL": pdl, "launch_pdl": pdl}  # fmt: skip
    assert len(reduced) == 1 and reduced[0] is part


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("n,k,g", [(4096, 4096, 128), (1000, 384, 128), (13, 256, 256),
                                   (4104, 640, 128), (300, 1408, 128)])  # fmt: skip
def test_mma_matches_reference(m: int, n: int, k: int, g: int) -> None:
    """Every knob (rows per program, warps on K, splits, chunks per step, double buffer)
    against the float32 reference on fresh inputs: within 1 % of the largest output (the
    bfloat16 output's rounding is 0.4 %)."""
    from kiln.kernels.wq_mma import wq4_mma

    p, s, z = _int4(n, k, g)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    ref = wq.wq_linear_ref(x, p, s, z)
    for r, nw, split, ch, pf in ((1, 1, 1, 1, False), (2, 2, 3, 2, True), (4, 1, 2, 1, True),
                                 (2, 4, 1, 4, False), (1, 8, 2, 2, False)):  # fmt: skip
        for zs in (False, True):  # ZS: the zero point off the codes
            y = wq4_mma(x, p, s, z, r=r, num_warps=nw, split=split, ch=ch, pf=pf, zs=zs)
            assert _rel(y, ref) < 1e-2, (r, nw, split, ch, pf, zs)
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    x2 = torch.randn(m, k + 2, device=DEV, dtype=torch.bfloat16)[:, 2:]  # row stride k + 2
    assert _rel(wq.wq_linear(x2, p, s, z, None, b), wq.wq_linear_ref(x2, p, s, z, None, b)) < 1e-2


@pytest.mark.parametrize("rows", [8, 16, 96])
def test_mma_rows_gate(rows: int, monkeypatch) -> None:
    """``KILN_WQ_MMA_ROWS`` (``wq_config.MMA_ROWS``, 96 by default): rows up to it are
    eligible for the kernel, its configurations join the tuner's candidates there, and the
    untuned default takes it; past it nothing changes from before."""
    from kiln.bench.quant_bench import wq_config_candidates
    from kiln.kernels import wq_config

    monkeypatch.setattr(wq_config, "MMA_ROWS", rows)
    assert wq.mma_rows() == rows
    for m in (8, 12, 16, 17, 64, 96):
        assert wq.mma_eligible(4096, m, 128) == (m <= rows), m
        assert bool(wq.wq_default_config(4096, 4096, m, 128).get("MMA")) == (m <= rows), m
        cands = wq_config_candidates(m, 128, 4096)
        assert any(c.get("MMA") for c in cands) == (m <= rows), m
    assert not wq.mma_eligible(4096, 97, 128)
    assert all(c.get("MMA") for c in wq_config_candidates(8, 128, 4096))  # unchanged


@pytest.mark.parametrize(
    "m,nt,want_nt,blocks",
    [(8, None, 1, 1), (12, None, 2, 1), (32, None, 2, 2), (40, None, 2, 3), (100, 4, 4, 4),
     (64, 8, 8, 1), (128, 8, 8, 2), (3, 8, 1, 1), (32, 4, 4, 1)],
)  # fmt: skip
def test_many_rows_dispatch(m: int, nt: int | None, want_nt: int, blocks: int,
                            monkeypatch) -> None:  # fmt: skip
    """An MMA configuration at ``m`` rows launches the kernel with ``NT`` token tiles of
    eight (a power of two, at most the configuration's ``NT``, else 2 at R 2 with two
    chunks a step) and, past 8 NT rows, ``blocks`` blocks of rows on the grid's first axis
    (recorded on the CPU)."""
    from kiln.kernels import wq_mma

    calls = []

    class Rec:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))

    monkeypatch.setattr(wq, "INTERPRET", False)
    monkeypatch.setattr(wq_mma, "_wq4_mma_kernel", Rec())
    monkeypatch.setattr(wq_mma, "mma_ok", lambda x, k, group, smooth: True)
    n, k, g = 100, 1280, 128
    p, s, z = _int4(n, k, g)
    cfg = wq.mma_config(2, 4, 1, nt=nt, zs=m == 40)
    wq.wq_linear_triton(torch.randn(m, k).bfloat16(), p, s, z, config=cfg)
    ((grid, a, kw),) = calls
    assert kw["NT"] == want_nt and a[16] == blocks
    assert kw.get("ZS", False) == (m == 40)  # a configuration's ZS reaches the kernel
    assert grid == (4 * blocks, 1)  # ceil(100 / 32) weight tiles, each beside its row blocks


# the kernel's signature for the compile scripts below, and the arguments the launcher
# specializes as multiples of 16 for the engine's shapes (16-byte loads follow)
_SIGNATURE = """
sig = {"x_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*u8", "b_ptr": "*bf16",
       "out_ptr": "*bf16", "part_ptr": "*fp32"}
for a in ("M N K stride_xm stride_wn stride_sn stride_om k_per_split magic MB").split():
    sig[a] = "i32"
div = ("x_ptr", "w_ptr", "s_ptr", "z_ptr", "b_ptr", "out_ptr", "part_ptr", "N", "K",
       "stride_xm", "stride_wn", "stride_sn", "stride_om", "k_per_split")
"""

_COMPILE = (
    """
import json, sys
from kiln.kernels import wq_mma
from tests.sm90 import compile_sm90
"""
    + _SIGNATURE
    + """
out = []
for r, nw, ch, nt, zs in json.loads(sys.argv[1]):
    consts = {"R": r, "SPLIT_K": 2, "GROUP": 128, "NW": nw, "HAS_BIAS": False, "CH": ch,
              "PF": False, "PDL": True, "NT": nt, "ZS": bool(zs)}
    k = compile_sm90(wq_mma._wq4_mma_kernel, sig, consts, nw, gluon=True, divisible=div)
    out.append({"mma": k["ptx"].count("mma.sync"), "sub": k["ptx"].count("sub.rn.bf16x2"),
                "regs": k["regs"], "stack": k["stack"]})
print(json.dumps(out))
"""
)


def test_mma_kernel_compiles_for_sm90() -> None:
    """Without a GPU: the Gluon kernel compiles for sm_90 (Triton's frontend, ptxas) at each
    token-tile count, with and without ``ZS``, with the expected number of ``mma`` (and
    of ``sub.bf16x2``, which ptxas accepts for sm_90) and without spilling registers
    (``cuobjdump``'s resource usage), so a change to it is checked in CI before it reaches
    the GPU. In a process of its own (``tests.sm90``): the CPU tests run Triton's
    interpreter."""
    import json

    from tests import sm90

    cfgs = [
        (2, 4, 2, 1, 0),
        (2, 4, 2, 2, 0),
        (1, 4, 2, 4, 0),
        (2, 4, 1, 4, 0),
        (2, 4, 4, 2, 0),
        (1, 4, 1, 8, 0),
        (2, 4, 2, 1, 1),
        (1, 4, 2, 4, 1),
        (2, 4, 1, 4, 1),
    ]
    for (r, _, ch, nt, zs), got in zip(cfgs, sm90.run(_COMPILE, json.dumps(cfgs)), strict=True):
        # a step's mma: R rows and (without ZS) sum(x); ZS: four subs a step and row group
        assert got["mma"] == ch * 8 * nt * (r if zs else 1 + r), (r, ch, nt, zs, got)
        assert got["sub"] == (ch * 8 * 4 * r if zs else 0), (r, ch, nt, zs, got)
        assert got["regs"] <= 255 and got["stack"] == 0, (r, ch, nt, zs, got)


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("m", [17, 32, 40, 64, 100, 128])
@pytest.mark.parametrize("n,k,g", [(4096, 4096, 128), (1000, 384, 128), (13, 256, 256)])
def test_many_rows_matches_reference(m: int, n: int, k: int, g: int) -> None:
    """Four and eight token tiles, and blocks of rows past them, against the reference and
    against the one-tile kernel on each eight rows (the same bits: the same arithmetic per
    token), over the knobs."""
    from kiln.kernels.wq_mma import wq4_mma

    p, s, z = _int4(n, k, g)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    ref = wq.wq_linear_ref(x, p, s, z)
    for r, nw, split, ch, nt in ((1, 4, 1, 2, 4), (2, 2, 3, 2, 4), (1, 4, 2, 1, 8),
                                 (1, 8, 1, 2, 2)):  # fmt: skip
        kw = dict(r=r, num_warps=nw, split=split, ch=ch)
        y = wq4_mma(x, p, s, z, nt=nt, **kw)
        assert _rel(y, ref) < 1e-2, (kw, nt)
        tiles = torch.cat([wq4_mma(x[i : i + 8], p, s, z, **kw) for i in range(0, m, 8)])
        assert torch.equal(y, tiles), (kw, nt)
        yz = wq4_mma(x, p, s, z, nt=nt, zs=True, **kw)  # the zero point off the codes
        assert _rel(yz, ref) < 1e-2, (kw, nt, "zs")
        tiles = torch.cat([wq4_mma(x[i : i + 8], p, s, z, zs=True, **kw) for i in range(0, m, 8)])
        assert torch.equal(yz, tiles), (kw, nt, "zs")


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("m", [9, 12, 16])
@pytest.mark.parametrize("n,k,g", [(4096, 4096, 128), (1000, 384, 128), (13, 256, 256)])
def test_mma16_matches_reference(m: int, n: int, k: int, g: int) -> None:
    """Two token tiles (9-16 rows) against the reference and against two calls on the
    halves (the same bits: the same arithmetic per token), over the knobs."""
    from kiln.kernels.wq_mma import wq4_mma

    p, s, z = _int4(n, k, g)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    ref = wq.wq_linear_ref(x, p, s, z)
    for r, nw, split, ch, pf in ((1, 1, 1, 1, False), (2, 2, 3, 2, True), (2, 4, 1, 4, False)):
        kw = dict(r=r, num_warps=nw, split=split, ch=ch, pf=pf)
        y = wq4_mma(x, p, s, z, **kw)
        assert _rel(y, ref) < 1e-2, kw
        halves = torch.cat([wq4_mma(x[:8], p, s, z, **kw), wq4_mma(x[8:], p, s, z, **kw)])
        assert torch.equal(y, halves), kw


@pytest.mark.parametrize("on", [False, True])
def test_zsub_candidates_gate(on: bool, monkeypatch) -> None:
    """``KILN_WQ_ZSUB`` (``wq_config.ZSUB``, off): the tuner's tensor-core candidates also
    come with ``ZS`` (the zero point off the codes), at few rows and at many; off, none."""
    from kiln.bench.quant_bench import wq_config_candidates
    from kiln.kernels import wq_config

    monkeypatch.setattr(wq_config, "ZSUB", on)
    for m in (1, 8, 32):
        mma = [c for c in wq_config_candidates(m, 128, 4096) if c.get("MMA")]
        zs = [c for c in mma if c.get("ZS")]
        assert len(zs) == (len(mma) // 2 if on else 0), m


def test_env_settings_are_checked() -> None:
    """``KILN_WQ_MMA_ROWS`` and ``KILN_PDL`` are read with ``env_int``: unset or empty the
    default, a value in range taken, anything else a ``ConfigError`` naming the variable,
    the value and the range."""
    from kiln.errors import ConfigError, env_int

    rows = range(1, 97)
    assert env_int({}, "KILN_WQ_MMA_ROWS", 96, rows) == 96
    assert env_int({"KILN_WQ_MMA_ROWS": ""}, "KILN_WQ_MMA_ROWS", 96, rows) == 96
    assert env_int({"KILN_WQ_MMA_ROWS": "16"}, "KILN_WQ_MMA_ROWS", 96, rows) == 16
    for bad in ("abc", "0", "97", "8.5"):
        with pytest.raises(ConfigError, match=r"KILN_WQ_MMA_ROWS='.*' is invalid: .* 1 to 96"):
            env_int({"KILN_WQ_MMA_ROWS": bad}, "KILN_WQ_MMA_ROWS", 96, rows)
    with pytest.raises(ConfigError, match=r"KILN_PDL='3' is invalid: .* 0 to 2"):
        env_int({"KILN_PDL": "3"}, "KILN_PDL", 2, range(3))


_SWITCHES = [("KILN_WQ_F16", "wq_f16", "ENABLED"), ("KILN_WQ_F16_HEAD", "wq_f16", "HEAD"),
             ("KILN_WQ_F16_SZPF", "wq_f16", "SZPF"), ("KILN_WQ_MMA", "wq_mma", "ENABLED"),
             ("KILN_WQ_ZSUB", "wq_config", "ZSUB")]  # fmt: skip


def _import_with(env: dict[str, str], code: str) -> subprocess.CompletedProcess:
    names = {v for v, _, _ in _SWITCHES}
    base = {k: v for k, v in os.environ.items() if k not in names}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env},
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.parametrize("var", [v for v, _, _ in _SWITCHES])
def test_kernel_switches_refuse_other_values(var: str) -> None:
    """The weight-only kernels' on / off switches are 0 or 1 (``env_int``): "yes" stops the
    import with a ``ConfigError`` naming the variable, the value and the range (before,
    anything but "0" turned ``KILN_WQ_F16`` on and anything but "1" left ``KILN_WQ_ZSUB``
    off)."""
    module = next(m for v, m, _ in _SWITCHES if v == var)
    run = _import_with({var: "yes"}, f"import kiln.kernels.{module}")
    assert run.returncode != 0
    assert f"{var}='yes' is invalid" in run.stderr and "0 to 1" in run.stderr


def test_kernel_switches_take_0_and_1() -> None:
    """Each switch set against its default reaches its module's flag."""
    code = "from kiln.kernels import wq_f16, wq_mma, wq_config\n" + "".join(
        f"print({m}.{flag})\n" for _, m, flag in _SWITCHES
    )
    default = _import_with({}, code)
    assert default.returncode == 0, default.stderr
    assert default.stdout.split() == ["True", "True", "True", "True", "False"]
    flip = {v: ("1" if v == "KILN_WQ_ZSUB" else "0") for v, _, _ in _SWITCHES}
    flipped = _import_with(flip, code)
    assert flipped.returncode == 0, flipped.stderr
    assert flipped.stdout.split() == ["False", "False", "False", "False", "True"]
