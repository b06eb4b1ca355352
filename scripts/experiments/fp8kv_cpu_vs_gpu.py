"""Experiment (GPU): first-token distributions of the fp8 + fp8-KV engine of
tests/test_quant_gpu.py's random Llama-3 checkpoint, CPU emulation (bfloat16) against the
GPU, with the keys Hadamard-rotated and not, and fp8 without an fp8 cache as the control.
Prints, per prompt, each side's top token and the other side's logprob of it."""

import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kiln import LLM
from kiln.config import QuantConfig
from kiln.sampling_params import SamplingParams

p = Path("/tmp/fp8kv_ckpt")
if not p.exists():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                      num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                      max_position_embeddings=8192, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 1024},
                      initializer_range=0.08, architectures=["LlamaForCausalLM"])  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(p, safe_serialization=True)
PROMPTS = [list(range(7 + 13 * i, 7 + 13 * i + n)) for i, n in enumerate([3, 17, 64, 300, 1, 33])]
G = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=20)
MODES = {
    "fp8": dict(algo="fp8", weight_rounding="nearest"),
    "fp8kv-rot": dict(algo="fp8", kv_cache_dtype="fp8", weight_rounding="nearest"),
    "fp8kv-norot": dict(algo="fp8", kv_cache_dtype="fp8", weight_rounding="nearest",
                        kv_rotation="none"),
    "bf16kv8-rot": dict(kv_cache_dtype="fp8"),
}
for name in sys.argv[1:] or MODES:
    q = QuantConfig(**MODES[name])
    res = {}
    for dev in ("cpu", "cuda"):
        llm = LLM(str(p), quant=q, device=dev, dtype="bfloat16", max_seq_len=1024,
                  progress=False, **({"enforce_eager": True} if dev == "cuda" else {}))  # fmt: skip
        out = llm.generate(PROMPTS, G, use_tqdm=False)
        res[dev] = [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in out]
        del llm
    worst = 0.0
    for i, (a, b) in enumerate(zip(res["cpu"], res["cuda"], strict=True)):
        ta, tb = max(a, key=a.get), max(b, key=b.get)
        gap = max(a[ta] - a.get(tb, -99), b[tb] - b.get(ta, -99))
        worst = max(worst, gap)
        print(f"{name} prompt {i}: cpu top {ta} {a[ta]:.3f} (gpu {b.get(ta, float('nan')):.3f}); "
              f"gpu top {tb} {b[tb]:.3f} (cpu {a.get(tb, float('nan')):.3f})", flush=True)
    print(f"{name}: worst top-token logprob gap {worst:.3f}", flush=True)
