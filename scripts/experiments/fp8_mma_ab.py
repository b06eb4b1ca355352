"""Experiment (H200): the tensor-core fp8 kernel (``kiln.kernels.fp8_mma``) against the
fp8 skinny kernel and ``torch._scaled_mm`` at one and four rows, per Llama-3.1-8B fp8
projection shape, as the build's tuner times them (``gemv_bench.tune_fp8_skinny``: each
candidate checked against the reference first); then a copy of a carried fp8 engine with
its ``fp8_skinny`` picks replaced by this tuning's, for a same-visit latency A/B.

Usage: ``PYTHONPATH=. python scripts/experiments/fp8_mma_ab.py OUT.json ENGINE NEW_ENGINE``"""

import copy
import hashlib
import json
import os
import shutil
import sys

from kiln.bench.gemv_bench import tune_fp8_skinny
from kiln.build.tuning import FP8_TUNE_ROWS

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    out, src, dst = sys.argv[1:4]
    res = {"note": __doc__.split("\n\n")[0], "shapes": []}
    by_shape: dict = {}
    for name, (n, k) in SHAPES.items():
        for m in FP8_TUNE_ROWS:
            rows, mm_ms = tune_fp8_skinny(n, k, m)
            ok = [r for r in rows if "ms" in r]
            mma = [r for r in ok if r["config"].get("MMA")]
            skinny = [r for r in ok if not r["config"].get("MMA")]
            row = {"shape": name, "n": n, "k": k, "m": m, "scaled_mm_us": mm_ms * 1e3,
                   "mma_best": mma[:3], "skinny_best": skinny[:3],
                   "errors": [r for r in rows if "error" in r]}  # fmt: skip
            res["shapes"].append(row)
            best = ok[0] if ok and ok[0]["ms"] < mm_ms else None
            by_shape.setdefault(f"{n}x{k}", {})[str(m)] = (
                best["config"] if best else {"scaled_mm": True}
            )
            print(name, m, f"scaled_mm {mm_ms * 1e3:.2f} us",
                  f"mma {mma[0]['ms'] * 1e3:.2f} {mma[0]['config']}" if mma else "mma none",
                  f"skinny {skinny[0]['ms'] * 1e3:.2f}" if skinny else "skinny none",
                  f"errors {len(row['errors'])}", flush=True)  # fmt: skip
    res["by_shape"] = by_shape
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    with open(os.path.join(src, "tuning.json")) as f:
        tuning = json.load(f)
    tuning = copy.deepcopy(tuning)
    tuning["kernels"]["fp8_skinny"] = {"by_shape": by_shape}
    blob = json.dumps(tuning, indent=1).encode()
    with open(os.path.join(dst, "tuning.json"), "wb") as f:
        f.write(blob)
    with open(os.path.join(src, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["files"]["tuning.json"] = {"sha256": hashlib.sha256(blob).hexdigest(),
                                        "size": len(blob)}  # fmt: skip
    with open(os.path.join(dst, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)


if __name__ == "__main__":
    main()
