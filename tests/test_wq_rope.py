"""The int4 qkv projection with rotary and the KV-cache write in its epilogue
(``kiln.kernels.wq_rope``): compiled for sm_90 without a GPU, refused off the GPU, and on
the GPU against the projection followed by ``rotary_write_kv`` on fresh random inputs, odd
head sizes and several tilings, with a padding slot that must write nothing."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.kernels import wq_rope
from kiln.kernels.rotary import rotary_write_kv
from kiln.kernels.wq_f16 import F16Act
from kiln.kernels.wq_gemm import wq_linear_triton
from kiln.layers.linear import Linear
from kiln.layers.rotary import RotaryEmbedding
from kiln.quant.layers import QuantLinear
from tests import sm90

DEV = "cuda" if torch.cuda.is_available() else "cpu"

_COMPILE = """
import json, sys
from kiln.kernels import wq_rope
from tests.sm90 import compile_sm90
ints = ("stride_wn stride_sn stride_cs stride_qh stride_kind stride_kb stride_kt stride_kh "
        "K magic HQ HK BS").split()
sig = {"x_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "pos_ptr": "*i64",
       "cs_ptr": "*fp32", "slot_ptr": "*i64", "q_ptr": "*bf16", "kv_ptr": "*bf16",
       **dict.fromkeys(ints, "i32")}
div = ("x_ptr", "w_ptr", "s_ptr", "z_ptr", "stride_wn", "stride_sn", "K")
out = []
for bn, bk, nw, d in json.loads(sys.argv[1]):
    consts = {"D": d, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP": 128, "NW": nw, "PDL": True}
    k = compile_sm90(wq_rope._wq4_rows_rope_kernel, sig, consts, nw, gluon=True,
                     divisible=div)
    out.append({"waits": k["ptx"].count("griddepcontrol.wait"),
                "launch": k["ptx"].count("griddepcontrol.launch_dependents"),
                "regs": k["regs"], "stack": k["stack"],
                # float32 loads (cos and sin; x loads as int32 vectors) after the wait's
                # text, which sits in the loop's first-tile block, at the PTX's end
                "f32_after": k["ptx"].partition("griddepcontrol.wait")[2].count(
                    "ld.global.b32")})
print(json.dumps(out))
"""


def test_kernel_compiles_for_sm90() -> None:
    """Without a GPU: the kernel compiles for sm_90 with one wait and one early launch of
    the next grid; the tuned batch-1 qkv tiling of Llama-3.1-8B (8 rows, 2,048-value K
    tiles, 2 warps) spills no registers (16 rows of 512 values on 4 warps do, as in the
    plain rows kernel: the tuner times what it picks). The cos and sin rows load before
    the K loop (so before the wait), not in the epilogue after it."""
    cfgs = [(8, 2048, 2, 128), (4, 1024, 4, 64), (16, 128, 4, 80), (2, 256, 1, 128)]
    got = sm90.run(_COMPILE, json.dumps(cfgs))
    for cfg, g in zip(cfgs, got, strict=True):
        assert g["waits"] == 1 and g["launch"] == 1 and g["regs"] <= 255, (cfg, g)
    assert got[0]["stack"] == 0, got[0]
    assert got[0]["f32_after"] == 0 and got[3]["f32_after"] == 0, got


def _qkv(hq: int, hk: int, d: int, k: int, seed: int) -> QuantLinear:
    torch.manual_seed(seed)
    lin = Linear(k, (hq + 2 * hk) * d, dtype=torch.bfloat16, device=DEV)
    with torch.no_grad():
        lin.weight.copy_(torch.randn_like(lin.weight) / k**0.5)
    return QuantLinear.from_linear(lin, "int4-awq", group_size=128)


def test_refused_off_the_gpu_and_where_the_epilogue_cannot_go() -> None:
    """The fused kernel takes one bfloat16 token of a plain int4 qkv projection at an
    unsplit Gluon word tiling that tiles the head (``epilogue_fits``, on any device); off
    the GPU, or where any condition fails, ``rope_config`` gives None and the layer takes
    the projection and ``rotary_write_kv``."""
    q = _qkv(4, 2, 64, 512, 0)
    x = torch.randn(1, 512, dtype=torch.bfloat16, device=DEV)
    cfg = {"BLOCK_N": 8, "BLOCK_K": 512, "SPLIT_K": 1, "FMA": True, "WORDS": True,
           "GLUON": True, "num_warps": 1}  # fmt: skip
    assert wq_rope.epilogue_fits(q, x, 64, cfg)
    assert wq_rope.epilogue_fits(q, x, 64, {**cfg, "BLOCK_K": 256, "SPLIT_K": 1})
    if DEV == "cpu":
        assert wq_rope.rope_config(q, x, 64, cfg) is None
    elif wq_rope.ENABLED:
        assert wq_rope.rope_config(q, x, 64, cfg) == cfg
    refused = [
        (q, torch.cat([x, x]), 64, cfg),  # two tokens
        (q, x.float(), 64, cfg),  # not bfloat16
        (q, torch.randn(1, 513, dtype=torch.bfloat16, device=DEV)[:, 1:], 64, cfg),  # odd start
        (q, x, 64, {**cfg, "BLOCK_K": 256, "SPLIT_K": 2}),  # split along K
        (q, x, 60, cfg),  # a head of no whole tiles
        (q, x, 64, {**cfg, "BLOCK_N": 6}),  # tiles of an odd half
        (q, x, 64, {**cfg, "MMA": True}),
        (q, x, 64, {**cfg, "GLUON": False}),
        (Linear(512, 512, dtype=torch.bfloat16, device=DEV), x, 64, cfg),  # not int4
    ]
    for args in refused:
        assert not wq_rope.epilogue_fits(*args), args[2:]
        assert wq_rope.rope_config(*args) is None, args[2:]
    biased = _qkv(4, 2, 64, 512, 1)
    biased.bias = torch.nn.Parameter(torch.zeros(biased.out_features, device=DEV))
    assert not wq_rope.epilogue_fits(biased, x, 64, cfg)
    q.f16_rows = 16  # the float16-code path takes the projection
    assert not wq_rope.epilogue_fits(q, x, 64, cfg)
    # its input prepared by the norm (no tensor): refused, not an AttributeError (H100)
    prepared = F16Act(torch.zeros(1, 256, dtype=torch.int32, device=DEV),
                      torch.zeros(4, 8, 4, device=DEV), torch.bfloat16)  # fmt: skip
    assert not wq_rope.epilogue_fits(q, prepared, 64, cfg)
    assert wq_rope.rope_config(q, prepared, 64, cfg) is None
    assert wq_rope.rope_config(q, prepared, 64) is None


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Within one bfloat16 rounding of the largest value (the rotation's float32 products
    may contract differently in the two kernels)."""
    err = float((a.float() - b.float()).abs().max() / b.float().abs().max())
    assert err <= 2**-8, err


# (HQ, HK, D, K, BLOCK_N, BLOCK_K, warps): Llama-3.1-8B at its tuned batch-1 tiling, then
# odd head sizes and tilings (a head of 80: five tiles of 16 rows; 48: three of 16)
CASES = [(32, 8, 128, 4096, 8, 2048, 2), (6, 2, 64, 640, 4, 128, 1),
         (5, 1, 80, 384, 16, 128, 4), (12, 3, 48, 1024, 16, 512, 2),
         (4, 4, 128, 512, 2, 256, 1)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("hq,hk,d,k,bn,bk,nw", CASES)
def test_matches_projection_then_rotary_on_gpu(hq, hk, d, k, bn, bk, nw) -> None:
    """q and the cache slot's k within one bfloat16 rounding of the unfused path (the same
    float32 sums, rotated in float32), v the same bits; every other slot untouched; a
    padding slot (-1) writes nothing."""
    lin = _qkv(hq, hk, d, k, seed=hq * 100 + d)
    cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1, "FMA": True, "WORDS": True,
           "GLUON": True, "num_warps": nw, "num_stages": 2}  # fmt: skip
    cs = RotaryEmbedding(d, 8192, 500000.0, None).cos_sin(torch.device(DEV))
    bs, nblocks = 16, 9
    for trial, slot in enumerate((37, 0, nblocks * bs - 1, -1)):
        x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV) * (1 + trial)
        pos = torch.tensor([[5, 0, 8191, 1234][trial]], device=DEV)
        slots = torch.tensor([slot], device=DEV)
        cache = torch.randn(2, nblocks, bs, hk, d, device=DEV).to(torch.bfloat16)
        ref_cache = cache.clone()
        before = cache.clone()
        q = wq_rope.qkv_rotary_kv(lin, x, pos, cs, cache, slots, hq, hk, d, cfg)
        assert q is not None, "the fused kernel did not take the call"
        # the projection on the same rows kernel and tiling: the same float32 sums
        y = wq_linear_triton(x, lin.weight, lin.weight_scale, lin.weight_zero, config=cfg)
        ref_q, _ = rotary_write_kv(y, pos, cs, ref_cache, slots, hq, hk, d)
        assert q.shape == ref_q.shape == (1, hq, d)
        _close(q, ref_q)
        flat, flat_ref, flat_before = (c.view(2, nblocks * bs, hk, d) for c in
                                       (cache, ref_cache, before))  # fmt: skip
        if slot < 0:
            assert torch.equal(flat, flat_before)
            continue
        _close(flat[0, slot], flat_ref[0, slot])
        assert torch.equal(flat[1, slot], flat_ref[1, slot])
        assert not torch.equal(flat[:, slot], flat_before[:, slot])
        others = torch.ones(nblocks * bs, dtype=torch.bool, device=DEV)
        others[slot] = False
        assert torch.equal(flat[:, others], flat_before[:, others])


@pytest.mark.parametrize("offered", [False, True])
def test_attention_layer_wiring(offered: bool, monkeypatch) -> None:
    """The layer asks for the fused call first (bfloat16 cache, no rotation, no fresh k):
    when it returns q the projection is not run again and the output is the same as the
    projection then ``rotary_write_kv``; when it returns None the layer runs those itself.
    An fp8 cache (a kv scale) is never offered. The fused call is stood in for by the
    unfused path, so the wiring is checked on the CPU."""
    from kiln.config import ModelConfig
    from kiln.kernels.attention import AttentionMetadata
    from kiln.layers import attention as attn_mod

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64,
                      intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    layer = attn_mod.Attention(cfg, RotaryEmbedding(16, 64, 10000.0, None), torch.float32)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    asked, projected = [], []
    real_qkv = layer.qkv.forward
    layer.qkv.forward = lambda x, **kw: projected.append(x) or real_qkv(x, **kw)

    def fused(lin, x, pos, cs, cache, slots, hq, hk, d):
        asked.append((hq, hk, d))
        if not offered:
            return None
        y = real_qkv(x)  # the projection without the layer's spy
        return rotary_write_kv(y, pos, cs, cache, slots, hq, hk, d)[0]

    monkeypatch.setattr(attn_mod, "qkv_rotary_kv", fused)
    x = torch.randn(1, 64)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([5], dtype=torch.int32),
        block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
        slot_mapping=torch.tensor([4]),
        query_start_loc_cpu=[0, 1],
        seq_lens_cpu=[5],
    )
    torch.manual_seed(1)
    cache0 = torch.randn(2, 2, 4, 2, 16)
    outs = []
    for use in (True, False):
        monkeypatch.setattr(attn_mod, "qkv_rotary_kv", fused if use else lambda *a: None)
        cache = cache0.clone()
        outs.append((layer(torch.tensor([4]), x, cache, meta), cache))
    assert asked == [(4, 2, 16)]
    assert len(projected) == (1 if offered else 2)  # the fused call's projection is not spied
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=0)
    assert torch.equal(outs[0][1], outs[1][1])
    asked.clear()
    monkeypatch.setattr(attn_mod, "qkv_rotary_kv", fused)
    layer(torch.tensor([4]), x, cache0.clone(), meta, kv_scale=torch.ones(2))
    assert asked == []  # a kv scale (fp8 cache): not offered
