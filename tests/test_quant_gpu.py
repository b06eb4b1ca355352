"""Quantized engines end to end on the GPU (``pytest -m gpu``; skipped without CUDA): every
mode, with its real kernels (``torch._scaled_mm``, ``torch._int_mm``, the W4A16 / W8A16
Triton kernels, the fused activation quantization, the fp8 KV cache), decoding with CUDA
graphs against eager decode of the same engine, and against kiln's CPU emulation of
the same mode (the same checkpoint quantized on the CPU, in bfloat16).

History: a first version compared with the unquantized engine (its first token within the
quantized top 5). On the H200 (commit 55a943c) graphs matched eager for all five modes,
but that criterion failed for fp8, fp8-kv, int8-wo and int4-awq; on the CPU, in float32,
the same random checkpoint fails it too (fp8 and w8a8-sq miss the top 5 on one prompt
each; int8-wo changes 2 of 6 first tokens): its next-token distributions are too flat for
quantization noise. Hence the comparison with the emulation of the same mode. A float32
emulation in turn failed the top-5 criterion for fp8 and int4-awq (commit 06c7322): on
this checkpoint, the bfloat16 rounding of activations alone moves the first token's
log-probabilities by up to 0.22 nats unquantized and 0.97 nats with fp8 (measured on the
CPU, emulation in bfloat16 against float32), since a rounding step of the activations can
flip their e4m3 rounding. So the emulation runs in bfloat16, as the GPU does: what remains
are accumulation-order differences of the kernels."""

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
# weights rounded to nearest: the comparison is of kernels, and GPTQ rounding at load would
# add a minute of CPU time per mode (it has its own tests)
MODES = {
    "fp8": dict(algo="fp8", weight_rounding="nearest"),
    "fp8-kv": dict(algo="fp8", kv_cache_dtype="fp8", weight_rounding="nearest"),
    "int8-wo": dict(algo="int8-wo"),
    "int4-awq": dict(algo="int4-awq", group_size=64, weight_rounding="nearest"),
    "w8a8-sq": dict(algo="w8a8-sq"),
}
KW = dict(device="cuda", dtype="bfloat16", max_seq_len=1024, progress=False)


@pytest.mark.parametrize("mode", list(MODES))
def test_quantized_engine_graphs_eager_and_emulation(
    mode: str,
    small_llama3: Path,  # noqa: F811
) -> None:
    q = QuantConfig(**MODES[mode])
    cpu = LLM(str(small_llama3), quant=q, device="cpu", dtype="bfloat16", max_seq_len=1024,
              progress=False)  # fmt: skip
    emulated = cpu.generate(PROMPTS, GREEDY, use_tqdm=False)
    del cpu
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
    # the GPU kernels against the CPU emulation: the top-5 criterion at every first
    # difference (checked inside _first_difference)
    diffs = [_first_difference(a, b) for a, b in zip(emulated, got, strict=True)]
    print(f"{mode}: first differences from the CPU emulation {diffs}")
    assert graphs.stats().kv_cache_usage == 0.0
    del graphs
    torch.cuda.empty_cache()
