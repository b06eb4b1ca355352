#!/usr/bin/env bash
# Build time with the recorded variants compiled in worker processes before the threads
# (kiln.runtime.compile_procs) against threads only (KILN_COMPILE_PROCESSES=0): the
# int4-awq + int4 head engine of dummy Llama-3.1-8B, each build on empty kiln and Triton
# caches, processes first; the tuning's precompile figures copied beside the times.
# Usage on the GPU machine, repo root: bash scripts/experiments/build_procs.sh [runs]
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
cli='import sys; from kiln.cli import main; sys.exit(main())'
for p in ${RUNS:-default 0}; do
  tag=procs-$p
  rm -rf /tmp/bp-$tag /tmp/bpk-$tag /tmp/bpt-$tag
  env=(KILN_CACHE_DIR=/tmp/bpk-$tag TRITON_CACHE_DIR=/tmp/bpt-$tag)
  [ "$p" != default ] && env+=(KILN_COMPILE_PROCESSES=$p)
  s=$(date +%s.%N)
  env "${env[@]}" timeout 240 python -c "$cli" build --model dummy:llama-3.1-8b \
    --output /tmp/bp-$tag --device cuda --max-seq-len 4096 --max-batch-size 1024 \
    --max-num-tokens 8192 --quant int4-awq --quantize-lm-head 2>&1 | tail -2
  e=$(date +%s.%N)
  python - "$tag" "$s" "$e" <<'PY'
import json, os, sys
tag, s, e = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
t = json.load(open(f"/tmp/bp-{tag}/tuning.json"))
m = t.get("measured", {})
pre = {k: v["precompile"] for k, v in m.items() if isinstance(v, dict) and "precompile" in v}
out = {"tag": tag, "build_wall_s": round(e - s, 1), "tuning_s": t.get("wall_time_s"),
       "phase_s": m.get("phase_s"), "precompile": pre | {"attention": m.get("precompile")}}
print(json.dumps(out)[:1500])
json.dump(out, open(os.environ["OUT"] + f"/build-{tag}.json", "w"), indent=1)
PY
done
