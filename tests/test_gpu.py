"""GPU checks (``pytest -m gpu``; skipped without CUDA): kiln in bfloat16 on the GPU against
transformers in bfloat16 on the same GPU, at Llama-3.1-8B width with 2 layers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.build.builder import build_engine
from kiln.build.loader import load_engine
from kiln.config import BuildConfig

from .util import prefill_logits, report

pytestmark = pytest.mark.gpu

WIDTH_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=2,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def hf_8b_width(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bf16 checkpoint saved by transformers. References are loaded back with
    ``from_pretrained``: casting a live model with ``.to(bfloat16)`` would also round its
    rotary ``inv_freq`` buffer to bf16, which transformers' own loading never does."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**WIDTH_8B, architectures=["LlamaForCausalLM"])
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    path = tmp_path_factory.mktemp("hf8b")
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def test_bf16_logits_match_transformers_on_gpu(hf_8b_width: Path, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    path = hf_8b_width
    build_engine(
        str(path),
        tmp_path / "eng",
        BuildConfig(device="cuda", dtype="bfloat16", max_seq_len=4096),
        progress=False,
    )
    engine = load_engine(tmp_path / "eng", "cuda")
    torch.manual_seed(1)
    ids = torch.randint(0, WIDTH_8B["vocab_size"], (300,), device="cuda")
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            hf = LlamaForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()
            logits = hf(ids[None]).logits[0].float()
            if dtype == torch.bfloat16:
                ref_bf16 = logits
            else:
                ref_fp32 = logits
            del hf
    ours = prefill_logits(engine, ids.tolist())
    err_vs_hf = _rel(ours, ref_bf16)
    err_ours_fp32 = _rel(ours, ref_fp32)
    err_hf_fp32 = _rel(ref_bf16, ref_fp32)
    print(
        f"bf16 rel err: kiln vs HF bf16 {err_vs_hf:.3e}; vs fp32: kiln {err_ours_fp32:.3e}, "
        f"HF {err_hf_fp32:.3e}"
    )
    # bf16 tolerance: kiln may not stray from the fp32 answer much more than transformers'
    # own bf16 path does, and stays within 2 % (relative to the largest logit) of it.
    assert err_vs_hf < 2e-2
    assert err_ours_fp32 < 1.5 * err_hf_fp32 + 1e-3
    agree = (ours.argmax(-1) == ref_bf16.argmax(-1)).float().mean().item()
    report(
        "gpu_bf16_logits_vs_transformers",
        {
            "model": "Llama-3.1-8B width, 2 layers, random weights, bf16, 300-token prefill",
            "rel_err_kiln_vs_hf_bf16": err_vs_hf,
            "rel_err_kiln_vs_hf_fp32": err_ours_fp32,
            "rel_err_hf_bf16_vs_hf_fp32": err_hf_fp32,
            "top1_agreement_vs_hf_bf16": agree,
            "rel_err_definition": "max|a-b| / max|b| over all logits",
        },
    )
    assert agree > 0.95


def test_dummy_8b_generates_on_gpu() -> None:
    llm = LLM("dummy:llama-3.1-8b", device="cuda", max_seq_len=2048, progress=False)
    assert llm.engine.dtype == torch.bfloat16
    outs = llm.generate(
        [[1, 2, 3]] * 4 + [list(range(100, 400))],
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [8] * 5
    # the same prompt batched four times gives four equal greedy continuations
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:4]}) == 1
    assert llm.kv.num_free_blocks == llm.kv.num_blocks
