"""Experiment (CPU): fp8 activation-rounding variants on SmolLM2-135M, scored like the
build's quality gate (16,384 held-out tokens, windows of 512, against the unquantized
float32 engine), on one default fp8 build (GPTQ weights, per-token activations) whose
projections' activation rounding is replaced (cf. fp8_act_groups.py):

- ``base``: per token, as the engine;
- ``gG``: one scale per token and group of G input channels (the last group ragged);
- ``ssN``: per token, the scale chosen among ``amax / 448 * 2**(j / N)`` by least squared
  rounding error (float sums); ``linN``: among ``amax / 448 * (1 + j / N)`` (the engine's
  ``--act-scale-search`` candidates, here with float sums and exact quotients);
- ``gGssN``: both; a ``w`` prefix (``wlinN``): the squared errors weighted by the
  squared norm of the weight's input column (the projection's output error, to first
  order); a ``tT`` prefix (``t4lin8``): the errors of each token's T largest values only.

Usage: ``PYTHONPATH=. python scripts/experiments/fp8_scale_search.py OUT.json base,g128,...``
(engines are built under /tmp/fx on the first run; fp8_search_sweep.py reuses them)."""

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.build.builder import build_engine
from kiln.build.loader import load_engine
from kiln.checkpoint.default_model import default_model_path
from kiln.config import BuildConfig, QuantConfig
from kiln.quant import layers as ql
from kiln.quant.calib import default_corpus, split_corpus
from kiln.quant.formats import dequantize_rows
from kiln.quant.passes import fuse_activation_quant
from kiln.quant.quality import compare
from kiln.tokenizer import load_tokenizer

torch.set_num_threads(2)
OUT, VARIANTS = sys.argv[1], sys.argv[2].split(",")
E8, E0 = Path("/tmp/fx/eng-fp8"), Path("/tmp/fx/eng-f32")
src = str(default_model_path())
if not (E0 / "manifest.json").exists():
    build_engine(src, E0, BuildConfig(device="cpu"), progress=False)
if not (E8 / "manifest.json").exists():
    t = time.time()
    qcfg = QuantConfig(algo="fp8", quality_tokens=16384)
    build_engine(src, E8, BuildConfig(device="cpu", quant=qcfg), progress=False)
    print("build s", time.time() - t, flush=True)
ref, test = load_engine(E0, "cpu"), load_engine(E8, "cpu")
fuse_activation_quant(test.model, enable=False)
q = json.loads((E8 / "manifest.json").read_text())["quant"]
gate = {k: q["quality"][k] for k in ("ppl_increase_pct", "mean_kl", "top1_agreement")}
print("gate", gate, flush=True)
tok = load_tokenizer(E0, json.loads((E0 / "manifest.json").read_text()))
ids = tok.encode(split_corpus(default_corpus())[1], add_special_tokens=False)[:16384]
E4M3 = torch.float8_e4m3fn


def parse(v: str) -> tuple[int | None, int, bool, bool]:
    """(group, candidates, linear candidates, weighted errors) of a variant's name (a
    ``tT`` prefix is read by ``top``)."""
    if v.startswith("t"):
        v = v[1:].lstrip("0123456789")
    weighted = v.startswith("w")
    v = v.removeprefix("w")
    lin = v.startswith("lin")
    v = v.replace("lin", "ss")
    g, n = None, 0
    if v.startswith("g"):
        a, _, b = v[1:].partition("ss")
        g, n = int(a), int(b or 0)
    elif v.startswith("ss"):
        n = int(v[2:])
    return g, n, lin, weighted


def top(v: str) -> int:
    """T of a ``tT`` prefix (0: every value counts)."""
    if not v.startswith("t"):
        return 0
    digits = v[1:][: len(v[1:]) - len(v[1:].lstrip("0123456789"))]
    return int(digits)


def rounded(x: torch.Tensor, v: str, colw: torch.Tensor | None) -> torch.Tensor:
    group, n, lin, _ = parse(v)
    t = top(v)
    xf = x.float()
    m, k = xf.shape
    xf = F.pad(xf, (0, (-k) % group)).reshape(m, -1, group) if group else xf.reshape(m, 1, k)
    w = 1.0
    if colw is not None:
        w = F.pad(colw, (0, (-k) % group)).reshape(1, -1, group) if group else colw
    s0 = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    if t:  # only the T largest values of each token (group) count
        kth = xf.abs().topk(min(t, xf.shape[-1]), dim=-1).values[..., -1:]
        w = w * (xf.abs() >= kth).float()
    best, best_err = None, None
    for j in range(max(n, 1)):
        s = s0 * ((1.0 + j / n) if lin else 2.0 ** (j / n)) if n else s0
        d = (xf / s).clamp(-448, 448).to(E4M3).float() * s
        err = ((d - xf).square() * w).sum(-1, keepdim=True)
        if best is None:
            best, best_err = d, err
        else:
            better = err < best_err
            best, best_err = torch.where(better, d, best), torch.minimum(err, best_err)
    return best.reshape(m, -1)[:, :k]


orig = ql.QuantLinear.forward
STATE: dict[str, str] = {}


def fwd(self: ql.QuantLinear, x: torch.Tensor, partials: bool = False) -> torch.Tensor:
    v = STATE["v"]
    if self.algo != "fp8" or v == "base":
        return orig(self, x, partials)
    w = dequantize_rows(self.weight, self.weight_scale)
    colw = None
    if parse(v)[3]:
        colw = w.square().sum(0)
        colw = colw / colw.mean()
    y = F.linear(rounded(x, v, colw), w)
    return (y if self.bias is None else y + self.bias.float()).to(x.dtype)


ql.QuantLinear.forward = fwd
rows = []
for v in VARIANTS:
    STATE["v"] = v
    t = time.time()
    r = compare(ref, test, ids, max_tokens=len(ids)).to_dict()
    keys = ("ppl_increase_pct", "ppl_increase_ci95", "mean_kl", "top1_agreement")
    rows.append({"variant": v, "s": round(time.time() - t, 1), **{k: r[k] for k in keys}})
    print(rows[-1], flush=True)
    Path(OUT).write_text(json.dumps({"gate": gate, "rows": rows}, indent=1))
