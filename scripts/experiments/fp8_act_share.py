"""Experiment (CPU): the share of fp8's loss on SmolLM2-135M that is the activations'
rounding alone: a default fp8 engine (/tmp/fx/eng-fp8, per-token scales) and an fp8
"block" one (/tmp/fb/block) whose products use the unquantized float32 weights (the
reference engine's, /tmp/fx/eng-f32) with the engine's own activation rounding, scored
like the build's quality gate (16,352 held-out tokens). (The other way round, fp8
weights with unrounded activations, measured +0.30 % on 2026-12-01.)

Usage: ``PYTHONPATH=. python scripts/experiments/fp8_act_share.py OUT.json``."""

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.build.loader import load_engine
from kiln.quant import formats as qf
from kiln.quant.calib import default_corpus, split_corpus
from kiln.quant.layers import QuantLinear
from kiln.quant.quality import compare
from kiln.tokenizer import load_tokenizer

torch.set_num_threads(2)
E0 = Path("/tmp/fx/eng-f32")
ref = load_engine(E0, "cpu")
tok = load_tokenizer(E0, json.loads((E0 / "manifest.json").read_text()))
ids = tok.encode(split_corpus(default_corpus())[1], add_special_tokens=False)[:16384]
floats = {n: m.weight for n, m in ref.model.named_modules() if hasattr(m, "weight")}
exact = qf.act_matmul_ref
rows = []
for name, path in (("per-token", "/tmp/fx/eng-fp8"), ("block", "/tmp/fb/block")):
    test = load_engine(Path(path), "cpu")
    by_weight = {}
    for n, m in test.model.named_modules():
        if isinstance(m, QuantLinear):
            by_weight[id(m.weight)] = floats[n].float()

    def float_weights(a, w, w_scale, bias, out_dtype):  # the activations' rounding only
        k = a.q.shape[1]
        x = a.q.float() * qf.expand_groups(a.scale, k, qf.FP8_BLOCK)
        y = F.linear(x, by_weight[id(w)])
        return (y if bias is None else y + bias.float()).to(out_dtype)

    qf.act_matmul_ref = float_weights
    t = time.time()
    r = compare(ref, test, ids, max_tokens=len(ids)).to_dict()
    qf.act_matmul_ref = exact
    keys = ("ppl_increase_pct", "ppl_increase_ci95", "mean_kl", "top1_agreement")
    rows.append({"engine": name, "weights": "unquantized (float32)", "s": round(time.time() - t, 1),
                 **{k: r[k] for k in keys}})  # fmt: skip
    print(rows[-1], flush=True)
    Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))
