"""The fp8 x fp8 skinny matmul (``kiln.kernels.fp8_gemv``): the kernel against its torch
reference on fresh random e4m3 inputs (odd sizes, per-row and per-tensor activation
scales, bias, split-K, K not a multiple of the tile), the tuned lookup, the dispatcher's
choice, and the kernel compiled for sm_90 without a GPU."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kiln.kernels import fp8_gemv, tuning
from kiln.kernels.fp8_gemv import (
    FP8_SKINNY_MAX_M,
    fp8_skinny_candidates,
    fp8_skinny_config,
    fp8_skinny_ref,
    fp8_skinny_triton,
)
from kiln.quant.formats import FP8_DTYPE

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _e4m3(*shape: int) -> torch.Tensor:
    return (torch.randn(*shape, device=DEV) * 60).clamp(-448, 448).to(FP8_DTYPE)


def _case(m: int, n: int, k: int, per_row: bool, bias: bool):
    xq, wq = _e4m3(m, k), _e4m3(n, k)
    sx = torch.rand(m if per_row else 1, 1, device=DEV) * 0.01 + 1e-3
    sw = (torch.rand(n, device=DEV) * 0.01 + 1e-3).to(torch.bfloat16)
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16) if bias else None
    return xq, sx, wq, sw, b


@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize(
    "n,k,cfg",
    [
        (37, 200, {"BLOCK_N": 8, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 4}),
        (40, 256, {"BLOCK_N": 4, "BLOCK_K": 32, "SPLIT_K": 3, "num_warps": 4}),
        (9, 96, {"BLOCK_N": 2, "BLOCK_K": 128, "SPLIT_K": 2, "num_warps": 4}),
    ],
)
def test_fp8_skinny_matches_reference(m: int, n: int, k: int, cfg: dict) -> None:
    torch.manual_seed(m * 1000 + n)
    for per_row, bias in ((True, False), (False, True), (True, True)):
        xq, sx, wq, sw, b = _case(m, n, k, per_row, bias)
        out = fp8_skinny_triton(xq, sx, wq, sw, b, torch.bfloat16, cfg)
        ref = fp8_skinny_ref(xq, sx, wq, sw, b, torch.bfloat16)
        # float32 sums in another order, then one bfloat16 rounding
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_fp8_skinny_rejects_what_it_cannot_take() -> None:
    xq, sx, wq, sw, _ = _case(5, 16, 64, True, False)
    cfg = {"BLOCK_N": 8, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 4}
    with pytest.raises(ValueError, match="at most 4 rows"):
        fp8_skinny_triton(xq, sx, wq, sw, None, torch.bfloat16, cfg)
    xq, sx, wq, sw, _ = _case(2, 16, 64, True, False)
    with pytest.raises(ValueError, match="scales"):
        fp8_skinny_triton(xq, sx.double(), wq, sw, None, torch.bfloat16, cfg)


def test_fp8_skinny_lookup_and_dispatch(monkeypatch) -> None:
    """Untuned shapes, ``scaled_mm`` picks, skinny picks past four rows and anything past
    the largest tuned row count (or 32) keep ``torch._scaled_mm`` (None); a tuned pick is
    taken at the smallest tuned row count >= m, and the dispatcher (``fp8_small``) then
    runs the kernel."""
    from kiln.kernels.quant_act import QuantAct
    from kiln.quant.formats import fp8_small

    cfg = {"BLOCK_N": 8, "BLOCK_K": 64, "SPLIT_K": 2, "num_warps": 4}
    assert fp8_skinny_config(24, 128, 1) is None  # untuned
    tuning.set_tuning(
        {"fp8_skinny": {"by_shape": {"24x128": {"1": cfg, "4": {"scaled_mm": True}}}}}
    )
    try:
        assert fp8_skinny_config(24, 128, 1) == cfg
        assert fp8_skinny_config(24, 128, 2) is None  # the 4-row pick: scaled_mm
        assert fp8_skinny_config(24, 128, FP8_SKINNY_MAX_M + 1) is None  # a skinny pick
        assert fp8_skinny_config(24, 256, 1) is None
        xq, sx, wq, sw, b = _case(1, 24, 128, True, True)
        y = fp8_small(QuantAct(xq, sx), wq, sw, b, torch.bfloat16)
        assert y is not None
        ref = fp8_skinny_ref(xq, sx, wq, sw, b, torch.bfloat16)
        torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2)
        xq, sx, wq, sw, b = _case(2, 24, 128, True, False)
        assert fp8_small(QuantAct(xq, sx), wq, sw, b, torch.bfloat16) is None
        mma = {"MMA": True, "R": 1, "SPLIT_K": 1, "num_warps": 4}
        tuning.set_tuning({"fp8_skinny": {"by_shape": {"24x128": {"1": cfg, "8": mma}}}})
        assert fp8_skinny_config(24, 128, 2) == mma  # the tensor-core kernel: up to 8 rows
        assert fp8_skinny_config(24, 128, 8) == mma
        assert fp8_skinny_config(24, 128, 9) is None  # past the largest tuned row count
        mma2 = {**mma, "R": 2}
        tuning.set_tuning({"fp8_skinny": {"by_shape": {"24x128": {
            "8": mma, "16": {"scaled_mm": True}, "32": mma2}}}})  # fmt: skip
        assert fp8_skinny_config(24, 128, 9) is None  # the 16-row pick: scaled_mm
        assert fp8_skinny_config(24, 128, 17) == mma2  # 17-32 rows: the 32-row pick
        assert fp8_skinny_config(24, 128, 32) == mma2
        assert fp8_skinny_config(24, 128, 33) is None  # past FP8_SMALL_MAX_M
        monkeypatch.setattr(fp8_gemv, "ENABLED", 0)  # KILN_FP8_SKINNY=0
        assert fp8_skinny_config(24, 128, 1) is None
        assert fp8_skinny_config(24, 128, 8) is None
    finally:
        tuning.set_tuning(None)


def test_fp8_skinny_candidates() -> None:
    """Every candidate stays within 64 accumulator registers a thread and keeps at least
    two K tiles per split; one row gets split-K where the columns alone are few programs."""
    for m in (1, 4):
        for n, k in ((4096, 4096), (6144, 4096), (4096, 14336), (28672, 4096)):
            cands = fp8_skinny_candidates(n, k, m)
            assert cands
            for c in cands:
                assert c["BLOCK_N"] * min(m, 4) * c["BLOCK_K"] <= 64 * 32 * c["num_warps"]
                assert c["SPLIT_K"] == 1 or k // c["SPLIT_K"] >= 2 * c["BLOCK_K"]
    assert any(c["SPLIT_K"] > 1 for c in fp8_skinny_candidates(4096, 14336, 1))


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 14336), (1000, 4160)])
def test_fp8_skinny_real_sizes_on_gpu(m: int, n: int, k: int) -> None:
    """Every tuner candidate at Llama-3.1-8B shapes (and an odd one) against the reference
    and against ``torch._scaled_mm``."""
    torch.manual_seed(m + n)
    xq, sx, wq, sw, b = _case(m, n, k, True, True)
    ref = fp8_skinny_ref(xq, sx, wq, sw, b, torch.bfloat16).float()
    if n % 16 == 0:  # torch._scaled_mm's requirement (K too)
        mm = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.float().reshape(1, -1),
                              out_dtype=torch.bfloat16) + b  # fmt: skip
        torch.testing.assert_close(mm.float(), ref, rtol=2e-2, atol=2e-2)
    for cfg in fp8_skinny_candidates(n, k, m):
        out = fp8_skinny_triton(xq, sx, wq, sw, b, torch.bfloat16, cfg)
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2, msg=str(cfg))


_COMPILE = """
import json, os
from kiln.kernels import gemv
from tests.sm90 import compile_sm90

sig = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "b_ptr": "*bf16", "out_ptr": "*bf16",
       "part_ptr": "*fp32", "sx_ptr": "*fp32", "sw_ptr": "*bf16"}
for a in "M N K stride_xm stride_wn stride_om stride_sx k_per_split".split():
    sig[a] = "i32"
out = []
for bm, bn, bk, nw, split in json.loads(os.environ["CFGS"]):
    consts = {"K_PER_SPLIT": 0, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split,
              "DOT": False, "EVEN_K": True, "HAS_BIAS": False, "PRECISION": "ieee",
              "UPCAST": False, "SCALED": True, "PDL": True}
    k = compile_sm90(gemv._skinny_kernel, sig, consts, nw)
    out.append({"stack": k["stack"], "e4m3": k["ptx"].count("e4m3")})
print(json.dumps(out))
"""


def test_fp8_skinny_compiles_for_sm90(monkeypatch) -> None:
    """Without a GPU: the scaled skinny kernel on e4m3 inputs compiles for sm_90 at the
    candidates' tile shapes without spilling registers (CI checks what only the GPU runs)."""
    from tests import sm90

    cfgs = sorted({(min(m, 4), c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["SPLIT_K"])
                   for m in (1, 4) for c in fp8_skinny_candidates(4096, 14336, m)})  # fmt: skip
    monkeypatch.setenv("CFGS", json.dumps(cfgs))
    got = sm90.run(_COMPILE)
    assert len(got) == len(cfgs)
    for cfg, g in zip(cfgs, got, strict=True):
        assert g["stack"] == 0, (cfg, g)
        assert g["e4m3"] > 0, (cfg, g)  # e4m3 codes converted in registers


def test_build_tuner_picks_by_measurement(monkeypatch) -> None:
    """The build's fp8 tuning (``_tune_fp8_skinny``, its timings faked here) records the
    kernel's fastest configuration where it beat ``torch._scaled_mm`` and ``scaled_mm``
    where it did not; with outlier channels it also tunes the K + 2C shapes; other modes
    keep the default (empty)."""
    from kiln.bench import gemv_bench
    from kiln.build import tuning as build_tuning
    from kiln.config import QuantConfig
    from kiln.model_config import ModelConfig

    calls, made = [], []

    def fake(n: int, k: int, m: int, weights):
        assert weights == [("e4m3", n, k)]  # the shape's one set, for every row count
        calls.append((n, k, m))
        fast = {"BLOCK_N": 8, "BLOCK_K": 512, "SPLIT_K": 1, "num_warps": 4}
        # the kernel wins at one row, loses at four
        return [{"config": fast, "ms": 0.010}], (0.020 if m == 1 else 0.005)

    monkeypatch.setattr(gemv_bench, "tune_fp8_skinny", fake)
    monkeypatch.setattr(gemv_bench, "fp8_weight_copies",
                        lambda n, k: made.append((n, k)) or [("e4m3", n, k)])  # fmt: skip
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64,
                      intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64)  # fmt: skip
    got, measured = build_tuning._tune_fp8_skinny(
        cfg, QuantConfig(algo="fp8", activation_scheme="dynamic")
    )
    shapes = {(64 + 2 * 32, 64), (64, 64), (192, 64), (64, 96)}  # qkv, o, gate_up, down
    assert {(n, k) for n, k, _ in calls} == shapes
    assert {m for *_, m in calls} == set(build_tuning.FP8_TUNE_ROWS) == {1, 4, 8, 16, 32}
    assert sorted(made) == sorted(shapes)  # weights made once per shape
    for n, k in shapes:
        assert got["by_shape"][f"{n}x{k}"]["1"]["BLOCK_K"] == 512
        assert got["by_shape"][f"{n}x{k}"]["4"] == {"scaled_mm": True}
        assert measured[f"{n}x{k} m=1"]["scaled_mm_ms"] == 0.020
    calls.clear()
    q = QuantConfig(algo="fp8", activation_scheme="outliers", act_outliers=16)
    got, _ = build_tuning._tune_fp8_skinny(cfg, q)
    # the widened shapes the engine runs: 16 asked for, at most K / 64 * 8 = 8 at K = 64, 96
    assert {(n, k) for n, k, _ in calls} == shapes | {(n, k + 16) for n, k in shapes}
    calls.clear()
    wide = dataclasses.replace(cfg, hidden_size=256, intermediate_size=512)
    build_tuning._tune_fp8_skinny(wide, q)  # K = 256 and 512 take all 16; o (K = 64) 8
    widened = {(n, k + (32 if k >= 128 else 16)) for n, k in build_tuning.projection_shapes(wide)}
    assert {(128, 256 + 32), (256, 512 + 32), (256, 64 + 16)} <= widened  # qkv, down, o
    assert widened <= {(n, k) for n, k, _ in calls}
    assert build_tuning._tune_fp8_skinny(cfg, QuantConfig(algo="int8-wo")) == (
        {"by_shape": {}},
        {},
    )


def test_build_tuner_precompiles_every_fp8_variant_first(monkeypatch) -> None:
    """On a GPU (stood in for) the fp8 tuning first calls every shape's candidates at every
    row count untimed, without weights (the dry run makes one uninitialized weight),
    inside ``kernel_record.precompile``, then times them as before."""
    from kiln.bench import gemv_bench
    from kiln.build import tuning as build_tuning
    from kiln.config import QuantConfig
    from kiln.model_config import ModelConfig
    from kiln.runtime import kernel_record

    calls = []

    def fake(n, k, m, weights=None, timed=True):
        calls.append((n, k, m, timed, weights))
        return [{"config": {"BLOCK_N": 8}, "ms": 0.01}], 0.02

    def fake_pre(work, workers=None):
        work()
        return {"compiled": 3}

    monkeypatch.setattr(gemv_bench, "tune_fp8_skinny", fake)
    monkeypatch.setattr(gemv_bench, "fp8_weight_copies", lambda n, k: ["w"])
    monkeypatch.setattr(kernel_record, "precompile", fake_pre)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("KILN_COMPILE_WORKERS", "2")
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64,
                      intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64)  # fmt: skip
    q = QuantConfig(algo="fp8", activation_scheme="dynamic")
    _, measured = build_tuning._tune_fp8_skinny(cfg, q)
    shapes = sorted({(64 + 2 * 32, 64), (64, 64), (192, 64), (64, 96)})
    rows = build_tuning.FP8_TUNE_ROWS
    dry = [(n, k, m, False, None) for n, k in shapes for m in rows]
    timed = [(n, k, m, True, ["w"]) for n, k in shapes for m in rows]
    assert calls == dry + timed and measured["precompile"] == {"compiled": 3}
