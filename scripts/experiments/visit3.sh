#!/usr/bin/env bash
# One device visit (2026-12-06, thirty-eighth session): on an H200 first the int4-awq
# batch-1 target (f16_engine.sh b bf l st); on any card then the build with its variants
# compiled in processes against threads only (build_procs.sh), the kernel-record GPU test,
# and on an H100 the int4h / bf16 TPOT beside each other; everything under $OUT packed.
# Usage on the GPU machine, repo root: bash scripts/experiments/visit3.sh
set -u
export PYTHONPATH=.
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $N $(nproc) CPUs"; echo "$N" > $OUT/device.txt
if echo "$N" | grep -q H200; then
  BFRUNS="1 2" LVALS="1 1" timeout 380 bash scripts/experiments/f16_engine.sh b bf l st
  RUNS=0 timeout $((560 - SECONDS - 20)) bash scripts/experiments/build_procs.sh
else
  RUNS="default 0" timeout 200 bash scripts/experiments/build_procs.sh
  timeout 120 python -m pytest -q tests/test_kernel_record.py -m gpu 2>&1 | tail -4
  mkdir -p /tmp/eng-int4h && cp -r /tmp/bp-procs-default/. /tmp/eng-int4h/
  BFRUNS=1 LVALS=1 timeout $((560 - SECONDS - 15)) bash scripts/experiments/f16_engine.sh bf l
fi
bash scripts/experiments/f16_engine.sh pack
