"""compressed-tensors checkpoints (llm-compressor): FP8 W8A8 and int4 W4A16 built into kiln
engines. The synthetic checkpoints hold the same quantized tensors as a checkpoint in a
format kiln already loads (``quant_method: fp8``, AutoAWQ), written in compressed-tensors'
layout from its description; the two engines must be identical, tensor for tensor, and give
the same logits. Refusals name what is not supported and what to use."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.build.loader import load_engine
from kiln.build.prequant import checkpoint_layout, checkpoint_quant
from kiln.errors import CheckpointError
from kiln.quant import formats as qf
from kiln.quant.cli_options import quant_desc
from tests.test_prequantized import IDS, IGNORED, PROJ, _build, _pack_awq, _write, tiny_hf
from tests.util import prefill_logits

__all__ = ["tiny_hf"]  # the module-scoped fixture, shared
GROUP = 32

FP8_DYNAMIC = {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True,
               "symmetric": True}  # fmt: skip
FP8_STATIC = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False,
              "symmetric": True}  # fmt: skip


def _ct(weights: dict, inputs: dict | None, fmt: str) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
             "output_activations": None}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups":
            {"group_0": group}, "ignore": ["lm_head", IGNORED.removeprefix("model.")],
            "kv_cache_scheme": None, "quantization_status": "compressed"}  # fmt: skip


def _fp8_w(strategy: str) -> dict:
    return {"type": "float", "num_bits": 8, "strategy": strategy, "dynamic": False,
            "symmetric": True, "group_size": None}  # fmt: skip


def _int4_w(symmetric: bool, actorder: str | None = None) -> dict:
    return {"type": "int", "num_bits": 4, "strategy": "group", "group_size": GROUP,
            "symmetric": symmetric, "dynamic": False, "actorder": actorder}  # fmt: skip


def _pack_k(codes: torch.Tensor) -> torch.Tensor:
    """uint (R, C) values 0..15 -> int32 (R, C/8): value 8j + i in bits 4i..4i+3 of column
    j (compressed-tensors' pack_to_int32, its +8 offset already in the values)."""
    c = codes.to(torch.int64)
    out = torch.zeros(c.shape[0], c.shape[1] // 8, dtype=torch.int64)
    for i in range(8):
        out |= c[:, i::8] << (4 * i)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def test_pack_helper_matches_the_format() -> None:
    one = torch.zeros(1, 16, dtype=torch.int64)
    one[0, 9] = 5  # input 9 = 8 * 1 + 1: column 1, bits 4..7
    assert _pack_k(one).tolist() == [[0, 5 << 4]]


def _fp8_pair(src: Path, out: Path, per_tensor: bool, static: bool) -> tuple[Path, Path]:
    """(compressed-tensors checkpoint, ``quant_method: fp8`` checkpoint), same tensors."""
    tensors: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(3)
    for name, w in load_file(str(src / "model.safetensors")).items():
        mod = name.removesuffix(".weight")
        tensors[name] = w
        if not PROJ.fullmatch(name) or mod == IGNORED:
            continue
        s = w.float().abs().amax(dim=1, keepdim=True) / 448  # (N, 1)
        s = s.amax().reshape(1) if per_tensor else s
        tensors[name] = qf.quantize_fp8(w, s)
        tensors[mod + ".weight_scale"] = s.to(torch.bfloat16).float()  # bf16-exact values
        if static:
            tensors[mod + ".input_scale"] = (torch.rand(1, generator=gen) + 0.5) / 100
    ct = _ct(_fp8_w("tensor" if per_tensor else "channel"),
             FP8_STATIC if static else FP8_DYNAMIC, "float-quantized")  # fmt: skip
    # compressed-tensors keeps the scales in the weights' dtype
    ct_tensors = {k: v.to(torch.bfloat16) if k.endswith("weight_scale") else v
                  for k, v in tensors.items()}  # fmt: skip
    native = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
    return (_write(src, out / "ct", ct_tensors, ct), _write(src, out / "fp8", tensors, native))


def _same_engines(a: Path, b: Path) -> None:
    ea, eb = load_engine(a, "cpu"), load_engine(b, "cpu")
    sa, sb = ea.model.state_dict(), eb.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(
            sa[k].view(torch.uint8) if sa[k].dtype == qf.FP8_DTYPE else sa[k],
            sb[k].view(torch.uint8) if sb[k].dtype == qf.FP8_DTYPE else sb[k],
        ), k
    assert torch.equal(prefill_logits(ea, IDS), prefill_logits(eb, IDS))


@pytest.mark.parametrize("per_tensor,static", [(False, False), (True, False), (True, True)])
def test_fp8_w8a8_checkpoint(per_tensor: bool, static: bool, tiny_hf: Path, tmp_path: Path):
    ct, native = _fp8_pair(tiny_hf, tmp_path, per_tensor, static)
    m = _build(ct, tmp_path / "e-ct")
    q = m["quant"]
    assert q["algo"] == "fp8" and q["applied"] == "checkpoint"
    assert q["activation_scheme"] == ("static" if static else "dynamic")
    assert q["checkpoint_layout"] == "fp8"
    assert "layers.0.mlp.down" in q["report"]["excluded"] and len(q["report"]["modules"]) == 7
    _build(native, tmp_path / "e-fp8")
    _same_engines(tmp_path / "e-ct", tmp_path / "e-fp8")


def _int4_pair(src: Path, out: Path, symmetric: bool, g_idx: bool) -> tuple[Path, Path, Path]:
    """(compressed-tensors pack-quantized, AutoAWQ, plain dequantized) checkpoints of the
    same int4 codes, scales and zeros."""
    ct_t: dict[str, torch.Tensor] = {}
    awq_t: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        mod = name.removesuffix(".weight")
        if not PROJ.fullmatch(name) or mod == IGNORED:
            ct_t[name] = awq_t[name] = plain[name] = w
            continue
        n, k = w.shape
        if symmetric:  # signed q in [-8, 7], stored q + 8; zero 8
            wg = w.float().reshape(n, k // GROUP, GROUP)
            s = (wg.abs().amax(dim=-1) / 7.5).clamp(min=1e-8).half().float()
            q = (torch.round(wg / s[..., None]).clamp(-8, 7) + 8).reshape(n, k).to(torch.uint8)
            z = torch.full((n, k // GROUP), 8, dtype=torch.uint8)
        else:
            q, s, z = qf.quantize_int4(w, GROUP)
            s = s.half().float()
        ct_t[mod + ".weight_packed"] = _pack_k(q)
        ct_t[mod + ".weight_scale"] = s.to(torch.bfloat16) if symmetric else s.half()
        ct_t[mod + ".weight_shape"] = torch.tensor([n, k])
        if not symmetric:  # zero points: zp + 8 = the unsigned zero, packed along N
            ct_t[mod + ".weight_zero_point"] = _pack_k(z.t()).t().contiguous()
        if g_idx:
            ct_t[mod + ".weight_g_idx"] = (torch.arange(k) // GROUP).to(torch.int32)
        s_used = ct_t[mod + ".weight_scale"].float()
        awq_t[mod + ".qweight"] = _pack_awq(q.t())
        awq_t[mod + ".qzeros"] = _pack_awq(z.t())
        awq_t[mod + ".scales"] = s_used.half().t()
        plain[name] = qf.dequantize_int4(q, s_used, z)
    ct = _ct(_int4_w(symmetric, "group" if g_idx else None), None, "pack-quantized")
    awq = {"quant_method": "awq", "version": "gemm", "bits": 4, "zero_point": True,
           "group_size": GROUP}  # fmt: skip
    return (_write(src, out / "ct", ct_t, ct), _write(src, out / "awq", awq_t, awq),
            _write(src, out / "plain", plain, None))  # fmt: skip


@pytest.mark.parametrize("symmetric,g_idx", [(True, False), (False, False), (True, True)])
def test_int4_w4a16_checkpoint(symmetric: bool, g_idx: bool, tiny_hf: Path, tmp_path: Path):
    ct, awq, plain = _int4_pair(tiny_hf, tmp_path, symmetric, g_idx)
    m = _build(ct, tmp_path / "e-ct")
    q = m["quant"]
    assert q["algo"] == "int4-awq" and q["group_size"] == GROUP
    assert q["checkpoint_layout"] == "ct_int4" and q["report"]["excluded"] == ["layers.0.mlp.down"]
    assert "from a pre-quantized compressed-tensors checkpoint" in quant_desc(q)  # kiln inspect
    eng = load_engine(tmp_path / "e-ct", "cpu")
    zero = eng.model.get_submodule("layers.1.mlp.gate_up").weight_zero
    assert bool((zero == 8).all()) == symmetric
    _build(awq, tmp_path / "e-awq")
    _same_engines(tmp_path / "e-ct", tmp_path / "e-awq")
    _build(plain, tmp_path / "e-plain")
    a = prefill_logits(eng, IDS)
    b = prefill_logits(load_engine(tmp_path / "e-plain", "cpu"), IDS)
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)  # W4A16: the dequantized model


def _refused(qc: dict) -> str:
    with pytest.raises(CheckpointError) as e:
        checkpoint_quant({"quantization_config": qc})
    return str(e.value)


def test_refusals_name_what_to_use() -> None:
    fp8 = _ct(_fp8_w("channel"), FP8_DYNAMIC, "float-quantized")
    assert checkpoint_layout(fp8) == "fp8"
    assert checkpoint_quant({"quantization_config": fp8}).activation_scheme == "dynamic"
    cases = []
    c = copy.deepcopy(fp8)
    c["config_groups"]["group_0"]["input_activations"] = None
    cases.append((c, "W8A16"))
    # FP8_BLOCK loads (kiln's fp8 "block"); block weights with per-token activations do not
    blk = _fp8_w("block") | {"block_structure": [128, 128]}
    group_in = FP8_DYNAMIC | {"strategy": "group", "group_size": 128}
    ok = _ct(blk, group_in, "float-quantized")
    assert checkpoint_layout(ok) == "fp8_block"
    assert checkpoint_quant({"quantization_config": ok}).activation_scheme == "block"
    c = _ct(blk, FP8_DYNAMIC, "float-quantized")
    cases.append((c, "block-wise FP8 weights with block_structure [128, 128]"))
    c = _ct(_fp8_w("block") | {"block_structure": [64, 64]}, group_in, "float-quantized")
    cases.append((c, "use FP8_BLOCK"))
    c = copy.deepcopy(fp8)
    c["config_groups"]["group_1"] = {"targets": ["re:.*down_proj"], "weights": _int4_w(True),
                                     "format": "pack-quantized"}  # fmt: skip
    cases.append((c, "several different schemes"))
    cases.append((_ct(_int4_w(True) | {"strategy": "channel", "group_size": None}, None,
                      "pack-quantized"), "strategy 'channel'"))  # fmt: skip
    cases.append((_ct(_int4_w(True) | {"num_bits": 2}, None, "pack-quantized"), "int 2-bit"))
    cases.append((_ct(_int4_w(True) | {"num_bits": 8}, None, "pack-quantized"),
                  "int8 weights with strategy 'group'"))  # fmt: skip
    cases.append((_ct(_int4_w(True), FP8_DYNAMIC, "pack-quantized"), "W4A8"))
    frozen = {"quantization_status": "frozen"}
    assert checkpoint_quant({"quantization_config": fp8 | frozen}).algo == "fp8"
    cases.append((_ct(_int4_w(True), None, "pack-quantized") | frozen, "'frozen'"))
    cases.append((fp8 | {"quantization_status": "initialized"}, "'initialized'"))
    cases.append((fp8 | {"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity"))
    cases.append((fp8 | {"transform_config": {"config_groups": {}}}, "transform"))
    cases.append((fp8 | {"config_groups": {}}, "without config_groups"))
    for qc, why in cases:
        msg = _refused(qc)
        assert why in msg and "compressed-tensors checkpoint" in msg, (why, msg)
        assert "--quant" in msg or "re-export" in msg or "export" in msg, msg


def test_int4_act_order_groups_interleaved(tiny_hf: Path, tmp_path: Path) -> None:
    """actorder "group": weight_g_idx interleaves the groups along K. The codes, scales,
    zeros and g_idx of the GPTQ test's act-order checkpoint, written as compressed-tensors:
    the engine gathers x's columns and equals the plain dequantized model."""
    from tests.test_prequant_gptq import _gptq

    gdir, pdir, ref = _gptq(tiny_hf, tmp_path / "g", "gptq_v2", False, "actorder")
    gck = load_file(str(gdir / "model.safetensors"))
    t: dict[str, torch.Tensor] = {}
    for name, w in load_file(str(tiny_hf / "model.safetensors")).items():
        mod = name.removesuffix(".weight")
        if mod not in ref:
            t[name] = w
            continue
        r = ref[mod]
        t[mod + ".weight_packed"] = _pack_k(r["q"])
        t[mod + ".weight_scale"] = r["scale"].half()
        t[mod + ".weight_zero_point"] = _pack_k(r["zero"].t()).t().contiguous()
        t[mod + ".weight_shape"] = torch.tensor(list(r["q"].shape))
        t[mod + ".weight_g_idx"] = gck[mod + ".g_idx"]
    qc = _ct(_int4_w(False, "group"), None, "pack-quantized")
    ct = _write(tiny_hf, tmp_path / "ct", t, qc)
    _build(ct, tmp_path / "e")
    eng = load_engine(tmp_path / "e", "cpu")
    assert eng.model.get_submodule("layers.1.attn.qkv").input_perm is not None
    _build(pdir, tmp_path / "p")
    a = prefill_logits(eng, IDS)
    b = prefill_logits(load_engine(tmp_path / "p", "cpu"), IDS)
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def _int8_ckpt(src: Path, out: Path, w8a8: bool, packed: bool) -> tuple[Path, dict]:
    """An int8 compressed-tensors checkpoint (per-channel symmetric weights) and the
    (q, scale) written for each quantized projection."""
    tensors: dict[str, torch.Tensor] = {}
    written: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        mod = name.removesuffix(".weight")
        if not PROJ.fullmatch(name) or mod == IGNORED:
            tensors[name] = w
            continue
        q, s = qf.quantize_int8_weight(w)  # int8 (N, K), (N,)
        s = s.to(torch.bfloat16)
        written[mod] = (q, s.float())
        tensors[mod + ".weight_scale"] = s.reshape(-1, 1)
        if packed:  # four bytes q + 128 per int32, input 4j + i in bits 8i..8i+7
            b = (q.to(torch.int64) + 128).reshape(q.shape[0], -1, 4)
            v = sum(b[..., i] << (8 * i) for i in range(4))
            tensors[mod + ".weight_packed"] = torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)
            tensors[mod + ".weight_shape"] = torch.tensor(list(q.shape))
        else:
            tensors[name] = q
    wargs = {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True,
             "dynamic": False}  # fmt: skip
    aargs = {"type": "int", "num_bits": 8, "strategy": "token", "symmetric": True,
             "dynamic": True}  # fmt: skip
    fmt = "pack-quantized" if packed else "int-quantized"
    return _write(src, out / "ct", tensors, _ct(wargs, aargs if w8a8 else None, fmt)), written


@pytest.mark.parametrize("w8a8,packed", [(True, False), (False, True), (False, False)])
def test_int8_checkpoint(w8a8: bool, packed: bool, tiny_hf: Path, tmp_path: Path) -> None:
    ckpt, written = _int8_ckpt(tiny_hf, tmp_path, w8a8, packed)
    m = _build(ckpt, tmp_path / "e")
    q = m["quant"]
    assert q["algo"] == ("w8a8-sq" if w8a8 else "int8-wo") and q["applied"] == "checkpoint"
    assert "alpha" not in quant_desc(q)  # no smoothing of kiln's: none to report
    assert q["checkpoint_layout"] == ("ct_int8_packed" if packed else "ct_int8")
    assert q["report"]["excluded"] == ["layers.0.mlp.down"]
    eng = load_engine(tmp_path / "e", "cpu")
    sd = eng.model.state_dict()
    parts = [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    assert torch.equal(sd["layers.1.attn.qkv.weight"], torch.cat([written[p][0] for p in parts]))
    assert torch.equal(sd["layers.1.attn.qkv.weight_scale"],
                       torch.cat([written[p][1] for p in parts]))  # fmt: skip
    if w8a8:
        assert torch.equal(sd["layers.1.attn.qkv.smooth"], torch.ones(64))
    # against the plain model of the dequantized weights: W8A16 up to float32 rounding,
    # W8A8 close (its activations are rounded to int8 too)
    plain = {}
    for name, w in load_file(str(tiny_hf / "model.safetensors")).items():
        mod = name.removesuffix(".weight")
        plain[name] = qf.dequantize_rows(*written[mod]) if mod in written else w
    _build(_write(tiny_hf, tmp_path / "plain", plain, None), tmp_path / "p")
    a = prefill_logits(eng, IDS)
    b = prefill_logits(load_engine(tmp_path / "p", "cpu"), IDS)
    if w8a8:
        assert float((a - b).norm() / b.norm()) < 0.05
    else:
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_int8_refusals() -> None:
    w = {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True}
    a = {"type": "int", "num_bits": 8, "strategy": "token", "symmetric": True, "dynamic": True}
    ok = _ct(w, a, "int-quantized")
    assert checkpoint_quant({"quantization_config": ok}).algo == "w8a8-sq"
    static = a | {"strategy": "tensor", "dynamic": False}
    for qc, why in [
        (_ct(w, static, "int-quantized"), "static int8 activations"),
        (_ct(w, a | {"symmetric": False}, "int-quantized"), "asymmetric int8 activations"),
        (_ct(w | {"strategy": "group", "group_size": 128}, None, "pack-quantized"),
         "strategy 'group'"),
        (_ct(w | {"symmetric": False}, a, "int-quantized"), "asymmetric"),
    ]:  # fmt: skip
        msg = _refused(qc)
        assert why in msg and "--quant" in msg, (why, msg)


def test_fbgemm_fp8_checkpoint(tiny_hf: Path, tmp_path: Path) -> None:
    """Meta's fbgemm_fp8 (per-channel weights, dynamic per-token activations): the same
    tensors as a ``quant_method: fp8`` checkpoint give the same engine."""
    import json

    _, native = _fp8_pair(tiny_hf, tmp_path, per_tensor=False, static=False)
    t = load_file(str(native / "model.safetensors"))
    qc = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
          "modules_to_not_convert": ["lm_head", IGNORED.removeprefix("model.")]}  # fmt: skip
    assert json.loads((native / "config.json").read_text())["quantization_config"]
    fb = _write(tiny_hf, tmp_path / "fbgemm", t, qc)
    m = _build(fb, tmp_path / "e-fb")
    assert m["quant"]["algo"] == "fp8" and m["quant"]["activation_scheme"] == "dynamic"
    assert m["quant"]["checkpoint_layout"] == "fp8"
    _build(native, tmp_path / "e-fp8")
    _same_engines(tmp_path / "e-fb", tmp_path / "e-fp8")
