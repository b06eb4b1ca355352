"""Experiment (H200): which of two build tunings' picks makes an int4-awq engine's batch-1
decode slow. Two builds of the same engine (dummy Llama-3.1-8B, int4-awq with an int4 head)
tuned on the same GPU ran 2.02 and 2.52 ms TPOT (same machine, same visit); their tuners
had timed the picks within a few per cent of each other. This writes engine directories
(``dummy:`` engines are a manifest and a tuning) with the fast tuning, the slow one, and
the fast one with one kernel's picks taken from the slow one, for ``kiln bench latency``.

Usage: ``python scripts/experiments/tuning_swap.py MANIFEST FAST SLOW OUTDIR``; prints the
directories written."""

import copy
import hashlib
import json
import sys
from pathlib import Path


def write(root: Path, manifest: dict, tuning: dict) -> None:
    root.mkdir(parents=True, exist_ok=True)
    body = json.dumps(tuning, indent=1).encode()
    (root / "tuning.json").write_bytes(body)
    m = copy.deepcopy(manifest)
    m["files"]["tuning.json"] = {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}
    (root / "manifest.json").write_text(json.dumps(m, indent=1))
    print(root)


def main() -> None:
    manifest = json.loads(Path(sys.argv[1]).read_text())
    fast, slow = (json.loads(Path(p).read_text()) for p in sys.argv[2:4])
    out = Path(sys.argv[4])
    write(out / "fast", manifest, fast)
    write(out / "slow", manifest, slow)
    t = copy.deepcopy(fast)
    t["kernels"]["decode_attention"] = slow["kernels"]["decode_attention"]
    write(out / "fast-attn", manifest, t)
    names = {"int4g128:4096x4096": "o", "int4g128:6144x4096": "qkv",
             "int4g128:4096x14336": "down", "int4g128:28672x4096": "gate_up"}  # fmt: skip
    fb = fast["kernels"]["weight_only"]["by_shape"]
    sb = slow["kernels"]["weight_only"]["by_shape"]
    for key, name in names.items():
        if fb[key]["1"] != sb[key]["1"]:
            t = copy.deepcopy(fast)
            t["kernels"]["weight_only"]["by_shape"][key]["1"] = sb[key]["1"]
            write(out / f"fast-{name}1", manifest, t)
    t = copy.deepcopy(fast)
    for key in names:
        for m in ("4", "8"):
            t["kernels"]["weight_only"]["by_shape"][key][m] = sb[key][m]
    write(out / "fast-rows4to8", manifest, t)


if __name__ == "__main__":
    main()
