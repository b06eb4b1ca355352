#!/usr/bin/env bash
# One visit to the GPU machine: GPU tests, then benchmarks; everything lands under $OUT.
# Usage: bash scripts/gpu_visit.sh "<pytest targets>" "<bench commands separated by ;>"
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KILN_CACHE_DIR=/tmp/kc KILN_REPORT_DIR=$OUT/reports
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
mkdir -p $OUT/reports
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
if [ -n "${1:-}" ]; then
  timeout ${TEST_TIMEOUT:-240} python -m pytest -q -x -p no:cacheprovider $1 2>&1 | tee $OUT/tests.log | tail -25
fi
if [ -n "${2:-}" ]; then
  bash -c "$2" 2>&1 | tee $OUT/bench.log | grep -v '^\s*$' | tail -40
fi
