"""Diagnostic: prefill logits of each quantized mode against the unquantized engine, on the
device given (argv[1]), for a random Llama checkpoint; prints relative errors and top-1
agreement. Usage: python scripts/quant_gpu_diag.py cuda|cpu"""
import sys
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kiln import LLM, SamplingParams
from kiln.config import QuantConfig

dev = sys.argv[1]
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, initializer_range=0.08,
                  architectures=["LlamaForCausalLM"])  # fmt: skip
path = tempfile.mkdtemp()
LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
prompts = [list(range(7 + 13 * i, 7 + 13 * i + n)) for i, n in enumerate([3, 17, 64, 100])]
sp = SamplingParams(max_tokens=1, temperature=0, logprobs=20)
kw = dict(device=dev, dtype="bfloat16" if dev == "cuda" else "float32", progress=False,
          enforce_eager=True, max_seq_len=512)  # fmt: skip
def lp(q):
    llm = LLM(path, quant=q, **kw)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [(o.outputs[0].token_ids[0], {t: v.logprob for t, v in o.outputs[0].logprobs[0].items()}) for o in outs]
base = lp(None)
for algo in ("fp8", "int8-wo", "w8a8-sq", "int4-awq"):
    got = lp(QuantConfig(algo=algo, group_size=64 if algo == "int4-awq" else None))
    agree = sum(a[0] == b[0] for a, b in zip(base, got))
    d = [max(abs(a[1][t] - b[1].get(t, -99)) for t in list(a[1])[:5]) for a, b in zip(base, got)]
    print(algo, "top1 agree", agree, "/4; max |dlogprob| of base top5:", [round(x, 3) for x in d], flush=True)
