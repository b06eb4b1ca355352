"""Experiment (GPU): which Triton variants a second load of an engine still compiles after
preloading the first load's kernel-variant record (kiln.runtime.kernel_record), and how
each differs from the recorded variants of the same kernel.

tests/test_kernel_record.py's GPU test saw 4 such variants on the H200 (2026-12-03, 34
recorded and preloaded). Each load runs in a process of its own with an empty Triton cache;
the second prints, per variant compiled while it loads, the recorded specializations of
that kernel that differ from it in the fewest fields, and those fields.

Usage: ``PYTHONPATH=. python scripts/experiments/kr_diag.py OUT.json [MODEL]``"""

import json
import os
import subprocess
import sys
import tempfile

_LOAD = """
import json, sys
from triton import knobs
from kiln import LLM
seen = []
prev = knobs.runtime.jit_cache_hook
def hook(*a, **kw):
    fn, c = kw.get("fn"), kw.get("compile") or {}
    seen.append({"name": getattr(fn, "name", None), "module": getattr(fn, "module", None),
                 "spec": c.get("specialization_data")})
    return prev(*a, **kw) if prev else None
knobs.runtime.jit_cache_hook = hook
llm = LLM(sys.argv[1], max_seq_len=512, max_batch_size=16, max_num_tokens=512, progress=False)
print(json.dumps({"warmup": llm.kernel_warmup, "seen": seen, "blocks": llm.kv.num_blocks},
                 default=str))
"""


def _fields(spec: str) -> dict:
    try:
        return json.loads(spec)
    except (TypeError, ValueError):
        return {"raw": spec}


def _diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: {str(vb)[:120]} -> {str(va)[:120]}")
    return out


def main() -> None:
    model = sys.argv[2] if len(sys.argv) > 2 else "dummy:tiny"
    root = tempfile.mkdtemp()
    runs = []
    for i in range(2):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env |= {"KILN_CACHE_DIR": f"{root}/kiln", "TRITON_CACHE_DIR": f"{root}/triton{i}"}
        p = subprocess.run([sys.executable, "-c", _LOAD, model], env=env, capture_output=True,
                           text=True, timeout=900)  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.splitlines()[-1]))
    recorded: dict[str, list[dict]] = {}
    for s in runs[0]["seen"]:
        recorded.setdefault(s["name"], []).append(_fields(s["spec"]))
    first_specs = {s["spec"] for s in runs[0]["seen"]}
    report = {"model": model, "warmup": [r["warmup"] for r in runs],
              "blocks": [r["blocks"] for r in runs], "second_load_new": []}  # fmt: skip
    for s in runs[1]["seen"]:
        if s["spec"] in first_specs:
            continue  # compiled again outside the record's window, same variant
        mine = _fields(s["spec"])
        near = sorted((_diff(mine, r) for r in recorded.get(s["name"], [])), key=len)[:2]
        report["second_load_new"].append({"name": s["name"], "module": s["module"],
                                          "nearest_recorded_diffs": near})  # fmt: skip
        print(s["name"], s["module"], near[:1], flush=True)
    print(json.dumps(report["warmup"], default=str)[:1500])
    with open(sys.argv[1], "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
