"""Experiment (CPU): where fp8 activation rounding loses, on SmolLM2-135M's projection
inputs (512 held-out tokens through the unquantized float32 engine built by
``fp8_act_groups.py``). Per kind of projection: the relative error of the rounded inputs
with one scale per token, per token and group of 64 channels, and per token with the
row's K / 64 largest values left exact; and the share of values below e4m3's smallest
normal number (2^-6 in the scale's units) with either scale.

Usage: ``PYTHONPATH=. python scripts/experiments/fp8_act_error_sources.py OUT.json``."""

import json
import sys
from pathlib import Path

from kiln.build.loader import load_engine
from kiln.kernels.quant_act import quantize_rows_ref
from kiln.layers.linear import Linear
from kiln.quant.calib import default_corpus, split_corpus
from kiln.tokenizer import load_tokenizer
from tests.util import prefill_logits

E0 = Path("/tmp/fx/eng-f32")
G = 64


def main() -> None:
    eng = load_engine(E0, "cpu")
    tok = load_tokenizer(E0, json.loads((E0 / "manifest.json").read_text()))
    ids = tok.encode(split_corpus(default_corpus())[1], add_special_tokens=False)[:512]
    acc: dict[str, dict[str, float]] = {}

    def hook(name: str):
        kind = name.split(".", 2)[2]

        def f(_mod, args):
            x = args[0].float()
            a = acc.setdefault(kind, {})
            a["x2"] = a.get("x2", 0.0) + float(x.pow(2).sum())
            a["n"] = a.get("n", 0) + x.numel()
            for label, g in (("token", None), (f"group{G}", G)):
                q, s = quantize_rows_ref(x, "fp8", group=g)
                sx = s if g is None else s.repeat_interleave(g, 1)
                err = q.float() * sx - x
                a[label] = a.get(label, 0.0) + float(err.pow(2).sum())
                sub = ((x / sx).abs() < 2**-6) & (x != 0)
                a[label + "_subnormal"] = a.get(label + "_subnormal", 0) + int(sub.sum())
                if g is None:  # the same per-token rounding, the k largest values exact
                    top = x.abs().topk(x.shape[1] // G, dim=1).indices
                    a["token_top_exact"] = a.get("token_top_exact", 0.0) + float(
                        err.scatter(1, top, 0.0).pow(2).sum()
                    )

        return f

    for n, m in eng.model.named_modules():
        if isinstance(m, Linear) and n.startswith("layers."):
            m.register_forward_pre_hook(hook(n))
    prefill_logits(eng, ids)
    out = {}
    for kind, a in sorted(acc.items()):
        out[kind] = {
            "rel_err_per_token": (a["token"] / a["x2"]) ** 0.5,
            f"rel_err_group{G}": (a[f"group{G}"] / a["x2"]) ** 0.5,
            "rel_err_per_token_top_k_exact": (a["token_top_exact"] / a["x2"]) ** 0.5,
            "subnormal_share_per_token": a["token_subnormal"] / a["n"],
            f"subnormal_share_group{G}": a[f"group{G}_subnormal"] / a["n"],
        }
        print(kind, {k: round(v, 4) for k, v in out[kind].items()}, flush=True)
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
