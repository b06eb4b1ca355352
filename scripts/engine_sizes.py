"""Engine size per quantization mode for a model's shapes, without weights: the model is
built on the "meta" device, every projection swapped for the mode's QuantLinear shell, and
the bytes of the state the engine file stores are summed (the safetensors header, a few
KiB, is not counted). Usage: python scripts/engine_sizes.py dummy:llama-3.1-8b out.json"""

import json
import sys

import torch

from kiln.checkpoint.dummy import DummyCheckpoint
from kiln.config import QuantConfig
from kiln.models import build_model
from kiln.quant.passes import quant_shells

MODES = {
    "bf16": None,
    "fp8 (the default: outliers, 64 channels)": dict(algo="fp8"),
    "fp8 (dynamic, per token)": dict(algo="fp8", activation_scheme="dynamic"),
    "int8-wo": dict(algo="int8-wo"),
    "w8a8-sq": dict(algo="w8a8-sq"),
    "int4-awq (g128)": dict(algo="int4-awq", group_size=128),
    "int4-awq (g128) + lm_head": dict(algo="int4-awq", group_size=128, quantize_lm_head=True),
    "fp8 (outliers, 32)": dict(algo="fp8", act_outliers=32),
}
cfg = DummyCheckpoint.from_source(sys.argv[1]).config
rows = {}
for name, q in MODES.items():
    model = build_model(cfg, torch.bfloat16, "meta")
    if q:
        quant_shells(model, QuantConfig(**q))
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    rows[name] = {"bytes": nbytes, "GiB": round(nbytes / 2**30, 2)}
base = rows["bf16"]["bytes"]
for r in rows.values():
    r["vs_bf16"] = round(r["bytes"] / base, 3)
print(json.dumps(rows, indent=1))
with open(sys.argv[2], "w") as f:
    json.dump({"model": sys.argv[1], "method": __doc__.split("\n")[0], "modes": rows}, f, indent=1)
