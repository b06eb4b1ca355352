"""Experiment (CPU): the engine's fp8 ``--act-scale-search`` at N candidates on SmolLM2-135M:
the default fp8 engine built by fp8_scale_search.py (/tmp/fx) with every projection's
``act_search`` set to N, which is what a build with the option makes (GPTQ rounds the
weights from unquantized inputs, so the search leaves them as they are), scored like the
build's quality gate (16,384 held-out tokens) through the engine's own quantizers.

Usage: ``PYTHONPATH=. python scripts/experiments/fp8_search_sweep.py OUT.json 4,8,2,16
[ENGINE]``. ENGINE (default /tmp/fx/eng-fp8): another fp8 engine, e.g. the fp8 "block" one
of ``kiln build --quant fp8 --activation-scheme block --quality-tokens 16384`` (each
128-channel group's scale is then searched: 2026-12-05)."""

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
E8 = Path(sys.argv[3] if len(sys.argv) > 3 else "/tmp/fx/eng-fp8")
E0 = Path("/tmp/fx/eng-f32")
ref, test = load_engine(E0, "cpu"), load_engine(E8, "cpu")
tok = load_tokenizer(E0, json.loads((E0 / "manifest.json").read_text()))
ids = tok.encode(split_corpus(default_corpus())[1], add_special_tokens=False)[:16384]
rows = []
for n in [int(v) for v in sys.argv[2].split(",")]:
    for q in test.model.modules():
        if isinstance(q, QuantLinear):
            q.act_search = n  # set past the constructor's checks (block: per group)
    t = time.time()
    r = compare(ref, test, ids, max_tokens=len(ids)).to_dict()
    keys = ("ppl_increase_pct", "ppl_increase_ci95", "mean_kl", "top1_agreement")
    rows.append({"act_scale_search": n, "s": round(time.time() - t, 1), **{k: r[k] for k in keys}})
    print(rows[-1], flush=True)
    Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))
