"""The quality table of issue 7: every quantization mode built from the embedded SmolLM2-135M
on the CPU at today's defaults; each build's own quality gate scores it against the
unquantized model on the held-out half of the default corpus (16,352 tokens, windows of
512, 95 % interval over windows). Writes JSON (argv[1], after every row) and prints a
markdown table. int4 round-to-nearest is int4-awq with the AWQ search and GPTQ switched
off, for comparison. Usage: ``PYTHONPATH=. python scripts/quant_quality_table.py OUT.json
[ROWS]`` (ROWS: indices, e.g. "0,3")."""

import json
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from kiln.build.builder import build_engine
from kiln.checkpoint import default_model_path
from kiln.config import BuildConfig, QuantConfig
from kiln.errors import KilnError
from kiln.quant import build as qbuild

TOKENS = 16384
MODES = [
    ("fp8 (the default: per token, 64 outlier channels a projection in two e4m3 parts)",
     dict(algo="fp8")),
    ("fp8, `--activation-scheme dynamic` (per token)",
     dict(algo="fp8", activation_scheme="dynamic")),
    ("fp8 (static per-tensor activations)", dict(algo="fp8", activation_scheme="static")),
    ("fp8, `--activation-scheme dynamic --act-scale-search 4`",
     dict(algo="fp8", activation_scheme="dynamic", act_scale_search=4)),
    ("fp8, `--act-outliers 32`", dict(algo="fp8", act_outliers=32)),
    ("fp8, `--activation-scheme block`", dict(algo="fp8", activation_scheme="block")),
    ("fp8, `--activation-scheme dynamic --max-quality-loss 1 --auto-exclude 4`",
     dict(algo="fp8", activation_scheme="dynamic", max_quality_loss=1.0, auto_exclude=4)),
    ("fp8, `--activation-scheme dynamic --max-quality-loss 1 --auto-exclude 8`",
     dict(algo="fp8", activation_scheme="dynamic", max_quality_loss=1.0, auto_exclude=8)),
    ("fp8 KV cache only (Hadamard-rotated keys)", dict(kv_cache_dtype="fp8")),
    ("int8-wo", dict(algo="int8-wo")),
    ("w8a8-sq (alpha 0.5)", dict(algo="w8a8-sq")),
    ("int4-awq (group 64)", dict(algo="int4-awq", group_size=64)),
    ("int4 round-to-nearest (group 64)", dict(algo="int4-awq", group_size=64, rtn=True)),
]  # fmt: skip
if len(sys.argv) > 2:  # only the listed rows, e.g. "6,7"
    MODES = [MODES[int(i)] for i in sys.argv[2].split(",")]

rows = []
src = str(default_model_path())
out = {"model": "SmolLM2-135M-Instruct (embedded GGUF), float32 engine, CPU",
       "quality_tokens": TOKENS, "rows": rows}  # fmt: skip
with tempfile.TemporaryDirectory() as d:
    base = build_engine(src, Path(d) / "bf", BuildConfig(device="cpu"), progress=False)
    base_size = sum(v["size"] for k, v in base["files"].items() if k.endswith(".safetensors"))
    out["unquantized_engine_bytes"] = base_size
    for label, q in MODES:
        rtn = q.pop("rtn", False)
        t0 = time.perf_counter()
        cfg = BuildConfig(device="cpu", quant=QuantConfig(quality_tokens=TOKENS, **q))
        no_awq = mock.patch.object(qbuild, "algorithm_input_scales", lambda *a: None)
        no_gptq = mock.patch.object(qbuild, "gptq_weights", lambda *a: None)
        try:
            with no_awq if rtn else mock.MagicMock(), no_gptq if rtn else mock.MagicMock():
                m = build_engine(src, Path(d) / str(len(rows)), cfg, progress=False)
        except KilnError as e:  # a gate that refused (--max-quality-loss): its message
            rows.append({"mode": label, **q, "refused": str(e)})
            print(json.dumps(rows[-1]), flush=True)
            continue
        qual = m["quant"]["quality"]
        size = sum(v["size"] for k, v in m["files"].items() if k.endswith(".safetensors"))
        kept = [k["module"] for k in m["quant"].get("auto_excluded", [])]
        rows.append({"mode": label, **q, "rtn": rtn, "engine_bytes": size, "auto_excluded": kept,
                     "build_s": round(time.perf_counter() - t0, 1), **qual})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        Path(sys.argv[1]).write_text(json.dumps(out, indent=1) + "\n")
print("| mode | perplexity increase (95 % interval) | top-1 agreement | mean KL | engine size |")
print("| --- | --- | --- | --- | --- |")
for r in rows:
    if "refused" in r:
        print(f"| {r['mode']} | refused: {r['refused']} | | | |")
        continue
    lo, hi = r["ppl_increase_ci95"]
    size = r["engine_bytes"] / out["unquantized_engine_bytes"]
    print(f"| {r['mode']} | {r['ppl_increase_pct']:+.2f} % ({lo:+.2f} to {hi:+.2f}) | "
          f"{r['top1_agreement']:.3f} | {r['mean_kl']:.4f} | {size:.2f}x |")  # fmt: skip
