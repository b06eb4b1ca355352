"""Experiment (CPU): fp8 activation-rounding variants on SmolLM2-135M, scored like the
build's quality gate (16,384 held-out tokens of the default corpus, windows of 512, against
the unquantized float32 engine). One fp8 build (the defaults: GPTQ weights, dynamic
per-token activations) is scored with its projections' activation rounding replaced:
``base`` (per token, what the engine does), ``row0`` (per token, the first token of each
window left unrounded: the attention-sink hypothesis), ``g64`` / ``g32`` (one scale per
token and per group of 64 / 32 input channels), ``wonly`` (activations left unrounded),
``outN`` (the N input channels with the largest calibration amax left unrounded, the
rest per token: a bf16 side product).

Usage: ``PYTHONPATH=. python scripts/experiments/fp8_act_groups.py OUT.json base,g64,...``
(engines are built under /tmp/fx on the first run)."""

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
OUT = sys.argv[1]
VARIANTS = sys.argv[2].split(",")
E8, E0 = Path("/tmp/fx/eng-fp8"), Path("/tmp/fx/eng-f32")
src = str(default_model_path())
if not (E0 / "manifest.json").exists():
    build_engine(src, E0, BuildConfig(device="cpu"), progress=False)
if not (E8 / "manifest.json").exists():
    t = time.time()
    build_engine(
        src,
        E8,
        BuildConfig(device="cpu", quant=QuantConfig(algo="fp8", quality_tokens=16384)),
        progress=False,
    )
    print("build s", time.time() - t, flush=True)
ref, test = load_engine(E0, "cpu"), load_engine(E8, "cpu")
print("unfused", fuse_activation_quant(test.model, enable=False), flush=True)
q = json.loads((E8 / "manifest.json").read_text())["quant"]
print(
    "gate",
    {k: q["quality"][k] for k in ("ppl_increase_pct", "mean_kl", "top1_agreement")},
    flush=True,
)

tok = load_tokenizer(E0, json.loads((E0 / "manifest.json").read_text()))
ids = tok.encode(split_corpus(default_corpus())[1], add_special_tokens=False)[:16384]

E4M3 = torch.float8_e4m3fn


def fp8_rows(x, group):  # per-row (group None) or per (row, group) scales, dequantized
    xf = x.float()
    if group:
        xf = xf.reshape(x.shape[0], -1, group)
    s = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    d = (xf / s).clamp(-448, 448).to(E4M3).float() * s
    return d.reshape(x.shape)


orig = ql.QuantLinear.forward
STATE = {}
OUTLIERS: dict[str, torch.Tensor] = {}  # per projection: input channels by calibration amax


def channel_amax() -> None:
    """Max |x| per input channel of every projection over 4,096 calibration tokens (the
    unquantized engine), for the ``outN`` variants."""
    from kiln.layers.linear import Linear
    from tests.util import prefill_logits

    amax: dict[str, torch.Tensor] = {}

    def hook(name):
        def f(_mod, args):
            a = args[0].float().abs().amax(0)
            amax[name] = a if name not in amax else torch.maximum(amax[name], a)

        return f

    hs = [m.register_forward_pre_hook(hook(n)) for n, m in ref.model.named_modules()
          if isinstance(m, Linear) and n.startswith("layers.")]  # fmt: skip
    cal = tok.encode(split_corpus(default_corpus())[0], add_special_tokens=False)[:4096]
    for i in range(0, len(cal), 512):
        prefill_logits(ref, cal[i : i + 512])
    for h in hs:
        h.remove()
    for n, a in amax.items():
        OUTLIERS[n] = a.argsort(descending=True)
    for n, m in test.model.named_modules():
        if isinstance(m, ql.QuantLinear):
            m._xname = n


def fwd(self, x):
    v = STATE["v"]
    if self.algo != "fp8" or v == "base":
        return orig(self, x)
    w = dequantize_rows(self.weight, self.weight_scale)
    if v.startswith("g"):
        xd = fp8_rows(x, int(v[1:]))
    elif v == "row0":  # the first token of each window (one window per prefill) unquantized
        xd = fp8_rows(x, None)
        xd[0] = x[0].float()
    elif v == "wonly":  # weights fp8, activations exact
        xd = x.float()
    elif v.startswith("out"):  # the N channels of largest calibration amax kept exact, the
        # others rounded per token with a scale from them alone
        idx = OUTLIERS[self._xname][: int(v[3:])]
        xo = x.float().clone()
        xo[:, idx] = 0.0
        xd = fp8_rows(xo, None)
        xd[:, idx] = x.float()[:, idx]
    y = F.linear(xd, w)
    if self.bias is not None:
        y = y + self.bias.float()
    return y.to(x.dtype)


ql.QuantLinear.forward = fwd
if any(v.startswith("out") for v in VARIANTS):
    channel_amax()
rows = []
for v in VARIANTS:
    STATE["v"] = v
    t = time.time()
    r = compare(ref, test, ids, max_tokens=len(ids)).to_dict()
    r = {
        "variant": v,
        "s": round(time.time() - t, 1),
        **{k: r[k] for k in ("ppl_increase_pct", "mean_kl", "top1_agreement")},
    }
    print(r, flush=True)
    rows.append(r)
    Path(OUT).write_text(json.dumps(rows, indent=1))
