#!/usr/bin/env bash
# A short device visit (2026-12-06, thirty-eighth session, 531 s of device time left). On an
# H200: int4h and bf16 built, one batch-1 TPOT each (f16_engine.sh b bf l), then the
# float16-code kernel's out= GPU tests in the time left; on another card only those cases.
# Usage on the GPU machine, repo root: bash scripts/experiments/visit4.sh
set -u
export PYTHONPATH=.
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $N"; echo "$N" > $OUT/device.txt
if echo "$N" | grep -q H200; then
  BFRUNS=1 LVALS=1 timeout ${TARGET_LIMIT:-300} bash scripts/experiments/f16_engine.sh b bf l
fi
left=$((${LIMIT:-420} - SECONDS - 15))
[ $left -gt 40 ] && timeout $left python -m pytest -q -m gpu --junitxml=$OUT/tests-out.xml \
  tests/test_wq_f16.py -k "float32_output_buffer or head_takes" 2>&1 | tail -3
bash scripts/experiments/f16_engine.sh pack
