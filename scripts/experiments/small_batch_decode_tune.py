"""Experiment (H200): the build's small-batch decode-attention tuning alone (graph-timed
cases, ``kiln.build.tuning``), at dummy Llama-3.1-8B's heads and a 4,096-token engine
limit; then an engine directory (a ``dummy:`` engine is a manifest and a tuning) made from
a given build's, with its ``small_batch`` replaced by this pick, for ``kiln bench latency``.

Usage: ``python scripts/experiments/small_batch_decode_tune.py ENGINE_IN ENGINE_OUT
OUT.json``."""

import hashlib
import itertools
import json
import sys
from pathlib import Path

import torch

from kiln.build import tuning as tn
from kiln.checkpoint.dummy import DummyCheckpoint


def main() -> None:
    src, dst, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    cfg = DummyCheckpoint.from_source("dummy:llama-3.1-8b").config
    limit = 4096
    cases = [tn._decode_case(cfg, torch.bfloat16, b, c, 32, limit=limit)
             for b, c in tn.SMALL_BATCH_CASES]  # fmt: skip
    cands = [{"target_programs": p, "num_warps": w, "blocks_per_step": n}
             for p, w, n in itertools.product((264, 528, 1056), (4, 8), (1, 2, 4))]  # fmt: skip
    best, rows = tn._best("decode_attention", cands, cases, tn._graph_ms)
    rows.sort(key=lambda r: r.get("ms", 1e9))
    for r in rows[:8]:
        print(r, flush=True)
    print("pick", best, flush=True)
    dst.mkdir(parents=True, exist_ok=True)
    t = json.loads((src / "tuning.json").read_text())
    t["kernels"]["decode_attention"]["small_batch"] = {"max_batch": 8} | best
    body = json.dumps(t, indent=1).encode()
    (dst / "tuning.json").write_bytes(body)
    m = json.loads((src / "manifest.json").read_text())
    m["files"]["tuning.json"] = {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}
    (dst / "manifest.json").write_text(json.dumps(m, indent=1))
    out.write_text(json.dumps({"note": __doc__.split("\n\n")[0], "pick": best,
                               "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
