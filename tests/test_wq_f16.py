"""The float16-code int4 kernel (``kiln.kernels.wq_f16``) and the tile-major projections
(``kiln.kernels.wq_tiled``): the layout, the reference and the dequantizing kernel on
tile-major words (interpreter), the kernel and the bfloat16-code kernel's ``TILED`` form
compiled for sm_90 without a GPU, and on the GPU both against ``wq_linear_ref`` on fresh
random inputs, odd shapes and every knob."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import f16_prep, wq_f16, wq_tiled
from kiln.kernels import wq_gemm as wq
from kiln.kernels.wq_f16 import F16Act
from kiln.quant import formats as qf

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _int4(n: int, k: int, g: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(n, k, device=DEV, generator=gen) / k**0.5
    u, s, z = qf.quantize_int4(w, g)
    return qf.pack_int4(u), s.float().contiguous(), z


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


def _act(x: torch.Tensor) -> F16Act:
    return F16Act(*f16_prep.prep_ref(x), x.dtype)


def test_tile_words_layout_and_inverse() -> None:
    """Word j of row r's chunk c sits at tile r // 16, chunk c, row r % 16, word j; the
    inverse restores the row-major bytes; shapes the layout cannot take are refused."""
    p, _, _ = _int4(48, 384, 128)
    t = wq_f16.tile_words(p)
    assert t.shape == p.shape and t.dtype == torch.uint8
    words, tw = p.view(torch.int32), t.view(torch.int32).reshape(-1)
    for r in (0, 15, 16, 47):
        for c in range(3):
            for j in (0, 7, 15):
                assert tw[(r // 16) * 768 + c * 256 + (r % 16) * 16 + j] == words[r, 16 * c + j]
    assert torch.equal(wq_f16.untile_words(t), p)
    with pytest.raises(ValueError, match="multiple of 16"):
        wq_f16.tile_words(p[:40])
    assert not wq_f16.f16_eligible(40, 384, 128) and not wq_f16.f16_eligible(48, 384, 64)
    assert wq_f16.f16_eligible(48, 384, 384)


@pytest.mark.parametrize("n,k,g", [(48, 384, 128), (32, 1024, 256)])
def test_dequantize_tiled_matches_row_major(n: int, k: int, g: int) -> None:
    """The dequantizing kernel (the interpreter on the CPU) on tile-major words gives the
    same bits as on the row-major ones."""
    p, s, z = _int4(n, k, g, seed=n)
    want = wq.dequantize_triton(p, s, z, k, torch.bfloat16)
    got = wq.dequantize_triton(wq_f16.tile_words(p), s, z, k, torch.bfloat16, tiled=True)
    assert torch.equal(got, want)


@pytest.mark.parametrize("m", [1, 3, 8])
def test_reference_is_the_int4_matmul_of_x_in_float16(m: int) -> None:
    """``wq4_f16_ref`` on x prepared: the int4 matmul of x rounded to float16, and the
    dispatcher takes it for prepared x and the plain reference (untiled) for a tensor."""
    n, k, g = 64, 512, 128
    p, s, z = _int4(n, k, g, seed=m)
    x = torch.randn(m, k, device=DEV)
    t = wq_f16.tile_words(p)
    want = wq.wq_linear_ref(x.half().float(), p, s, z)
    got = wq_f16.wq4_f16_ref(_act(x), t, s, z)
    assert _rel(got, want) < 1e-5
    if DEV == "cpu":
        assert torch.equal(wq_tiled.linear(_act(x), t, s, z), got)
        assert torch.equal(wq_tiled.linear(x, t, s, z), wq.wq_linear_ref(x, p, s, z))


_SIG = """
sig = {"x_ptr": "*i32", "sum_ptr": "*fp32", "w_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*u8",
       "out_ptr": "*bf16", "part_ptr": "*fp32"}
for a in "M N K stride_xm stride_sn stride_om k_per_split magic".split():
    sig[a] = "i32"
div = ("x_ptr", "sum_ptr", "w_ptr", "s_ptr", "z_ptr", "out_ptr", "part_ptr", "N", "K",
       "stride_xm", "stride_sn", "stride_om", "k_per_split")
"""
_COMPILE = (
    """
import json, sys
from kiln.kernels import wq_f16
from tests.sm90 import compile_sm90
"""
    + _SIG
    + """
out = []
for r, nw, ch, pf, m1, szpf in json.loads(sys.argv[1]):
    consts = {"R": r, "SPLIT_K": 2, "GROUP": 128, "NW": nw, "CH": ch, "PF": pf,
              "PDL": True, "M1": bool(m1), "EVEN": True, "EVEN2": pf == 2, "ROUND": m1,
              "SZPF": bool(szpf)}
    k = compile_sm90(wq_f16._wq4_f16_kernel, sig, consts, nw, gluon=True, divisible=div)
    head = k["ptx"].partition("griddepcontrol.wait")[0]
    out.append({"mma": k["ptx"].count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16"),
                "regs": k["regs"], "stack": k["stack"],
                "prefetch": k["ptx"].count("prefetch.global.L2"),
                "prefetch_before_wait": head.count("prefetch.global.L2"),
                "waits": k["ptx"].count("griddepcontrol.wait")})
print(json.dumps(out))
"""
)


def test_kernel_compiles_for_sm90() -> None:
    """Without a GPU: the kernel compiles for sm_90 with float16 ``mma`` (8 a chunk and
    row group: two a word of codes), no other, and without spilling registers; ``PF`` 2
    (two iterations a trip) too. With ``SZPF`` the scales' and zeros' L2 prefetches (four
    per row group a thread holds) all come before the one wait; without it there are
    none."""
    import json

    from tests import sm90

    cfgs = [(1, 4, 1, 0, 1, 1), (2, 1, 2, 0, 1, 1), (2, 2, 2, 1, 1, 1), (1, 8, 2, 1, 0, 1),
            (2, 4, 2, 0, 0, 1), (2, 2, 2, 2, 1, 1), (1, 8, 1, 2, 1, 1), (2, 2, 1, 2, 0, 1),
            (2, 2, 1, 2, 1, 0), (1, 4, 1, 0, 1, 0)]  # fmt: skip
    got_all = sm90.run(_COMPILE, json.dumps(cfgs))
    for (r, _, ch, pf, _m1, szpf), got in zip(cfgs, got_all, strict=True):
        # the loop body's chunks (PF 2: two iterations'), the prologue only loads
        assert got["mma"] == 8 * r * ch * (2 if pf == 2 else 1), (r, ch, pf, got)
        assert got["regs"] <= 255 and got["stack"] == 0, (r, ch, pf, got)
        assert got["waits"] == 1, got
        assert got["prefetch"] == got["prefetch_before_wait"] == 4 * r * szpf, (r, szpf, got)


_COMPILE_MMA = """
import json, sys
from kiln.kernels import wq_mma
from tests.sm90 import compile_sm90
from tests.test_wq_mma import _SIGNATURE
exec(_SIGNATURE)
out = []
for tiled in (False, True):
    consts = {"R": 2, "SPLIT_K": 2, "GROUP": 128, "NW": 4, "HAS_BIAS": False, "CH": 2,
              "PF": False, "PDL": True, "NT": 1, "ZS": False, "TILED": tiled}
    k = compile_sm90(wq_mma._wq4_mma_kernel, sig, consts, 4, gluon=True, divisible=div)
    out.append({"mma": k["ptx"].count("mma.sync"), "regs": k["regs"], "stack": k["stack"]})
print(json.dumps(out))
"""


def test_mma_kernel_tiled_compiles_for_sm90() -> None:
    """The bfloat16-code kernel on tile-major words compiles for sm_90 with the same
    ``mma`` count as on row-major ones, without spills."""
    from tests import sm90

    plain, tiled = sm90.run(_COMPILE_MMA)
    assert tiled["mma"] == plain["mma"] > 0 and tiled["stack"] == 0, (plain, tiled)


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("n,k,g", [(4096, 4096, 128), (1008, 4224, 128), (48, 1280, 256)])
def test_kernel_matches_reference(m: int, n: int, k: int, g: int) -> None:
    """Every knob (R, warps, split, CH, PF 0 / 1 / 2; splits of whole or partial iterations
    or trips; K of 33 chunks) against ``wq4_f16_ref`` and the int4 matmul of x; partials
    when asked; a float32 output buffer (``out``, the head's logits) holding the same
    values, rounded to bfloat16."""
    p, s, z = _int4(n, k, g, seed=m + n)
    t = wq_f16.tile_words(p)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16) * 3
    a = _act(x)
    ref = wq_f16.wq4_f16_ref(a, t, s, z)
    exact = wq.wq_linear_ref(x.float(), p, s, z)
    for r, nw, split, ch, pf in ((1, 4, 4, 1, False), (2, 1, 8, 2, False), (1, 2, 8, 1, False),
                                 (2, 2, 1, 2, True), (1, 8, 1, 2, True), (2, 4, 3, 2, False),
                                 (1, 4, 1, 1, False), (2, 2, 1, 2, 2), (2, 2, 1, 1, 2),
                                 (1, 8, 2, 1, 2), (1, 4, 3, 2, 2)):  # fmt: skip
        if n % (16 * r):
            continue
        cfg = wq_f16.f16_config(r, nw, split, ch, pf)
        y = wq_f16.wq4_f16(a, t, s, z, cfg)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        assert _rel(y, ref) < 2**-7, (cfg, _rel(y, ref))
        assert _rel(y, exact) < 2**-6, (cfg, _rel(y, exact))
        part = wq_f16.wq4_f16(a, t, s, z, cfg, partials=True)
        if not torch.is_tensor(part):
            assert torch.equal(part.finish(), y)
        # a float32 buffer: the unsplit kernel writes y's values there; a split one does not
        buf = torch.full((m, n), float("nan"), device=DEV)
        got = wq_f16.wq4_f16(a, t, s, z, cfg, out=buf)
        assert (got is buf) == (split == 1), cfg
        assert torch.equal(got.float(), y.float()), cfg


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 3])
def test_float32_output_buffer_on_gpu(m: int) -> None:
    """The head's ``out=`` alone (two configurations, so it runs in seconds): unsplit, the
    kernel writes the float32 buffer with the bfloat16 output's values; split, it leaves the
    buffer alone and returns its bfloat16 sum."""
    n, k, g = 1008, 1280, 128
    p, s, z = _int4(n, k, g, seed=11 + m)
    t = wq_f16.tile_words(p)
    a = _act(torch.randn(m, k, device=DEV, dtype=torch.bfloat16))
    for split in (1, 2):
        cfg = wq_f16.f16_config(1, 4, split, 1)
        y = wq_f16.wq4_f16(a, t, s, z, cfg)
        buf = torch.full((m, n), float("nan"), device=DEV)
        got = wq_f16.wq4_f16(a, t, s, z, cfg, out=buf)
        assert (got is buf) == (split == 1)
        assert torch.equal(got.float(), y.float())
        assert torch.isnan(buf).all() == (split == 2)


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
def test_kernel_range_guard_on_gpu() -> None:
    """Values past float16's range in some chunks (the producer's power-of-two multiplier)
    give the int4 matmul of x all the same."""
    n, k, g = 256, 1024, 128
    p, s, z = _int4(n, k, g, seed=7)
    x = torch.randn(3, k, device=DEV)
    x[0, 128:256] *= 1e5
    x[2, 900:] *= 3e6
    a = _act(x)
    assert bool(a.sums[..., 2].max() > 1)
    y = wq_f16.wq4_f16(F16Act(a.xq, a.sums, torch.float32), wq_f16.tile_words(p), s, z,
                       wq_f16.f16_config(1, 4, 4, 1))  # fmt: skip
    want = wq.wq_linear_ref(wq_f16.f16_values(a), p, s, z)
    assert torch.isfinite(y).all() and _rel(y, want) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 8, 12, 40, 100])
def test_tiled_dispatch_matches_row_major(m: int) -> None:
    """Tile-major words through ``wq_tiled.linear`` with a tensor x (the bfloat16-code
    kernel's ``TILED`` form up to 96 rows, the dequantizing kernel past it): the same bits
    as the row-major words through ``wq_linear`` with the same configuration."""
    n, k, g = 1024, 2048, 128
    p, s, z = _int4(n, k, g, seed=m)
    t = wq_f16.tile_words(p)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    got = wq_tiled.linear(x, t, s, z)
    if m <= wq.WQ_MAX_M["int4"]:
        cfg = wq.wq_config(n, k, m, g)
        want = wq.wq_linear_triton(x, p, s, z, config=cfg)
    else:
        want = wq.wq_linear(x, p, s, z)
    assert torch.equal(got, want), _rel(got, want)


# ------------------------------------------------------------------ the model's wiring


def _int4_model(rows: tuple[str, ...] = ("1", "4"), head: bool = False):
    """``dummy:tiny-g128`` in bfloat16, int4 (group 128, no smoothing; with ``head`` the
    lm_head too), and a tuning whose float16-code picks are at ``rows`` (the others' at 1,
    4 and 8 rows)."""
    from kiln import LLM
    from kiln.config import QuantConfig
    from kiln.kernels.wq_config import mma_config, wq_shape_key
    from kiln.quant.passes import quantize_model

    # eager: on a GPU, graphs captured at load would keep the model as it was before the pass
    llm = LLM("dummy:tiny-g128", device=DEV, dtype="bfloat16", enforce_eager=True)
    model = llm.engine.model
    quantize_model(model, QuantConfig(algo="int4-awq", group_size=128, quantize_lm_head=head))
    by_shape, f16 = {}, {}
    for mod in model.modules():
        if hasattr(mod, "weight_zero"):
            key = wq_shape_key(mod.out_features, mod.in_features, 128)
            by_shape[key] = {r: mma_config(1, 4, 2) for r in ("1", "4", "8")}
            f16[key] = {r: wq_f16.f16_config(1, 4, 2, 1) for r in rows}
    return llm, model, {"weight_only": {"by_shape": by_shape, "f16": f16}}


@pytest.mark.parametrize("triton_producers", [False, True])
def test_model_takes_the_float16_path_where_tuned(monkeypatch, triton_producers: bool) -> None:
    """On the CPU (the references; with ``triton_producers`` the producers' Triton kernels
    under the interpreter): the pass tiles qkv, gate_up and down of each layer (not o: its
    producer is the attention) with ``f16_rows`` 4; a 3-token forward then has both norms
    and SiLU·mul write prepared x, within float16-versus-bfloat16 rounding of the untiled
    model; an 11-token forward takes the tensor path on the tiled words, the same bits as
    untiled (with ``triton_producers`` the dequantizing kernel's, within rounding); a
    tuning without a one-row pick tiles nothing."""
    from kiln.kernels import tuning
    from kiln.quant.passes import tile_f16_weights
    from kiln.quant.stats import forward_sequence

    _llm, model, tun = _int4_model()
    if triton_producers and DEV == "cpu":
        monkeypatch.setattr(wq_tiled, "use_triton", lambda x: True)
    ids = torch.randint(0, 512, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        plain3, plain11 = forward_sequence(model, ids[:3]), forward_sequence(model, ids)
    calls: list[str] = []
    real_norm, real_silu = wq_tiled.rms_norm_f16, wq_tiled.silu_mul_f16
    monkeypatch.setattr(wq_tiled, "rms_norm_f16", lambda *a: calls.append("norm") or real_norm(*a))
    monkeypatch.setattr(wq_tiled, "silu_mul_f16", lambda x: calls.append("silu") or real_silu(x))
    tuning.set_tuning(tun)
    try:
        assert tile_f16_weights(model, enable=False) == 0
        assert tile_f16_weights(model, enable=True) == 6
        assert tile_f16_weights(model, enable=True) == 0  # once
        for layer in model.layers:
            assert layer.attn.qkv.f16_rows == layer.mlp.gate_up.f16_rows == 4
            assert layer.mlp.down.f16_rows == 4 and layer.attn.o.f16_rows == 0
        with torch.inference_mode():
            got3 = forward_sequence(model, ids[:3])
            assert calls == ["norm", "norm", "silu"] * 2
            got11 = forward_sequence(model, ids)
        assert calls == ["norm", "norm", "silu"] * 2  # 11 rows: no prepared x
    finally:
        tuning.set_tuning(None)
    if triton_producers:  # 11 rows: the dequantizing kernel on tiled words, bfloat16 weights
        assert _rel(got11, plain11) < 2e-2, _rel(got11, plain11)
    else:
        assert torch.equal(got11, plain11)
    assert _rel(got3, plain3) < 2e-2, _rel(got3, plain3)
    _, model2, tun2 = _int4_model(rows=("4",))  # no one-row pick: nothing tiled
    _, model3, _ = _int4_model()
    from kiln.layers.linear import Linear

    kept = model3.layers[0].mlp  # a projection the build kept unquantized is left alone
    kept.gate_up = Linear(kept.gate_up.in_features, kept.gate_up.out_features)
    tuning.set_tuning(tun2)
    try:
        assert tile_f16_weights(model2, enable=True) == 0
        tuning.set_tuning(tun)
        assert tile_f16_weights(model3, enable=True) == 5
        assert not model3.layers[0].mlp_norm._f16 and model3.layers[1].mlp_norm._f16
    finally:
        tuning.set_tuning(None)


def test_head_takes_the_float16_path_in_the_decode_graphs_only(monkeypatch) -> None:
    """A quantized head whose one-row pick is the float16-code kernel is tiled too, and the
    final norm writes its input prepared only where the caller passes every row to the
    head (``head_input``, the decode graphs): logits within float16-versus-bfloat16
    rounding of the untiled model's, and the same values when written into a float32
    buffer (the graphs' ``out``); without it the head takes a tensor (its tensor path
    on the tiled words), within the same rounding (the layers still take prepared x).
    ``KILN_WQ_F16_HEAD=0`` leaves the head out."""
    from kiln.kernels import tuning
    from kiln.quant.passes import tile_f16_weights
    from kiln.quant.stats import make_kv_cache, single_sequence_metadata

    _llm, model, tun = _int4_model(head=True)
    ids = torch.randint(0, 512, (3,), generator=torch.Generator().manual_seed(2)).to(DEV)

    def logits(head_input: bool) -> tuple[torch.Tensor, object]:
        kv = make_kv_cache(model, 3)
        meta = single_sequence_metadata(3, kv.tokens_per_block, ids.device)
        hidden = model(ids, torch.arange(3, device=DEV), kv.layers, meta, head_input=head_input)
        return model.compute_logits(hidden), hidden

    with torch.inference_mode():
        plain, _ = logits(True)
    tuning.set_tuning(tun)
    try:
        assert tile_f16_weights(model, enable=True) == 7
        assert model.lm_head.proj.f16_rows == 4 and model.norm._f16 == [model.lm_head.proj]
        calls: list[int] = []  # K of each projection given prepared x (CPU and GPU alike)
        real = wq_tiled.linear

        def spy(x, *a, **kw):
            if isinstance(x, F16Act):
                calls.append(x.shape[1])
            return real(x, *a, **kw)

        monkeypatch.setattr(wq_tiled, "linear", spy)
        with torch.inference_mode():
            got, hidden = logits(True)
            # qkv, gate_up, down of both layers, then the head (K 256; down's is 512)
            assert isinstance(hidden, F16Act) and len(calls) == 7 and calls[-1] == 256
            # into the graphs' float32 buffer (on a GPU the kernel writes it itself)
            buf = torch.full_like(got, float("nan"))
            assert model.compute_logits(hidden, buf) is buf and torch.equal(buf, got)
            got_plain, hidden = logits(False)
            assert isinstance(hidden, torch.Tensor) and len(calls) == 14 and calls[-1] == 512
    finally:
        tuning.set_tuning(None)
    assert got.dtype == torch.float32 and got.shape == plain.shape
    assert _rel(got, plain) < 2e-2, _rel(got, plain)
    assert _rel(got_plain, plain) < 2e-2, _rel(got_plain, plain)
    _, model2, _ = _int4_model(head=True)
    monkeypatch.setattr(wq_f16, "HEAD", False)  # KILN_WQ_F16_HEAD=0: the head left out
    tuning.set_tuning(tun)
    try:
        assert tile_f16_weights(model2, enable=True) == 6
        assert model2.lm_head.proj.f16_rows == 0 and not model2.norm._f16
    finally:
        tuning.set_tuning(None)


def test_decode_steps_take_the_float16_path(monkeypatch) -> None:
    """Through the engine (eager steps; on a GPU the real kernels): after tiling, a
    request's decode steps (one row) have SiLU·mul write down's prepared x, and the
    request finishes."""
    from kiln import SamplingParams
    from kiln.kernels import tuning
    from kiln.quant.passes import tile_f16_weights

    llm, model, tun = _int4_model()
    seen: list[int] = []
    real = wq_tiled.silu_mul_f16
    monkeypatch.setattr(wq_tiled, "silu_mul_f16", lambda x: seen.append(x.shape[0]) or real(x))
    tuning.set_tuning(tun)
    try:
        assert tile_f16_weights(model, enable=True) == 6
        params = SamplingParams(max_tokens=4, temperature=0)
        out = llm.generate([[1, 2, 3, 4, 5, 6]], params, use_tqdm=False)
    finally:
        tuning.set_tuning(None)
    assert len(out[0].outputs[0].token_ids) == 4
    assert seen and set(seen) == {1}  # the decode steps (the 6-token prefill: no)
