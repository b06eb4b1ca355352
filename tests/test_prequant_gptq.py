"""Pre-quantized GPTQ int4 checkpoints (AutoGPTQ / GPTQModel / optimum layout, v1 and v2
zero points) built into kiln engines. The checkpoints are synthetic: the tiny Llama's
projections quantized here and packed from the format description, next to a plain
checkpoint of the same weights dequantized."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.build.loader import load_engine
from kiln.build.prequant import checkpoint_quant
from kiln.build.prequant_gptq import gptq_parts, unpack_gptq_cols, unpack_gptq_rows
from kiln.errors import CheckpointError, ConfigError
from kiln.quant import formats as qf
from tests.test_prequantized import IDS, IGNORED, PROJ, _build, _write
from tests.util import prefill_logits, save_tiny_llama

GROUP = 32


def _int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2**32) -> the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack_rows(q: torch.Tensor) -> torch.Tensor:
    """(K, N) values 0..15 -> GPTQ qweight int32 (K/8, N): row k at bits 4 * (k % 8)."""
    q = q.to(torch.int64)
    out = torch.zeros(q.shape[0] // 8, q.shape[1], dtype=torch.int64)
    for k in range(q.shape[0]):
        out[k // 8] |= q[k] << (4 * (k % 8))
    return _int32(out)


def _pack_cols(z: torch.Tensor) -> torch.Tensor:
    """(R, N) values 0..15 -> GPTQ qzeros int32 (R, N/8): column n at bits 4 * (n % 8)."""
    z = z.to(torch.int64)
    out = torch.zeros(z.shape[0], z.shape[1] // 8, dtype=torch.int64)
    for n in range(z.shape[1]):
        out[:, n // 8] |= z[:, n] << (4 * (n % 8))
    return _int32(out)


def _quantize_sym(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric GPTQ-style int4: zero 8, scale amax / 7 per group of GROUP inputs."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    s = (g.abs().amax(dim=-1) / 7).clamp(min=1e-8)
    q = (torch.round(g / s[..., None]) + 8).clamp(0, 15).to(torch.uint8).reshape(n, k)
    return q, s, torch.full_like(s, 8, dtype=torch.uint8)


def re_shared(mod: str) -> str:
    """The input a projection shares: q, k, v one, gate and up one (per layer)."""
    for parts, key in ((("q_proj", "k_proj", "v_proj"), "attn_in"), (("gate_proj", "up_proj"),
                                                                       "mlp_in")):  # fmt: skip
        if mod.rsplit(".", 1)[1] in parts:
            return mod.rsplit(".", 2)[0] + "." + key
    return mod


def _gptq(
    src: Path, out: Path, fmt: str, sym: bool, g_idx: str = "trivial", **qc: object
) -> tuple[Path, Path, dict[str, dict[str, torch.Tensor]]]:
    """(GPTQ checkpoint, plain checkpoint of its dequantized weights, the unpacked q / scale /
    zero of every quantized projection). ``g_idx``: "trivial", "none" (left out) or "perm"
    (a g_idx whose groups interleave along K, not matching the codes: for refusals) or
    "actorder" (quantized in act order: each input of a layer's shared input quantized in
    the order of a random permutation, as GPTQ with ``desc_act`` does, so the groups
    interleave along K in the stored order). Every projection gets an all-zero ``bias``,
    as GPTQ exporters write them."""
    quant: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    ref: dict[str, dict[str, torch.Tensor]] = {}
    orders: dict[str, torch.Tensor] = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        mod = name.removesuffix(".weight")
        if not PROJ.fullmatch(name) or mod == IGNORED:
            quant[name] = plain[name] = w
            continue
        k = w.shape[1]
        perm = None
        if g_idx == "actorder":  # q, k, v (and gate, up) see one input: one order
            shared = re_shared(mod)
            gen = torch.Generator().manual_seed(zlib.crc32(shared.encode()))
            perm = orders.setdefault(shared, torch.randperm(k, generator=gen))
            w = w[:, perm]  # quantized in that order: groups of GROUP consecutive there
        q, s, z = _quantize_sym(w) if sym else qf.quantize_int4(w, GROUP)
        s = s.half()
        if perm is not None:  # stored in the checkpoint's input order again
            inv = torch.argsort(perm)
            q = q[:, inv]
        stored = z.to(torch.int64) - (1 if fmt == "gptq" else 0)
        assert int(stored.min()) >= 0  # v1 cannot store a zero of 0
        quant[mod + ".qweight"] = _pack_rows(q.t())
        quant[mod + ".qzeros"] = _pack_cols(stored.t())
        quant[mod + ".scales"] = s.t()
        quant[mod + ".bias"] = torch.zeros(w.shape[0], dtype=torch.float16)
        gi = torch.arange(k, dtype=torch.int32) // GROUP
        if g_idx == "perm":
            gi = gi.reshape(GROUP, -1).t().reshape(-1)
        if perm is not None:  # input j's group: where it sits in the order, over GROUP
            gi = (torch.argsort(perm) // GROUP).to(torch.int32)
        if g_idx != "none":
            quant[mod + ".g_idx"] = gi
        # dequantized in the checkpoint's input order: input j takes its group's scale
        gl = gi.long()
        plain[name] = ((q.float() - z.float()[:, gl]) * s.float()[:, gl]).to(w.dtype)
        ref[mod] = {"q": q, "scale": s.float(), "zero": z}
    cfg = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": sym, "desc_act": False}
    cfg |= {"checkpoint_format": fmt, **qc}
    return _write(src, out / "quant", quant, cfg), _write(src, out / "plain", plain, None), ref


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("hf"))


def test_gptq_unpack_inverts_the_documented_packing() -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (24, 5), generator=gen)  # K = 24 rows, N = 5 columns
    packed = _pack_rows(q)
    assert packed.dtype == torch.int32 and packed.shape == (3, 5)
    assert torch.equal(unpack_gptq_rows(packed), q.to(torch.uint8))
    z = torch.randint(0, 16, (3, 40), generator=gen)
    packed = _pack_cols(z)
    assert packed.shape == (3, 5) and torch.equal(unpack_gptq_cols(packed), z.to(torch.uint8))
    one = torch.zeros(8, 1, dtype=torch.int64)
    one[1, 0] = 15  # input row 1 lives in bits 4..7
    assert int(_pack_rows(one)[0, 0]) == 15 << 4
    one = torch.zeros(1, 8, dtype=torch.int64)
    one[0, 7] = 15  # output column 7 lives in bits 28..31: the sign bit
    assert int(_pack_cols(one)[0, 0]) == (15 << 28) - 2**32


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_zero_points(fmt: str) -> None:
    """v1 stores zero - 1 (a stored 14 is zero 15; a stored 15 is refused), v2 the zero."""
    k, n = 64, 8
    q = torch.randint(0, 16, (k, n), generator=torch.Generator().manual_seed(3))
    stored = torch.tensor([[14, 0, 1, 7, 8, 13, 2, 3], [5, 6, 9, 10, 11, 12, 14, 0]])
    p = {"qweight": _pack_rows(q), "qzeros": _pack_cols(stored), "scales": torch.ones(2, n)}
    parts = gptq_parts("m", p, GROUP, v1=fmt == "gptq")
    want = stored.t() + (1 if fmt == "gptq" else 0)
    assert torch.equal(parts["weight_zero"], want.to(torch.uint8))
    assert torch.equal(parts["weight"], q.t().to(torch.uint8))
    stored[1, 3] = 15
    p["qzeros"] = _pack_cols(stored)
    if fmt == "gptq":
        with pytest.raises(CheckpointError, match=r"1 stored zero point.*reads as 16.*gptq_v2"):
            gptq_parts("m", p, GROUP, v1=True)
    else:
        assert int(gptq_parts("m", p, GROUP, v1=False)["weight_zero"][3, 1]) == 15


@pytest.mark.parametrize(
    "fmt,sym,g_idx,desc_act",
    [
        ("gptq", True, "trivial", False),
        ("gptq", False, "none", False),
        ("gptq_v2", True, "none", False),
        ("gptq_v2", False, "trivial", True),  # act-order with static groups: trivial g_idx
        ("gptq", True, "actorder", True),  # act order, groups interleaved along K
        ("gptq_v2", False, "actorder", True),
    ],
)
def test_gptq_checkpoint(
    fmt: str, sym: bool, g_idx: str, desc_act: bool, tiny_hf: Path, tmp_path: Path
) -> None:
    qdir, pdir, ref = _gptq(tiny_hf, tmp_path, fmt, sym, g_idx, desc_act=desc_act)
    m = _build(qdir, tmp_path / "e")
    q = m["quant"]
    assert q["algo"] == "int4-awq" and q["group_size"] == GROUP and q["applied"] == "checkpoint"
    assert q["checkpoint_layout"] == fmt and q["report"]["excluded"] == ["layers.0.mlp.down"]
    eng = load_engine(tmp_path / "e", "cpu")
    mod = eng.model.get_submodule("layers.1.attn.qkv")
    assert mod.bias is None and torch.equal(mod.smooth, torch.ones(64))
    parts = [ref[f"model.layers.1.self_attn.{p}_proj"] for p in "qkv"]
    codes = torch.cat([r["q"] for r in parts])
    if g_idx == "actorder":  # stored sorted by group; x gathered in the same order
        perm = mod.input_perm
        assert perm is not None and sorted(perm.tolist()) == list(range(64))
        codes = codes[:, perm]
        assert eng.model.get_submodule("layers.1.mlp.down").input_perm is not None
    else:
        assert mod.input_perm is None
    assert torch.equal(mod.weight, qf.pack_int4(codes))
    assert torch.equal(mod.weight_scale, torch.cat([r["scale"] for r in parts]))
    assert torch.equal(mod.weight_zero, torch.cat([r["zero"] for r in parts]))
    if sym:
        assert bool((mod.weight_zero == 8).all())
    _build(pdir, tmp_path / "p")
    a, b = prefill_logits(eng, IDS), prefill_logits(load_engine(tmp_path / "p", "cpu"), IDS)
    # W4A16 in float32 is the dequantized model up to float32 rounding
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_gptq_refusals(tiny_hf: Path, tmp_path: Path) -> None:
    def refused(match: str, **qc: object) -> None:
        with pytest.raises(CheckpointError, match=match):
            cfg = {"quant_method": "gptq", "bits": 4, "group_size": 128, **qc}
            checkpoint_quant({"quantization_config": cfg})

    refused(r"bits=8 is not supported.*4-bit", bits=8)
    refused(r"group_size=-1 is not supported", group_size=-1)
    refused(r"checkpoint_format='marlin' is not supported", checkpoint_format="marlin")
    refused(r"checkpoint_format='marlin'", is_marlin_format=True)
    refused(r"pack_dtype='int64'", pack_dtype="int64")
    refused(r"lm_head=true", lm_head=True)
    assert checkpoint_quant({"quantization_config": {"quant_method": "gptq"}}).group_size == 128
    # act order: q, k and v quantized in different input orders cannot share one gather
    qdir, _, _ = _gptq(tiny_hf, tmp_path / "perm", "gptq_v2", False, "actorder", desc_act=True)
    ck = load_file(str(qdir / "model.safetensors"))
    qc = json.loads((qdir / "config.json").read_text())["quantization_config"]
    kg = "model.layers.1.self_attn.k_proj.g_idx"
    ck[kg] = ck[kg].flip(0)
    with pytest.raises(CheckpointError, match=r"attn\.qkv fuses .* act-order input orders"):
        _build(_write(tiny_hf, tmp_path / "perm2", ck, qc), tmp_path / "e1")
    # a g_idx that does not give every group GROUP inputs
    ck[kg] = torch.zeros_like(ck[kg])
    with pytest.raises(CheckpointError, match=r"k_proj: g_idx does not give every group"):
        _build(_write(tiny_hf, tmp_path / "perm3", ck, qc), tmp_path / "e1b")
    # a v1 checkpoint whose stored zero is 15
    qdir, _, _ = _gptq(tiny_hf, tmp_path / "ovf", "gptq", True)
    ck = load_file(str(qdir / "model.safetensors"))
    qc = json.loads((qdir / "config.json").read_text())["quantization_config"]
    ck["model.layers.1.mlp.up_proj.qzeros"][0, 0] |= 0xF
    with pytest.raises(CheckpointError, match="up_proj: 1 stored zero point"):
        _build(_write(tiny_hf, tmp_path / "ovf2", ck, qc), tmp_path / "e2")
    # a non-zero bias the model has no place for
    ck = load_file(str(qdir / "model.safetensors"))
    ck["model.layers.0.self_attn.o_proj.bias"][0] = 1.0
    with pytest.raises(CheckpointError, match=r"o_proj\.bias.*no place"):
        _build(_write(tiny_hf, tmp_path / "bias", ck, qc), tmp_path / "e3")
    # --quant other than what the checkpoint holds
    with pytest.raises(ConfigError, match="already quantized"):
        _build(qdir, tmp_path / "e4", algo="int8-wo")
