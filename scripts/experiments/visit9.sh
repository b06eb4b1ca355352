#!/usr/bin/env bash
# (Part pre, the KILN_ROWS_PRE A/B, was removed with the setting once measured slower,
# 2026-12-06: this script as it ran is in git history.)
# The fortieth session's second visit (written 2026-12-06). On an H200: the int4-awq batch-1
# target first (int4h and bf16 built, one TPOT each), then KILN_ROWS_PRE 2 / 1 at load,
# the GPU tests (qkv rope at PRE 1 and 2, the load dry run), the one-tile engine copy
# (part bk). On another card: the tests, the KILN_ROWS_PRE A/B, bk, then bf16 if time is
# left. No outer time limit around a TPOT part (each run has its own). Packed at the end.
# Usage on the GPU machine, repo root: LIMIT=seconds bash scripts/experiments/visit9.sh
set -u
export PYTHONPATH=.
left() { echo $((${LIMIT:-480} - SECONDS - 15)); }
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $N $(nproc) CPUs"; echo "$N" > $OUT/device.txt
F=scripts/experiments/f16_engine.sh
tests() { timeout $1 python -m pytest -q $2 -m gpu --junitxml=$OUT/tests-$3.xml 2>&1 | tail -4; }
T="-o junit_logging=system-out tests/test_wq_rope.py
  tests/test_kernel_record.py::test_second_load_on_a_cold_triton_cache_compiles_the_record_in_threads"
bash $F b
if echo "$N" | grep -q H200; then
  LVALS=1 bash $F l
  BFRUNS=1 bash $F bf
  [ $(left) -gt 100 ] && PREVALS="2 1" bash $F pre
  [ $(left) -gt 90 ] && tests 80 "$T" gpu
else
  tests 90 "$T" gpu
  PREVALS="2 1 2 1" bash $F pre
fi
[ $(left) -gt 80 ] && BKRUNS="1 2" bash $F bk
echo "$N" | grep -q H200 || { [ $(left) -gt 60 ] && BFRUNS=1 bash $F bf; }
bash $F pack
