"""Experiment (CPU): fp8 with SmoothQuant's migration before the per-token activation
rounding (``--activation-scheme smooth``, strength ``--sq-alpha``) against the default
per-token fp8 build, on the embedded SmolLM2-135M as the quality table measures it: each
build's own gate scores it against the unquantized model on 16,352 held-out tokens
(``quality_tokens`` 16,384), GPTQ weights from 16,384 calibration tokens, two threads.

Usage: ``PYTHONPATH=. python scripts/experiments/fp8_smooth_quality.py OUT.json
[ALPHA,...]`` (default 0.5; "default" in the list adds the plain per-token build)."""

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kiln.build.builder import build_engine
from kiln.checkpoint import default_model_path
from kiln.config import BuildConfig, QuantConfig


def main() -> None:
    torch.set_num_threads(2)
    which = sys.argv[2].split(",") if len(sys.argv) > 2 else ["0.5"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()  # fmt: skip
    rows = []
    src = str(default_model_path())
    with tempfile.TemporaryDirectory() as d:
        for w in which:
            q = {} if w == "default" else {"activation_scheme": "smooth", "sq_alpha": float(w)}
            t0 = time.perf_counter()
            cfg = BuildConfig(device="cpu", quant=QuantConfig(algo="fp8", quality_tokens=16384,
                                                              **q))  # fmt: skip
            m = build_engine(src, Path(d) / str(len(rows)), cfg, progress=False)
            rows.append({"build": w, "quant_fields": q, "build_s": round(time.perf_counter() - t0),
                         **m["quant"]["quality"]})  # fmt: skip
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "costliest_modules"}),
                  flush=True)  # fmt: skip
    out = {"note": __doc__.split("\n\n")[0], "commit": commit, "torch": torch.__version__,
           "threads": 2, "rows": rows}  # fmt: skip
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
