#!/usr/bin/env bash
# (Part pre, the KILN_ROWS_PRE A/B, was removed with the setting once measured slower,
# 2026-12-06: this script as it ran is in git history.)
# The next device visit (written 2026-12-06, thirty-ninth session). On an H200: the int4-awq
# batch-1 target at this tree first (int4h and bf16 built, one TPOT each), then int4h with
# the rows kernel's two tiles before the dependent-launch wait against one (KILN_ROWS_PRE
# 2 / 1 at load), the rows kernel's GPU tests, qkv and o on one 4,096-value tile (an
# engine copy, part bk), the qkv rotary epilogue's greedy-token check. On another card:
# the tests, the KILN_ROWS_PRE A/B, bk, the token check, bf16. No outer time limit
# around a TPOT part (each run has its own). Packed at the end.
# Usage on the GPU machine, repo root: LIMIT=seconds bash scripts/experiments/visit7.sh
set -u
export PYTHONPATH=.
left() { echo $((${LIMIT:-540} - SECONDS - 15)); }
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $N $(nproc) CPUs"; echo "$N" > $OUT/device.txt
F=scripts/experiments/f16_engine.sh
tests() { timeout $1 python -m pytest -q $2 -m gpu --junitxml=$OUT/tests-$3.xml 2>&1 | tail -4; }
T="tests/test_wq_gemm.py::test_int4_rows_gluon_two_tiles_before_the_wait tests/test_wq_rope.py"
bash $F b
if echo "$N" | grep -q H200; then
  BFRUNS=1 bash $F bf
  LVALS=1 bash $F l
  PREVALS="2 1 2 1" bash $F pre
  tests 90 "$T" rows
else
  tests 90 "$T" rows
  PREVALS="2 1 2 1" bash $F pre
fi
[ $(left) -gt 150 ] && BKRUNS="1 2" bash $F bk
[ $(left) -gt 100 ] && QT_TIMEOUT=$(( $(left) < 160 ? $(left) : 160 )) bash $F qt
echo "$N" | grep -q H200 || { [ $(left) -gt 60 ] && BFRUNS=1 bash $F bf; }
# the load's opt-in dry run (KILN_LOAD_DRY_RUN, 32e4a68): three cold-cache loads of dummy:tiny
[ $(left) -gt 150 ] && tests $(( $(left) - 20 )) "-o junit_logging=system-out \
  tests/test_kernel_record.py::test_second_load_on_a_cold_triton_cache_compiles_the_record_in_threads" dry
bash $F pack
