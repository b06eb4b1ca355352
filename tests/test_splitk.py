"""Split-K summed inside the kernel (``kiln.kernels.splitk``): the tile counters' rules on
the CPU; on the GPU, both int4 kernels that use it give the same bits as with the
reduction kernel, leave every counter at zero, and stay right when launched back to back
and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import splitk
from kiln.kernels import wq_gemm as wq
from kiln.quant import formats as qf

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(DEV != "cuda", reason="needs CUDA (Gluon kernels)")


class _Cuda:  # a CPU tensor that says it is on CUDA (tile_counters reads is_cuda and device)
    def __init__(self) -> None:
        self.is_cuda, self.device = True, torch.device("cpu")


def test_tile_counters_rules(monkeypatch) -> None:
    """None (the reduction kernel) off CUDA, when turned off, past ``MAX_TILES``, and when
    first asked for during CUDA-graph capture; else one zeroed int32 array per device,
    allocated once and then also given during capture."""
    monkeypatch.setattr(splitk, "_COUNTERS", {})
    x = _Cuda()
    assert splitk.tile_counters(torch.zeros(2), 4) is None
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert splitk.tile_counters(x, 4) is None and not splitk._COUNTERS
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    c = splitk.tile_counters(x, 4)
    assert c.dtype == torch.int32 and c.shape == (splitk.MAX_TILES,) and not c.any()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert splitk.tile_counters(x, splitk.MAX_TILES) is c
    assert splitk.tile_counters(x, splitk.MAX_TILES + 1) is None
    monkeypatch.setattr(splitk, "ENABLED", False)
    assert splitk.tile_counters(x, 4) is None


def _int4(n: int, k: int, g: int) -> tuple[torch.Tensor, ...]:
    u, s, z = qf.quantize_int4(torch.randn(n, k, device=DEV) / k**0.5, g)
    return qf.pack_int4(u), s.float().contiguous(), z


ROWS = {"BLOCK_N": 8, "BLOCK_K": 512, "FMA": True, "WORDS": True, "GLUON": True,
        "num_warps": 2, "num_stages": 2}  # fmt: skip


def _configs(split: int) -> list[dict]:
    return [ROWS | {"SPLIT_K": split}, wq.mma_config(2, 1, split, 2, False),
            wq.mma_config(1, 4, split, 1, True)]  # fmt: skip


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 14336), (3, 1000, 4096), (8, 37, 2048)])
@pytest.mark.parametrize("split", [2, 3, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_fixup_matches_the_reduction_kernel(m: int, n: int, k: int, split: int, bias: bool,
                                            monkeypatch) -> None:  # fmt: skip
    """The one-row Gluon kernel and the tensor-core kernel with split K: the same bits with
    the in-kernel sum as with ``split_k_reduce``, near the reference, counters back at 0."""
    p, s, z = _int4(n, k, 128)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16) if bias else None
    ref = wq.wq_linear_ref(x, p, s, z, None, b).float()
    counters = splitk.tile_counters(x, 1)
    assert counters is not None
    for cfg in _configs(split):
        monkeypatch.setattr(splitk, "ENABLED", True)
        y = wq.wq_linear_triton(x, p, s, z, None, b, config=cfg)
        torch.cuda.synchronize()
        assert not counters.any(), cfg
        monkeypatch.setattr(splitk, "ENABLED", False)
        y0 = wq.wq_linear_triton(x, p, s, z, None, b, config=cfg)
        assert torch.equal(y, y0), cfg
        assert float((y.float() - ref).abs().max() / ref.abs().max()) < 1e-2, cfg


@gpu
@pytest.mark.gpu
def test_fixup_back_to_back_and_in_a_graph() -> None:
    """Forty launches of both kernels with different splits on one stream, then the same
    chain captured in a CUDA graph and replayed five times: every output as the eager
    chain's, counters at 0 after each."""
    shapes = [(4096, 14336), (28672, 4096), (6144, 4096), (4096, 4096)]
    weights = {sh: _int4(*sh, 128) for sh in shapes}
    x = {k: torch.randn(1, k, device=DEV, dtype=torch.bfloat16) for k in (4096, 14336)}
    plan = [(sh, cfg) for i, sh in enumerate(shapes * 10)
            for cfg in [_configs(2 + i % 7)[i % 3]]]  # fmt: skip

    def chain() -> list[torch.Tensor]:
        return [wq.wq_linear_triton(x[sh[1]], *weights[sh], config=cfg) for sh, cfg in plan]

    eager = chain()
    torch.cuda.synchronize()
    counters = splitk.tile_counters(x[4096], 1)
    assert not counters.any()
    for (sh, _), y in zip(plan, eager, strict=True):
        ref = wq.wq_linear_ref(x[sh[1]], *weights[sh]).float()
        assert float((y.float() - ref).abs().max() / ref.abs().max()) < 1e-2
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain()
    for _ in range(5):
        for o in outs:
            o.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert not counters.any()
        for y, o in zip(eager, outs, strict=True):
            assert torch.equal(y, o)
