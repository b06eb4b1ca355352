#!/usr/bin/env bash
# One device visit that does useful work on either card: on an H200, first the int4-awq
# batch-1 target (f16_engine.sh b bf l st: int4h build, bf16 build, TPOT of both, the int4h
# step trace); then, on any card, a shard of the GPU tests in the time left (each file of
# SHARD with -k "gpu and not smollm2" in its own process, TEST_JOBS at a time, through
# h200_quant.sh t); then everything under $OUT in one archive.
# Usage on the GPU machine, repo root: SHARD="tests/a.py tests/b.py" bash scripts/experiments/visit.sh
set -u
LIMIT=${LIMIT:-570}
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $N"
echo "$N" > $OUT/device.txt
if echo "$N" | grep -q H200; then
  BFRUNS="1 2" LVALS="1 1" timeout 380 bash scripts/experiments/f16_engine.sh b bf l st
fi
left=$((LIMIT - SECONDS - 15))
files=""
for f in ${SHARD:-}; do files="$files $f@gpu"; done
if [ -n "$files" ] && [ $left -gt 60 ]; then
  TEST_JOBS=${TEST_JOBS:-6} TEST_TIMEOUT=$((left - 10)) TEST_FILES="$files" QUANT_GPU_MODES=${QUANT_GPU_MODES:-none} \
    timeout $left bash scripts/h200_quant.sh t
fi
bash scripts/experiments/f16_engine.sh pack
