"""The quality table of issue 7: every quantization mode built from the embedded SmolLM2-135M
on the CPU; each build's own quality gate scores it against the unquantized model on the
held-out half of the default corpus. Writes JSON (argv[1]) and prints a markdown table.
int4 round-to-nearest is int4-awq with the AWQ search and GPTQ switched off, for comparison."""

import json
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from kiln.build.builder import build_engine
from kiln.checkpoint import default_model_path
from kiln.config import BuildConfig, QuantConfig
from kiln.quant import build as qbuild

TOKENS = 2048
MODES = [
    ("fp8 (dynamic per-token activations)", dict(algo="fp8")),
    ("fp8 (static per-tensor activations)", dict(algo="fp8", activation_scheme="static")),
    ("int8-wo", dict(algo="int8-wo")),
    ("w8a8-sq (alpha 0.5)", dict(algo="w8a8-sq")),
    ("int4-awq (group 64)", dict(algo="int4-awq", group_size=64)),
    ("int4 round-to-nearest (group 64)", dict(algo="int4-awq", group_size=64, rtn=True)),
    ("fp8 KV cache only (Hadamard-rotated keys)", dict(kv_cache_dtype="fp8")),
    ("fp8, attn.o excluded", dict(algo="fp8", exclude_modules=("*.attn.o",))),
    ("fp8 KV cache only, no rotation", dict(kv_cache_dtype="fp8", kv_rotation="none")),
]
if len(sys.argv) > 2:  # only the listed rows, e.g. "6,7"
    MODES = [MODES[int(i)] for i in sys.argv[2].split(",")]

rows = []
src = str(default_model_path())
with tempfile.TemporaryDirectory() as d:
    for label, q in MODES:
        rtn = q.pop("rtn", False)
        t0 = time.perf_counter()
        cfg = BuildConfig(device="cpu", quant=QuantConfig(quality_tokens=TOKENS, **q))
        no_awq = mock.patch.object(qbuild, "algorithm_input_scales", lambda *a: None)
        no_gptq = mock.patch.object(qbuild, "gptq_weights", lambda *a: None)
        with no_awq if rtn else mock.MagicMock(), no_gptq if rtn else mock.MagicMock():
            m = build_engine(src, Path(d) / str(len(rows)), cfg, progress=False)
        qual = m["quant"]["quality"]
        size = sum(v["size"] for k, v in m["files"].items() if k.endswith(".safetensors"))
        rows.append({"mode": label, **q, "rtn": rtn, "engine_bytes": size,
                     "build_s": round(time.perf_counter() - t0, 1), **qual})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    base = build_engine(src, Path(d) / "bf", BuildConfig(device="cpu"), progress=False)
    base_size = sum(v["size"] for k, v in base["files"].items() if k.endswith(".safetensors"))
out = {"model": "SmolLM2-135M-Instruct (embedded GGUF), float32 engine, CPU",
       "held_out_tokens": TOKENS, "unquantized_engine_bytes": base_size, "rows": rows}  # fmt: skip
Path(sys.argv[1]).write_text(json.dumps(out, indent=1) + "\n")
print("| mode | perplexity increase | top-1 agreement | mean KL | engine size |")
print("| --- | --- | --- | --- | --- |")
for r in rows:
    print(f"| {r['mode']} | {r['ppl_increase_pct']:+.2f} % | {r['top1_agreement']:.3f} | "
          f"{r['mean_kl']:.4f} | {r['engine_bytes'] / base_size:.2f}x |")  # fmt: skip
