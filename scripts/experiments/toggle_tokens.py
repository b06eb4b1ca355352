"""Experiment (GPU): an engine's greedy tokens with a module-level switch of kiln on and off
(e.g. ``kiln.kernels.wq_rope ENABLED``: the qkv projection with rotary in its epilogue,
against the projection and the rotary kernel), for three prompts of 17, 128 and 300
tokens, 64 new tokens each. Identical tokens say the two paths agree through a whole model;
a difference is reported with the first step where it occurs.

Usage: ``python scripts/experiments/toggle_tokens.py MODULE NAME ENGINE_DIR OUT.json``"""

import importlib
import json
import sys
from pathlib import Path

import torch

from kiln.llm import LLM
from kiln.sampling_params import SamplingParams


def main() -> None:
    mod, name, engine, out = sys.argv[1:5]
    module = importlib.import_module(mod)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (n,), generator=g).tolist() for n in (17, 128, 300)]
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
    tokens = {}
    for on in (False, True):
        setattr(module, name, on)
        llm = LLM(engine)
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[on] = [o.outputs[0].token_ids for o in outs]
        del llm
        torch.cuda.empty_cache()
    first = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
             for x, y in zip(tokens[False], tokens[True], strict=True)]  # fmt: skip
    same = tokens[True] == tokens[False]
    print(f"{mod}.{name}: same tokens {same}; first difference per prompt {first}", flush=True)
    report = {"switch": f"{mod}.{name}", "same_tokens": same, "first_difference": first,
              "tokens": {str(k): v for k, v in tokens.items()}}  # fmt: skip
    Path(out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
