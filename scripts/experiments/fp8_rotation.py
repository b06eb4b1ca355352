"""Experiment (CPU): does an orthogonal rotation of each projection's input (QuaRot /
SpinQuant's incoherence processing: y = (x R)(W R)^T, R orthogonal) lower the loss of fp8's
per-token activation rounding on SmolLM2-135M? The float32 reference engine
(/tmp/fx/eng-f32, a `kiln build` of the embedded model) against a copy whose every layer
projection computes Q(x R) (W R)^T: x R rounded to e4m3 with one scale per token, R a
random orthogonal matrix per projection (QR of a Gaussian, seed 0) or the identity, W
unquantized ("act") or also rounded per output channel ("both"). Scored like the build's
quality gate (16,352 held-out tokens).

Usage: ``PYTHONPATH=. python scripts/experiments/fp8_rotation.py OUT.json [R:Q ...]``, R one of
none, rot and Q one of act, both (default: none:act rot:act)."""

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kiln.build.loader import load_engine
from kiln.quant import formats as qf
from kiln.quant.calib import default_corpus, split_corpus
from kiln.quant.quality import compare
from kiln.tokenizer import load_tokenizer

torch.set_num_threads(2)
E0 = Path("/tmp/fx/eng-f32")
ref = load_engine(E0, "cpu")
tok = load_tokenizer(E0, json.loads((E0 / "manifest.json").read_text()))
ids = tok.encode(split_corpus(default_corpus())[1], add_special_tokens=False)[:16384]


def per_token(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    s = qf._row_scale(rows, qf.FP8_MAX)
    return (qf.quantize_fp8(rows, s).float() * s).reshape(x.shape)


def orthogonal(k: int, g: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(k, k, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


class Rotated(nn.Module):
    def __init__(self, lin: nn.Module, rot: torch.Tensor | None, weights: bool) -> None:
        super().__init__()
        w = lin.weight.detach().float()
        self.rot = rot
        w = w if rot is None else w @ rot
        if weights:
            q, s = qf.quantize_fp8_weight(w)
            w = q.float() * s[:, None]
        self.w = w
        self.b = None if lin.bias is None else lin.bias.detach().float()

    def forward(self, x: torch.Tensor, partials: bool = False) -> torch.Tensor:
        x = x.float() if self.rot is None else x.float() @ self.rot
        return F.linear(per_token(x), self.w, self.b)


rows = []
for rotation, quantized in (a.split(":") for a in sys.argv[2:] or ["none:act", "rot:act"]):
    test = load_engine(E0, "cpu")
    g = torch.Generator().manual_seed(0)
    for n, m in list(test.model.named_modules()):
        if n.startswith("layers.") and type(m).__name__ == "Linear":
            rot = orthogonal(m.weight.shape[1], g) if rotation == "rot" else None
            parent, _, attr = n.rpartition(".")
            setattr(test.model.get_submodule(parent), attr, Rotated(m, rot, quantized == "both"))
    t = time.time()
    r = compare(ref, test, ids, max_tokens=len(ids)).to_dict()
    keys = ("ppl_increase_pct", "ppl_increase_ci95", "mean_kl", "top1_agreement")
    rows.append({"rotation": rotation, "quantized": quantized, "s": round(time.time() - t, 1),
                 **{k: r[k] for k in keys}})  # fmt: skip
    print(rows[-1], flush=True)
    Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))
