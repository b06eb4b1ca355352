"""int4 group scales on float16's grid (``formats.f16_grid_up``), held in float16 once
loaded (``passes.compact_int4_scales``): the grid, the fits that use it, the load-time
compaction (no product changes), and every int4 kernel giving the same bits with float16
scales as with the same values in float32 (interpreter on the CPU; on the GPU the Gluon
kernels too)."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import wq_gemm as wq
from kiln.quant import formats as qf
from kiln.quant.layers import QuantLinear
from kiln.quant.passes import compact_int4_scales

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_f16_grid_up_is_the_smallest_float16_at_least_s() -> None:
    gen = torch.Generator().manual_seed(0)
    s = torch.exp(torch.empty(20000).uniform_(-20, 11, generator=gen))  # 2e-9 .. 6e4
    s = torch.cat([s, torch.tensor([0.0, 2.0**-24, 1.0, 65504.0, 1e6])])
    up = qf.f16_grid_up(s)
    h = up.half()
    assert torch.equal(h.float(), up)  # on the grid
    c = s.clamp(qf.F16_TINY, qf.F16_MAX)
    assert bool((up >= c).all())
    below = (h.view(torch.int16) - 1).view(torch.float16).float()  # the float16 just under
    assert bool((below < c)[up > qf.F16_TINY].all())
    assert up[-5:].tolist() == [2.0**-24, 2.0**-24, 1.0, 65504.0, 65504.0]


@pytest.mark.parametrize("ratio", [1.0, 0.85])
def test_int4_fits_put_scales_on_the_grid(ratio: float) -> None:
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(40, 6, 64, generator=gen) * torch.logspace(-6, 1, 6)[None, :, None]
    g[0, 0] = 0.0  # an all-zero group
    s, z = qf.int4_fit(g, ratio)
    assert torch.equal(s.half().float(), s) and bool((s > 0).all())
    assert bool(((z >= 0) & (z <= 15)).all()) and torch.equal(z, z.round())
    q, s2, z2 = qf.quantize_int4(g.reshape(40, -1), 64)
    assert torch.equal(s2.half().float(), s2)
    w = qf.dequantize_int4(q, s2, z2).reshape(g.shape)
    # the range still fits the codes: within half a step of every weight
    assert bool(((w - g).abs() <= s2[..., None] * 0.5 * (1 + 1e-6)).all())
    assert torch.equal(w[0, 0], torch.zeros(64))


def _layer(n: int, k: int, g: int, seed: int) -> QuantLinear:
    from kiln.layers.linear import Linear

    lin = Linear(k, n, bias=False)
    gen = torch.Generator().manual_seed(seed)
    lin.weight.data = torch.randn(n, k, generator=gen) / k**0.5
    return QuantLinear.from_linear(lin, "int4-awq", g)


def test_scales_stored_and_compacted_in_float16() -> None:
    """Quantized layers hold float16 scales (an off-grid float32 scale given to
    ``from_linear`` stays float32); ``enable=False`` widens them to float32 (the A/B), the
    default compacts float32 scales on the grid (older engines) and leaves others; no
    product changes on the way."""
    from kiln.layers.linear import Linear

    model = torch.nn.ModuleList([_layer(48, 128, 32, 0), _layer(32, 192, 64, 1)])
    assert all(m.weight_scale.dtype == torch.float16 for m in model)
    lin = Linear(64, 16)
    lin.weight.data = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    u, s, z = qf.quantize_int4(lin.weight.data, 32)
    off = QuantLinear.from_linear(lin, "int4-awq", 32, rounded=(u, s * 1.0001, z))
    assert off.weight_scale.dtype == torch.float32 and torch.equal(off.weight_scale, s * 1.0001)
    model.append(off)
    xs = [torch.randn(3, 5, 128), torch.randn(2, 192), torch.randn(4, 64)]
    before = [m(v) for m, v in zip(model, xs, strict=True)]
    assert compact_int4_scales(model, enable=False) == 2
    assert all(m.weight_scale.dtype == torch.float32 for m in model)
    assert [torch.equal(m(v), b) for m, v, b in zip(model, xs, before, strict=True)] == [True] * 3
    assert compact_int4_scales(model) == 2
    assert [m.weight_scale.dtype for m in model] == [torch.float16, torch.float16, torch.float32]
    for m, v, b in zip(model, xs, before, strict=True):
        assert torch.equal(m(v), b)


def _grid_int4(n: int, k: int, g: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    u, s, z = qf.quantize_int4(torch.randn(n, k, device=DEV, generator=gen), g)
    return qf.pack_int4(u), s, z


INTERP_CASES = [  # (m, n, k, g, config)
    (3, 40, 128, 32, {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 2, "num_warps": 4,
                      "num_stages": 1}),
    (2, 24, 256, 64, {"BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 1, "FMA": True,
                      "num_warps": 4, "num_stages": 1}),
    (1, 21, 768, 256, {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2, "FMA": True,
                       "WORDS": True, "num_warps": 4, "num_stages": 2}),
]  # fmt: skip


@pytest.mark.parametrize("m,n,k,g,cfg", INTERP_CASES)
def test_triton_kernels_take_float16_scales(m: int, n: int, k: int, g: int, cfg: dict) -> None:
    """The tensor-core, broadcast and word kernels and the dequantizing kernel: the same
    bits with float16 scales as with float32 (bfloat16 x on the GPU, float32 on the CPU)."""
    p, s, z = _grid_int4(n, k, g, seed=m + n)
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    x = torch.randn(m, k, device=DEV).to(dt)
    a = wq.wq_linear_triton(x, p, s, z, config=cfg)
    b = wq.wq_linear_triton(x, p, s.half(), z, config=cfg)
    assert torch.equal(a, b)
    assert torch.equal(wq.dequantize_triton(p, s, z, k, dt),
                       wq.dequantize_triton(p, s.half(), z, k, dt))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gpu_kernels_take_float16_scales(m: int) -> None:
    """On the GPU: the float16-code kernel, the bfloat16-code tensor-core kernel (row-major
    and tile-major words), the Gluon word kernel and the dispatcher's default: the same
    bits with float16 scales as with float32."""
    from kiln.kernels import f16_prep, wq_f16, wq_tiled
    from kiln.kernels.wq_f16 import F16Act
    from kiln.kernels.wq_mma import wq4_mma

    n, k, g = 4096, 4224, 128
    p, s, z = _grid_int4(n, k, g, seed=m)
    h = s.half()
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    a = F16Act(*f16_prep.prep_ref(x), x.dtype)
    t = wq_f16.tile_words(p)
    for r, nw, split, ch, pf in ((1, 4, 4, 1, False), (2, 2, 1, 2, True), (2, 4, 3, 2, False)):
        cfg = wq_f16.f16_config(r, nw, split, ch, pf)
        assert torch.equal(wq_f16.wq4_f16(a, t, s, z, cfg), wq_f16.wq4_f16(a, t, h, z, cfg))
    for r, nw, split, ch, pf in ((1, 1, 1, 1, False), (2, 2, 3, 2, True)):
        kw = dict(r=r, num_warps=nw, split=split, ch=ch, pf=pf)
        assert torch.equal(wq4_mma(x, p, s, z, **kw), wq4_mma(x, p, h, z, **kw))
        assert torch.equal(wq4_mma(x, t, s, z, tiled=True, **kw),
                           wq4_mma(x, t, h, z, tiled=True, **kw))  # fmt: skip
    gl_cfg = {"BLOCK_N": 8, "BLOCK_K": 2048, "SPLIT_K": 1, "FMA": True, "WORDS": True,
              "GLUON": True, "num_warps": 2, "num_stages": 2}  # fmt: skip
    p2, s2, z2 = _grid_int4(6144, 4096, g, seed=m + 1)
    x2 = torch.randn(1, 4096, device=DEV, dtype=torch.bfloat16)
    assert torch.equal(wq.wq_linear_triton(x2, p2, s2, z2, config=gl_cfg),
                       wq.wq_linear_triton(x2, p2, s2.half(), z2, config=gl_cfg))  # fmt: skip
    assert torch.equal(wq.wq_linear(x, p, s, z), wq.wq_linear(x, p, h, z))
    assert torch.equal(wq_tiled.linear(x, t, s, z), wq_tiled.linear(x, t, h, z))


def test_engine_with_float32_scales_loads_compacted(tmp_path) -> None:
    """An int4 engine whose file holds float32 scales on float16's grid (as engines built
    between ddf5cc6 and 1dde8a0 stored them) loads with them in float16 and gives the
    same logits as the float16 file; widened back to float32, the logits the same."""
    from safetensors.torch import load_file, save_file

    from kiln.build.builder import build_engine
    from kiln.build.engine_dir import read_manifest, write_manifest
    from kiln.build.loader import load_engine
    from kiln.config import BuildConfig, QuantConfig
    from kiln.quant import passes
    from tests.util import prefill_logits, save_tiny_llama

    hf = save_tiny_llama(tmp_path / "hf")
    q = QuantConfig(algo="int4-awq", group_size=16, weight_rounding="nearest")
    build_engine(str(hf), tmp_path / "e", BuildConfig(device="cpu", quant=q), 0, False)
    name = "layers.1.mlp.gate_up.weight_scale"
    ids = list(range(1, 30))
    new = load_engine(tmp_path / "e", "cpu")
    assert new.model.get_submodule(name.removesuffix(".weight_scale")).weight_scale.dtype == (
        torch.float16
    )
    want = prefill_logits(new, ids)
    f = tmp_path / "e" / "rank0.safetensors"
    state = load_file(str(f))
    assert state[name].dtype == torch.float16
    state = {k: v.float() if k.endswith(".weight_scale") else v for k, v in state.items()}
    save_file(state, str(f), metadata={"format": "pt"})
    write_manifest(tmp_path / "e", read_manifest(tmp_path / "e"))
    old = load_engine(tmp_path / "e", "cpu")
    mod = old.model.get_submodule(name.removesuffix(".weight_scale"))
    assert mod.weight_scale.dtype == torch.float16
    assert torch.equal(prefill_logits(old, ids), want)
    assert passes.compact_int4_scales(old.model, enable=False) > 0
    assert mod.weight_scale.dtype == torch.float32
    assert torch.equal(prefill_logits(old, ids), want)
