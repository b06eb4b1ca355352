"""The skinny matmul kernel (kiln/kernels/gemv.py) against its torch reference on fresh
random inputs, and its dispatcher. On the CPU the kernel runs under the Triton interpreter
(tests/conftest.py) at odd small sizes; on a GPU the compiled kernel also runs at
Llama-3.1-8B's projection sizes. Tolerances, relative to the largest output: float32 1e-5;
bfloat16 4 ulp (2^-6), as in tests/test_triton_kernels.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kiln.kernels import gemv
from kiln.kernels.gemv import (
    SKINNY_MAX_M,
    linear,
    skinny_config,
    skinny_config_candidates,
    skinny_default_config,
    skinny_matmul_ref,
    skinny_matmul_triton,
)
from kiln.kernels.tuning import set_tuning

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 4 * 2**-8, torch.float16: 4 * 2**-11}

# every (M, N), (M, K) and (N, K) pair of M in (1, 3, 16), N in (1, 17, 300), K in (8, 129,
# 1000) once (a Latin square): odd sizes, partial tiles in every dimension
SHAPES = [
    (1, 1, 8),
    (1, 17, 1000),
    (1, 300, 129),
    (3, 1, 129),
    (3, 17, 8),
    (3, 300, 1000),
    (16, 1, 1000),
    (16, 17, 129),
    (16, 300, 8),
]
# both inner products, with and without split-K (3 splits: uneven, with a ragged last one)
CONFIGS: list[dict[str, Any] | None] = [
    None,  # the default for the shape
    {"DOT": True, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1},
    {"DOT": True, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 3},
    {"DOT": False, "BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 1},
    {"DOT": False, "BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 3},
]


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    scale = b.float().abs().max().clamp_min(1e-30)
    rel = float((a.float() - b.float()).abs().max() / scale)
    assert rel <= TOL[dtype], f"relative error {rel:.3e} > {TOL[dtype]:.1e}"


def _inputs(
    m: int, n: int, k: int, dtype: torch.dtype, bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    w = torch.randn(n, k, device=DEV, dtype=dtype) / k**0.5
    b = torch.randn(n, device=DEV, dtype=dtype) if bias else None
    return x, w, b


def _full(cfg: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if cfg is None else {"num_warps": 4, "num_stages": 2, **cfg}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ci", range(len(CONFIGS)))
@pytest.mark.parametrize("si", range(len(SHAPES)))
def test_skinny_kernel(dtype: torch.dtype, ci: int, si: int) -> None:
    m, n, k = SHAPES[si]
    x, w, b = _inputs(m, n, k, dtype, bias=(si + ci) % 2 == 1)
    _close(skinny_matmul_triton(x, w, b, _full(CONFIGS[ci])), skinny_matmul_ref(x, w, b), dtype)


@pytest.mark.parametrize("ci", [1, 4])
def test_skinny_kernel_float16(ci: int) -> None:
    x, w, b = _inputs(3, 300, 129, torch.float16, bias=True)
    out = skinny_matmul_triton(x, w, b, _full(CONFIGS[ci]))
    _close(out, skinny_matmul_ref(x, w, b), torch.float16)


def test_strided_rows_and_empty() -> None:
    """A row stride larger than the row (a view into a wider tensor) is honoured; no rows,
    no columns and an empty K give the reference's (empty, empty, bias-only) results."""
    base = torch.randn(3, 200, device=DEV)
    x, w = base[:, :150], torch.randn(40, 150, device=DEV)
    _close(skinny_matmul_triton(x, w), skinny_matmul_ref(x, w), torch.float32)
    assert skinny_matmul_triton(x[:0], w).shape == (0, 40)
    assert skinny_matmul_triton(x, w[:0]).shape == (3, 0)
    b = torch.randn(40, device=DEV)
    e = torch.empty(3, 0, device=DEV)
    assert torch.equal(skinny_matmul_triton(e, torch.empty(40, 0, device=DEV), b), b.expand(3, 40))


def test_candidates_run() -> None:
    """Every candidate the tuner would time (at a small shape) computes the right thing."""
    m, n, k = 3, 40, 520
    x, w, b = _inputs(m, n, k, torch.float32, bias=True)
    ref = skinny_matmul_ref(x, w, b)
    cands = skinny_config_candidates(n, k, m)
    assert cands[0] == skinny_default_config(n, k, m)
    assert any(c["DOT"] for c in cands) and any(not c["DOT"] for c in cands)
    assert not any(not c["DOT"] for c in skinny_config_candidates(n, k, 16))
    for c in cands:
        _close(skinny_matmul_triton(x, w, b, c), ref, torch.float32)


def test_tuned_config_lookup() -> None:
    a = {"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 1, "DOT": False, "num_warps": 4}
    c = {**a, "DOT": True, "SPLIT_K": 2, "num_stages": 3}
    a["num_stages"] = 2
    try:
        set_tuning({"skinny_matmul": {"by_shape": {"17x129": {"1": a, "16": c}}}})
        assert skinny_config(17, 129, 1) == a
        assert skinny_config(17, 129, 2) == c
        assert skinny_config(17, 129, 32) == c  # past the largest tuned row count
        assert skinny_config(18, 129, 1) == skinny_default_config(18, 129, 1)
        x, w, _ = _inputs(5, 17, 129, torch.float32, bias=False)
        _close(skinny_matmul_triton(x, w), skinny_matmul_ref(x, w), torch.float32)
    finally:
        set_tuning(None)
    assert skinny_config(17, 129, 1) == skinny_default_config(17, 129, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatcher_is_f_linear_on_cpu(dtype: torch.dtype, monkeypatch) -> None:
    """On the CPU ``linear`` (and so every Linear layer) is exactly ``F.linear``."""
    from kiln.layers.linear import Linear

    def boom(*a: Any, **k: Any) -> torch.Tensor:
        raise AssertionError("the Triton kernel ran on the CPU")

    monkeypatch.setattr(gemv, "skinny_matmul_triton", boom)
    for m in (1, 3, SKINNY_MAX_M, 40):
        x, w, b = _inputs(m, 33, 64, dtype, bias=True)
        x, w, b = x.cpu(), w.cpu(), b.cpu()
        assert torch.equal(linear(x, w, b), F.linear(x, w, b))
        assert torch.equal(linear(x[None], w), F.linear(x[None], w))
        layer = Linear(64, 33, bias=True, dtype=dtype)
        layer.weight.data.copy_(w)
        layer.bias.data.copy_(b)
        assert torch.equal(layer(x), F.linear(x, w, b))


# ---------------------------------------------------------------------------- GPU only

LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LLAMA_8B)
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_skinny_kernel_real_sizes(n: int, k: int, m: int, dtype: torch.dtype) -> None:
    """Every tuner candidate (bfloat16; the default only for float16) at Llama-3.1-8B's
    projections, and deterministic results (split-K reduces in a fixed order)."""
    torch.manual_seed(n + k + m)
    x, w, b = _inputs(m, n, k, dtype, bias=m == 4)
    ref = skinny_matmul_ref(x, w, b)
    cands = skinny_config_candidates(n, k, m)
    for cfg in cands if dtype == torch.bfloat16 else cands[:1]:
        out = skinny_matmul_triton(x, w, b, cfg)
        _close(out, ref, dtype)
        assert torch.equal(out, skinny_matmul_triton(x, w, b, cfg)), cfg


@pytest.mark.gpu
def test_skinny_kernel_float32_on_gpu() -> None:
    for cfg in [*CONFIGS, {"DOT": True, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4}]:
        x, w, b = _inputs(7, 4096, 14336, torch.float32, bias=True)
        _close(skinny_matmul_triton(x, w, b, _full(cfg)), skinny_matmul_ref(x, w, b), torch.float32)


@pytest.mark.gpu
def test_dispatcher_on_gpu(monkeypatch) -> None:
    """The kernel takes bf16/fp16 inputs of at most SKINNY_MAX_M rows; F.linear the rest."""
    calls = []
    real = gemv.skinny_matmul_triton

    def spy(*a: Any, **k: Any) -> torch.Tensor:
        calls.append(a[0].shape[0])
        return real(*a, **k)

    monkeypatch.setattr(gemv, "skinny_matmul_triton", spy)
    for m in (1, SKINNY_MAX_M, SKINNY_MAX_M + 1):
        x, w, b = _inputs(m, 1000, 512, torch.bfloat16, bias=True)
        _close(linear(x, w, b), skinny_matmul_ref(x, w, b), torch.bfloat16)
        _close(linear(x, w.T.contiguous().T), skinny_matmul_ref(x, w), torch.bfloat16)
    x, w, _ = _inputs(2, 1000, 512, torch.float32, bias=False)
    linear(x, w)
    assert calls == [1, SKINNY_MAX_M]


@pytest.mark.gpu
def test_cuda_graph_capture() -> None:
    """Captured once, the launch (split-K included) replays on new inputs without syncs."""
    x, w, b = _inputs(4, 4096, 14336, torch.bfloat16, bias=True)
    cfg = {**skinny_default_config(4096, 14336, 4), "SPLIT_K": 4}
    out = skinny_matmul_triton(x, w, b, cfg)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_matmul_triton(x, w, b, cfg)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        _close(out, skinny_matmul_ref(x, w, b), torch.bfloat16)


def test_timing_copies_pass_l2_and_stay_bounded() -> None:
    """The tuner's timing graphs cycle enough weight copies to pass 512 MiB (an H200's L2 is
    60 MiB) for Llama-size weights, and at most 256 copies for a tiny model's weights."""
    from kiln.bench.gemv_bench import rotation_copies

    qkv_bf16 = 6144 * 4096 * 2
    assert rotation_copies(qkv_bf16) * qkv_bf16 >= 512 << 20
    assert rotation_copies(qkv_bf16) == 11
    assert rotation_copies(4096 * 4096 // 2) == 64  # an int4 o projection
    assert rotation_copies(64 * 64 * 2) == 256  # dummy:tiny: 65,536 uncapped
    assert rotation_copies(1 << 40) == 2
    assert rotation_copies(100, rotate_bytes=1000) == 10
