"""Experiment (CPU): fp8 "block" on SmolLM2-135M with each group's activation scale
searched (the per-token ``--act-scale-search`` applied to every 128-channel group, scored
on the group's four largest magnitudes): the block engine built by
``kiln build --quant fp8 --activation-scheme block --quality-tokens 16384`` (/tmp/fb/block)
with every projection's ``act_search`` set to N (the weights do not change), scored like
the build's quality gate (16,352 held-out tokens) through the engine's reference
quantizers, against the unquantized float32 engine (/tmp/fx/eng-f32).

Usage: ``PYTHONPATH=. python scripts/experiments/fp8_block_search.py OUT.json 0,4,8,16``."""

import json
import sys
import time
from pathlib import Path

import torch

from kiln.build.loader import load_engine
from kiln.quant.calib import default_corpus, split_corpus
from kiln.quant.layers import QuantLinear
from kiln.quant.quality import compare
from kiln.tokenizer import load_tokenizer

torch.set_num_threads(2)
EB, E0 = Path("/tmp/fb/block"), Path("/tmp/fx/eng-f32")
ref, test = load_engine(E0, "cpu"), load_engine(EB, "cpu")
tok = load_tokenizer(E0, json.loads((E0 / "manifest.json").read_text()))
ids = tok.encode(split_corpus(default_corpus())[1], add_special_tokens=False)[:16384]
rows = []
for n in [int(v) for v in sys.argv[2].split(",")]:
    for q in test.model.modules():
        if isinstance(q, QuantLinear):
            q.act_search = n  # set past the constructor's checks: an experiment
    t = time.time()
    r = compare(ref, test, ids, max_tokens=len(ids)).to_dict()
    keys = ("ppl_increase_pct", "ppl_increase_ci95", "mean_kl", "top1_agreement")
    rows.append({"group_search": n, "s": round(time.time() - t, 1), **{k: r[k] for k in keys}})
    print(rows[-1], flush=True)
    Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))
