#!/usr/bin/env bash
# One device visit (2026-12-06, thirty-ninth session): the int4 qkv projection with rotary
# and the KV-cache write in its epilogue (kiln.kernels.wq_rope). int4h built; on an H200
# the int4-awq batch-1 target first (bf16 once; int4h TPOT with the epilogue on / off /
# on / off at load, KILN_QKV_ROPE), then its GPU tests and the greedy tokens on / off; on
# another card the tests first, then the same TPOT A/B, the tokens, bf16; with TRACE=1 the
# int4h step trace in the time left. Packed at the end. No outer time limit around a part
# that runs TPOT (each run has its own): stopping the shell left its Python holding the
# GPU's memory in this script's second visit.
# Usage on the GPU machine, repo root: LIMIT=seconds bash scripts/experiments/visit5.sh
set -u
export PYTHONPATH=.
left() { echo $((${LIMIT:-520} - SECONDS - 20)); }
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $N $(nproc) CPUs"; echo "$N" > $OUT/device.txt
F=scripts/experiments/f16_engine.sh
tests() { timeout $1 python -m pytest -q $2 -m gpu --junitxml=$OUT/tests-$3.xml 2>&1 | tail -4; }
timeout 150 bash $F b
if echo "$N" | grep -q H200; then
  BFRUNS=1 bash $F bf
  QRVALS="1 0 1 0" bash $F qr
  tests 60 tests/test_wq_rope.py rope
else
  tests 60 tests/test_wq_rope.py rope
  QRVALS="1 0 1 0" bash $F qr
fi
[ $(left) -gt 90 ] && QT_TIMEOUT=$(left) bash $F qt
echo "$N" | grep -q H200 || { [ $(left) -gt 60 ] && BFRUNS=1 bash $F bf; }
[ "${TRACE:-0}" = 1 ] && [ $(left) -gt 100 ] && timeout $(left) bash $F st
bash $F pack
