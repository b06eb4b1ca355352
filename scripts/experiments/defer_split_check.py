"""Experiment (H200): an engine's greedy tokens with the split-K sums left to the consuming
kernels (``kiln.kernels.partials``, the default) and without (``KILN_DEFER_SPLIT=0``): the
results are meant to be the same bits, so the tokens must be the same.

Usage: ``python scripts/experiments/defer_split_check.py ENGINE_DIR OUT.json``"""

import json
import sys
from pathlib import Path

import torch

from kiln.kernels import partials
from kiln.llm import LLM
from kiln.sampling_params import SamplingParams


def main() -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (n,), generator=g).tolist() for n in (17, 128, 300)]
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
    tokens = {}
    for on in (False, True):
        partials.ENABLED = on
        llm = LLM(sys.argv[1])
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[on] = [o.outputs[0].token_ids for o in outs]
        steps = llm.core.runner.graph_steps
        del llm
        torch.cuda.empty_cache()
        print("deferred" if on else "reduced", "graph steps", steps, flush=True)
    same = tokens[True] == tokens[False]
    print("same tokens:", same, flush=True)
    Path(sys.argv[2]).write_text(
        json.dumps(
            {"same_tokens": same, "tokens": {str(k): v for k, v in tokens.items()}}, indent=1
        )
    )
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
