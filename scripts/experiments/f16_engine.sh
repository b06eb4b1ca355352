#!/usr/bin/env bash
# The float16-code int4 path in the engine (kiln/kernels/wq_tiled.py) on the GPU: its kernel
# tests, then int4-awq + int4 head built with the float16-code kernel among the tuner's
# candidates, batch-1 TPOT (128/128) with the path on and off on the same engine
# (KILN_WQ_F16), bf16 beside it, and the int4h step trace. Parts (in order): t b l bf st.
# Usage on the GPU machine, repo root: bash scripts/experiments/f16_engine.sh t b l
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KILN_CACHE_DIR=/tmp/kc
shape="--max-seq-len 4096 --max-batch-size 1024 --max-num-tokens 8192"
cli='import sys; from kiln.cli import main; sys.exit(main())'
build() {  # name, extra args
  [ -f /tmp/eng-$1/manifest.json ] && return
  ( time python -c "$cli" build --model dummy:llama-3.1-8b --output /tmp/eng-$1 --device cuda \
      $shape ${@:2} ) 2>&1 | tail -4
  cp /tmp/eng-$1/tuning.json $OUT/tuning-$1.json 2>/dev/null
}
lat() {  # engine, tag, env...
  ( export ${@:3}; timeout 170 python -c "$cli" bench latency --model /tmp/eng-$1 \
      --batch-sizes ${BATCHES:-1} --isl 128 --osl 128 --iterations 3 --no-progress \
      --report-json $OUT/latency-$1-$2.json 2>&1 | tail -2 | sed "s/^/$1 $2 /" )
}
for part in "$@"; do
  echo "=== part $part $(date +%T)"
  case $part in
    t) timeout ${T_TIMEOUT:-300} python -m pytest -q -x tests/test_wq_f16.py tests/test_f16_prep.py \
         -m "gpu or not gpu" --junitxml=$OUT/tests.xml 2>&1 | tail -15 ;;
    b) build int4h --quant int4-awq --quantize-lm-head
       python - <<'PY'
import json
t = json.load(open("/tmp/eng-int4h/tuning.json"))
wo = t["kernels"]["weight_only"]
print("f16 picks", json.dumps(wo.get("f16", {})))
for k, v in t.get("measured", {}).get("weight_only", {}).items():
    if k.endswith(("m=1", "m=4", "m=8")):
        print(k, [(round(r["ms"] * 1e3, 2) if r.get("ms") else None, "F16" if r.get("F16") else
                   "MMA" if r.get("MMA") else "other", r.get("R"), r.get("num_warps"),
                   r.get("SPLIT_K"), r.get("CH")) for r in v])
PY
       ;;
    l) for v in ${LVALS:-1 0 1 0}; do lat int4h f16-$v-$(date +%s) KILN_WQ_F16=$v; done ;;
    bf) build bf16; for i in ${BFRUNS:-1 2}; do lat bf16 run$i KILN_WQ_F16=1; done ;;
    st) timeout 200 python scripts/experiments/step_trace.py $OUT/step-trace-int4h.json \
          /tmp/eng-int4h 1 2>&1 | tail -24 ;;
  esac
done
