"""Engine copies of an int4 engine whose one-row float16-code picks for gate_up and down
are the tuner's second or third candidate (each copy changes one shape), so that a visit
can time them in the engine, where the tuner, which times each kernel alone, cannot
weigh the dependent-launch wait. Same weights (symlinks), own tuning.json and manifest
entry for it. Prints one line per copy: its directory, the shape and the configuration.

Usage on the GPU machine: python scripts/experiments/alt_picks.py /tmp/eng-int4h OUT.json"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from kiln.build.engine_dir import sha256_file

SHAPES = ("int4g128:28672x4096", "int4g128:4096x14336")  # Llama-3.1-8B's gate_up, down
WITHIN = 1.06  # a candidate is timed in the engine if alone it is within 6 % of the pick


def copy_with(src: Path, dst: Path, tuning: dict) -> None:
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir()
    for name in os.listdir(src):
        if name not in ("tuning.json", "kernel_variants", "manifest.json"):
            (dst / name).symlink_to(src / name)
    tp = dst / "tuning.json"
    tp.write_text(json.dumps(tuning))
    m = json.loads((src / "manifest.json").read_text())
    m["files"]["tuning.json"] = {"sha256": sha256_file(tp), "size": tp.stat().st_size}
    (dst / "manifest.json").write_text(json.dumps(m, indent=2))


def main(src: str, out: str) -> None:
    src_p = Path(src)
    t = json.loads((src_p / "tuning.json").read_text())
    f16 = t["kernels"]["weight_only"].get("f16", {})
    made = []
    for key in SHAPES:
        pick = f16.get(key, {}).get("1")
        rows = t.get("measured", {}).get("weight_only", {}).get(f"{key} m=1", [])
        if not pick or not rows or not rows[0].get("ms"):
            print(f"{key}: no float16-code pick at one row; skipped")
            continue
        best = rows[0]["ms"]
        for i, r in enumerate(rows[1:3], 2):
            cfg = {k: v for k, v in r.items() if k != "ms"}
            if not cfg.get("F16") or not r.get("ms") or r["ms"] > best * WITHIN:
                continue
            alt = json.loads(json.dumps(t))
            alt["kernels"]["weight_only"]["f16"][key]["1"] = cfg
            dst = Path(f"{src}-alt{len(made) + 1}")
            copy_with(src_p, dst, alt)
            made.append({"engine": str(dst), "shape": key, "rank": i, "config": cfg,
                         "alone_us": round(r["ms"] * 1e3, 2),
                         "pick_alone_us": round(best * 1e3, 2), "pick": pick})  # fmt: skip
            print(dst, key, f"rank {i}", json.dumps(cfg), f"{r['ms'] * 1e3:.2f} us alone")
    Path(out).write_text(json.dumps(made, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
