#!/usr/bin/env bash
# The float16-code int4 path in the engine (kiln/kernels/wq_tiled.py) on the GPU: its kernel
# tests, its producers against the kernels they replace (p: RMSNorm and SiLU·mul at one row
# of Llama-3.1-8B, µs a call in CUDA graphs), then int4-awq + int4 head built with the
# float16-code kernel among the tuner's candidates (KILN_WQ_F16=1 at build), batch-1 TPOT
# (128/128) with the path on and off at load on the same engine (KILN_WQ_F16), bf16 beside
# it, and the int4h step trace. Parts (in order): t p b l bf st; lh: the head's share alone
# (KILN_WQ_F16_HEAD 1 / 0 at load on the same engine); pack (last): everything under $OUT
# in one archive, since at most 8 files come back from a visit. sc: TPOT with the
# sampler's transfers on the compute stream and on a side stream (KILN_SIDE_COPIES 0 / 1,
# SCVALS). s16: TPOT with the int4 scales
# in float16 and float32 at load on the same engine (KILN_INT4_SCALE16 1 / 0); ts: the
# float16-scale GPU tests with the int4 kernels' own. qr: TPOT with the qkv projection's
# rotary epilogue on and off at load (KILN_QKV_ROPE, QRVALS); qt: greedy tokens with it on
# and off (toggle_tokens.py). bk: TPOT
# of the int4h engine with its one-row rows-kernel picks of K = 4,096 (qkv, o) given one
# 4,096-value tile, so that all their weights load before the wait (a copy of the engine
# with its own tuning.json; the tuner, timing kernels alone, picked 2,048).
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
  ( [ $# -gt 2 ] && export ${@:3}; timeout 170 python -c "$cli" bench latency --model /tmp/eng-$1 \
      --batch-sizes ${BATCHES:-1} --isl 128 --osl 128 --iterations 3 --no-progress \
      --report-json $OUT/latency-$1-$2.json 2>&1 | tail -2 | sed "s/^/$1 $2 /" )
  # the load's dry run (on by default since 2026-12-06, first measured on dummy:tiny): if a
  # run with it gave no report, once more without it, so that a visit still has its figure
  if [ ! -f $OUT/latency-$1-$2.json ] && [ -z "${KILN_LOAD_DRY_RUN:-}" ]; then
    echo "$1 $2: no report; again with KILN_LOAD_DRY_RUN=0"
    KILN_LOAD_DRY_RUN=0 lat $1 $2-nodry ${@:3}
  fi
}
for part in "$@"; do
  echo "=== part $part $(date +%T)"
  case $part in
    t) timeout ${T_TIMEOUT:-300} python -m pytest -q -x tests/test_wq_f16.py tests/test_f16_prep.py \
         -m "gpu or not gpu" --junitxml=$OUT/tests.xml 2>&1 | tail -15 ;;
    p) timeout 120 python - <<'PY'
import json, os, torch
from kiln.kernels.rmsnorm import rms_norm_triton
from kiln.kernels.activation import silu_and_mul_triton
from kiln.kernels import f16_prep
def us(fn):  # 32 calls in one CUDA graph, 10 replays
    for _ in range(3): fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(32): fn()
    g.replay(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(10): g.replay()
    b.record(); torch.cuda.synchronize()
    return round(a.elapsed_time(b) / 320 * 1e3, 3)
x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16); r = torch.randn_like(x)
w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
gu = torch.randn(1, 28672, device="cuda", dtype=torch.bfloat16)
out = {"device": torch.cuda.get_device_name(),
       "rms_norm_us": us(lambda: rms_norm_triton(x, w, 1e-5, r)),
       "rms_norm_prep_us": us(lambda: f16_prep.rms_norm_prep_triton(x, w, 1e-5, r)),
       "silu_mul_us": us(lambda: silu_and_mul_triton(gu)),
       "silu_mul_prep_us": us(lambda: f16_prep.silu_mul_prep_triton(gu))}
print(out); json.dump(out, open(os.environ["OUT"] + "/producers.json", "w"))
PY
       ;;
    b) ( export KILN_WQ_F16=1; build int4h --quant int4-awq --quantize-lm-head )
       python - <<'PY'
import json
t = json.load(open("/tmp/eng-int4h/tuning.json"))
wo = t["kernels"]["weight_only"]
print("f16 picks", json.dumps(wo.get("f16", {})))
for k, v in t.get("measured", {}).get("weight_only", {}).items():
    if k.endswith(("m=1", "m=4", "m=8")):
        print(k, [(round(r["ms"] * 1e3, 2) if r.get("ms") else None, "F16" if r.get("F16") else
                   "MMA" if r.get("MMA") else "other", r.get("R"), r.get("num_warps"),
                   r.get("SPLIT_K"), r.get("CH"), r.get("PF")) for r in v])
PY
       ;;
    l) for v in ${LVALS:-1 0 1 0}; do lat int4h f16-$v-$(date +%s) KILN_WQ_F16=$v; done ;;
    s16) for v in ${LVALS:-1 0 1 0}; do lat int4h s16-$v-$(date +%s) KILN_INT4_SCALE16=$v; done ;;
    ts) timeout ${T_TIMEOUT:-300} python -m pytest -q -x tests/test_int4_scale16.py \
          tests/test_wq_f16.py tests/test_wq_mma.py -m gpu --junitxml=$OUT/tests-s16.xml 2>&1 \
          | tail -8 ;;
    lh) for v in ${LVALS:-1 0 1 0}; do lat int4h head-$v-$(date +%s) KILN_WQ_F16_HEAD=$v; done ;;
    sc) for v in ${SCVALS:-0 1}; do lat int4h sc-$v-$(date +%s) KILN_SIDE_COPIES=$v; done ;;
    qr) for v in ${QRVALS:-1 0 1 0}; do lat int4h qr-$v-$(date +%s) KILN_QKV_ROPE=$v; done ;;
    bk) python - <<'PY'
import json, os, shutil
src, dst = "/tmp/eng-int4h", "/tmp/eng-int4h-bk"
shutil.rmtree(dst, ignore_errors=True)
os.makedirs(dst)
for name in os.listdir(src):  # the same weights, a tuning.json of its own
    if name not in ("tuning.json", "kernel_variants", "manifest.json"):
        os.symlink(os.path.join(src, name), os.path.join(dst, name))
t = json.load(open(os.path.join(src, "tuning.json")))
changed = {}
for key in ("int4g128:6144x4096", "int4g128:4096x4096"):  # Llama-3.1-8B's qkv and o
    c = t["kernels"]["weight_only"]["by_shape"].get(key, {}).get("1")
    if c and c.get("GLUON") and c["BLOCK_K"] < 4096:
        c["BLOCK_K"] = 4096
        changed[key] = c
json.dump(t, open(os.path.join(dst, "tuning.json"), "w"))
from kiln.build.engine_dir import sha256_file  # the manifest checks the new file's hash
m = json.load(open(os.path.join(src, "manifest.json")))
tp = os.path.join(dst, "tuning.json")
m["files"]["tuning.json"] = {"sha256": sha256_file(__import__("pathlib").Path(tp)),
                             "size": os.path.getsize(tp)}
json.dump(m, open(os.path.join(dst, "manifest.json"), "w"), indent=2)
print("one-row rows-kernel picks given one 4,096-value tile:", json.dumps(changed))
json.dump(changed, open(os.environ["OUT"] + "/bk-changed.json", "w"))
PY
       for i in ${BKRUNS:-1 2}; do lat int4h-bk run$i; done ;;
    qt) timeout ${QT_TIMEOUT:-200} python scripts/experiments/toggle_tokens.py \
          kiln.kernels.wq_rope ENABLED /tmp/eng-int4h $OUT/tokens-qkv-rope.json 2>&1 | tail -3 ;;
    bf) build bf16; for i in ${BFRUNS:-1 2}; do lat bf16 run$i KILN_WQ_F16=1; done ;;
    pack) ( cd $OUT && tar czf visit.tgz --remove-files --exclude visit.tgz * ) ;;
    st) timeout 200 python scripts/experiments/step_trace.py $OUT/step-trace-int4h.json \
          /tmp/eng-int4h 1 2>&1 | tail -24 ;;
  esac
done
