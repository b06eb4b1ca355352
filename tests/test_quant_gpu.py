"""Quantized engines end to end on the GPU (``pytest -m gpu``; skipped without CUDA): every
mode, with its real kernels (``torch._scaled_mm``, ``torch._int_mm``, the W4A16 / W8A16
Triton kernels, the fused activation quantization, the fp8 KV cache), decoding with CUDA
graphs against eager decode of the same engine, and against the unquantized engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln import LLM
from kiln.config import QuantConfig

from .test_gpu_fastpath import GREEDY, PROMPTS, _first_difference, small_llama3  # noqa: F401

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
MODES = {
    "fp8": dict(algo="fp8"),
    "fp8-kv": dict(algo="fp8", kv_cache_dtype="fp8"),
    "int8-wo": dict(algo="int8-wo"),
    "int4-awq": dict(algo="int4-awq", group_size=64),
    "w8a8-sq": dict(algo="w8a8-sq"),
}
KW = dict(device="cuda", dtype="bfloat16", max_seq_len=1024, progress=False)


@pytest.fixture(scope="module")
def unquantized(small_llama3: Path) -> list:  # noqa: F811
    llm = LLM(str(small_llama3), **KW)
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    del llm
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_quantized_engine_graphs_eager_and_reference(
    mode: str,
    small_llama3: Path,  # noqa: F811
    unquantized: list,
) -> None:
    q = QuantConfig(**MODES[mode])
    eager = LLM(str(small_llama3), quant=q, enforce_eager=True, **KW)
    want = eager.generate(PROMPTS, GREEDY, use_tqdm=False)
    del eager
    graphs = LLM(str(small_llama3), quant=q, **KW)
    assert graphs.core.runner.graphs is not None
    if q.kv_cache_dtype:
        assert graphs.kv_cache_dtype == "fp8"
    got = graphs.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert graphs.core.runner.graph_steps >= 25
    diffs = [_first_difference(a, b) for a, b in zip(want, got, strict=True)]
    assert sum(d is None for d in diffs) >= len(PROMPTS) - 1, diffs
    # against the unquantized engine: its first token is among the quantized top 5, and
    # most first tokens agree
    agree = 0
    for a, b in zip(unquantized, got, strict=True):
        assert a.outputs[0].token_ids[0] in b.outputs[0].logprobs[0], mode
        agree += a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
    assert agree >= len(PROMPTS) - 2, (mode, agree)
    assert graphs.stats().kv_cache_usage == 0.0
    del graphs
    torch.cuda.empty_cache()
