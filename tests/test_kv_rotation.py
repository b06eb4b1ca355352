"""The Hadamard rotation of q and k for an fp8 KV cache (kiln.kernels.rotary): the sign
matrix, attention left unchanged by it, the fused Triton kernel against the reference
(interpreter on the CPU, compiled on a GPU), and the build / load wiring: the build
calibrates the cache's scales on rotated keys and records ``quant.kv_rotation``, loading
follows the manifest."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.kernels.attention import KV_FP8, AttentionMetadata, dequantize_cache, paged_attention_ref
from kiln.kernels.hadamard import hadamard_signs, kv_rotation_allowed
from kiln.kernels.rotary import rotary_write_kv_ref, rotary_write_kv_triton
from kiln.layers.rotary import RotaryEmbedding

from .util import save_tiny_llama

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("d", [1, 2, 32, 64, 128])
def test_hadamard_signs_are_orthogonal(d: int) -> None:
    s = hadamard_signs(d)
    assert set(s.unique().tolist()) <= {-1.0, 1.0} and torch.equal(s, s.T)
    assert torch.equal(s @ s.T, d * torch.eye(d))
    assert torch.equal(hadamard_signs(d, dtype=torch.bfloat16).float(), s)


def test_rotation_needs_a_power_of_two_head() -> None:
    assert [kv_rotation_allowed(d) for d in (16, 32, 48, 64, 80, 128, 256)] == [
        False, True, False, True, False, True, True,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="head_dim 48"):
        hadamard_signs(48)
    qkv = torch.randn(3, (2 + 2) * 48)
    cache = torch.zeros(2, 2, 4, 1, 48)
    cs = RotaryEmbedding(48, 64, 10000.0, None).cos_sin(torch.device("cpu"))
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        rotary_write_kv_triton(
            qkv, torch.arange(3), cs, cache, torch.arange(3), 2, 1, 48, None, torch.ones(48, 48)
        )


def _inputs(t: int, hq: int, hk: int, d: int, dtype: torch.dtype):
    cs = RotaryEmbedding(d, 512, 10000.0, None).cos_sin(torch.device(DEV))
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=DEV) * 3
    qkv[:, hq * d : hq * d + 3] *= 40  # outlier key channels, as trained models have
    pos = torch.randint(0, 500, (t,), device=DEV)
    return qkv.to(dtype), pos, cs


def test_rotation_leaves_attention_unchanged() -> None:
    """Rotating q and k by the same orthogonal matrix changes no score: the attention
    output over a float32 cache is the same with and without it (v is not rotated)."""
    torch.manual_seed(0)
    hq, hk, d, bs, t = 4, 2, 32, 8, 21
    qkv, pos, cs = _inputs(t, hq, hk, d, torch.float32)
    outs = []
    for rot in (None, hadamard_signs(d, DEV)):
        cache = torch.zeros(2, 3, bs, hk, d, device=DEV)
        q = rotary_write_kv_ref(qkv, pos, cs, cache, torch.arange(t, device=DEV), hq, hk, d,
                                None, rot)  # fmt: skip
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=DEV),
            seq_lens=torch.tensor([t], dtype=torch.int32, device=DEV),
            block_tables=torch.tensor([[0, 1, 2]], dtype=torch.int32, device=DEV),
            slot_mapping=torch.arange(t, device=DEV),
            query_start_loc_cpu=[0, t],
            seq_lens_cpu=[t],
        )
        outs.append((paged_attention_ref(q, cache, meta, d**-0.5), cache[1]))
    (a, va), (b, vb) = outs
    assert torch.equal(va, vb)
    # float32 rounding of the rotation, amplified by scores of up to ~200 (outlier keys)
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("t", [19, 45])  # 45 x 2 kv rows: the 64-row programs of prompts
def test_rotary_write_with_rotation_triton_matches_reference(d: int, fp8: bool, t: int) -> None:
    hq, hk, bs = 4, 2, 8
    nblk = -(-t // bs) + 2
    rot = hadamard_signs(d, DEV)
    for dtype in (torch.float32, torch.bfloat16):
        qkv, pos, cs = _inputs(t, hq, hk, d, dtype)
        slots = torch.randperm(nblk * bs, device=DEV)[:t]
        slots[3] = -1
        scales = torch.tensor([0.05, 0.02], device=DEV) if fp8 else None
        outs = []
        for fn in (rotary_write_kv_ref, rotary_write_kv_triton):
            cache = torch.zeros(2, nblk, bs, hk, d, dtype=KV_FP8 if fp8 else dtype, device=DEV)
            q = fn(qkv, pos, cs, cache, slots, hq, hk, d, scales, rot)
            outs.append((q, dequantize_cache(cache)))  # token-major values, scales 1
        (q0, a), (q1, b) = outs
        # float32 sums in another order: about an ulp of float32. In bfloat16 the rotation
        # mixes inputs that the interpreter rounds differently from torch (and a GPU
        # contracts into fused multiply-adds): errors of a few bfloat16 steps of the
        # largest value; e4m3 codes one e4m3 step apart
        tol = 1e-5 if dtype == torch.float32 else 4 * 2**-8
        _close(q1, q0, tol)
        if fp8:
            err = (a - b).abs()  # one e4m3 step, beyond the rotation's error above
            slack = 2**-9 if dtype == torch.float32 else tol * float(a.abs().max())
            assert bool((err <= a.abs() * 2**-3 + slack).all())
            assert (err > 0).float().mean() < 0.2
        else:
            _close(b, a, tol)
        untouched = torch.ones(nblk * bs, dtype=torch.bool, device=DEV)
        untouched[slots[slots >= 0]] = False
        assert not bool(b.view(2, nblk * bs, hk, d)[:, untouched].any())


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    scale = want.float().abs().max().clamp_min(1e-30)
    rel = float((got.float() - want.float()).abs().max() / scale)
    assert rel <= tol, f"error {rel:.3e} of the largest value > {tol:.1e}"


@pytest.fixture(scope="module")
def hf32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint with 32-wide heads (the rotation needs a power of two >= 32)."""
    heads = {"num_attention_heads": 2, "num_key_value_heads": 1}
    return save_tiny_llama(tmp_path_factory.mktemp("hf32"), config=heads)


@pytest.mark.parametrize("rotation", [None, "none"])
def test_build_records_the_rotation_and_loading_follows_it(
    hf32: Path, tmp_path: Path, rotation: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    from kiln import LLM, SamplingParams
    from kiln.build.builder import build_engine
    from kiln.config import BuildConfig, QuantConfig

    q = QuantConfig(kv_cache_dtype="fp8", kv_rotation=rotation, quality_tokens=64)
    m = build_engine(str(hf32), tmp_path / "e", BuildConfig(device="cpu", quant=q), progress=False)
    want = rotation is None
    assert m["quant"]["kv_rotation"] == ("hadamard" if want else "none")
    from kiln.cli import main

    assert main(["inspect", str(tmp_path / "e")]) == 0
    assert ("KV cache fp8 (Hadamard-rotated keys)" in capsys.readouterr().out) is want
    llm = LLM(str(tmp_path / "e"), device="cpu", progress=False)
    assert llm.kv_rotation is want
    rots = [layer.attn.kv_rotation for layer in llm.engine.model.layers]
    assert all((r is not None) is want for r in rots)
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    assert llm.stats().kv_cache_usage == 0.0


def test_runtime_fp8_cache_rotates_where_the_head_allows(hf32: Path) -> None:
    from kiln import LLM

    assert LLM(str(hf32), device="cpu", progress=False, kv_cache_dtype="fp8").kv_rotation
    assert not LLM(str(hf32), device="cpu", progress=False).kv_rotation
    # head size 16 (dummy:tiny): no rotation
    assert not LLM("dummy:tiny", device="cpu", progress=False, kv_cache_dtype="fp8").kv_rotation


def test_quantized_engine_with_a_rotated_fp8_cache(hf32: Path) -> None:
    """fp8 projections (buffers, no parameters in the attention layers) and an fp8 cache
    with rotated keys, built and run."""
    from kiln import LLM, SamplingParams
    from kiln.config import QuantConfig

    q = QuantConfig(algo="fp8", kv_cache_dtype="fp8", weight_rounding="nearest", quality_tokens=64)
    llm = LLM(str(hf32), device="cpu", progress=False, quant=q)
    assert llm.kv_rotation and llm.engine.manifest["quant"]["kv_rotation"] == "hadamard"
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3
