"""Experiment (GPU): the weight-only tuning of an int4-awq + int4 head Llama-3.1-8B build
(``kiln.build.tuning._tune_weight_only``, the build's longest phase: 163 of 226 s of
tuning on the H200 at 6aa05cc) on an empty Triton cache, with the candidates' variants
compiled one by one as first called (``KILN_COMPILE_WORKERS=0``) or all at once in
threads first (``kiln.runtime.kernel_record.precompile``, the default). Run it once per
setting, each in a fresh process.

Usage: ``PYTHONPATH=. [KILN_COMPILE_WORKERS=0] python scripts/experiments/precompile_wo.py
OUT.json``."""

import json
import os
import sys
import tempfile
import time

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # an empty cache: before Triton loads

from kiln.build.tuning import _tune_weight_only
from kiln.checkpoint.dummy import DummyCheckpoint
from kiln.config import QuantConfig
from kiln.runtime.kernel_record import compile_workers


def main(path: str) -> None:
    cfg = DummyCheckpoint.from_source("dummy:llama-3.1-8b").config
    quant = QuantConfig(algo="int4-awq", group_size=128, quantize_lm_head=True)
    start = time.perf_counter()
    picks, measured = _tune_weight_only(cfg, quant)
    seconds = time.perf_counter() - start
    out = {"compile_workers": compile_workers(), "seconds": round(seconds, 2),
           "precompile": measured.get("precompile"), "picks": picks}  # fmt: skip
    print(json.dumps({k: out[k] for k in ("compile_workers", "seconds")}), flush=True)
    print("precompile", out["precompile"], flush=True)  # one batch for every shape
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
