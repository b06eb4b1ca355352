#!/usr/bin/env bash
# The last device visit of the thirty-ninth session (2026-12-06, about 530 s of device time
# left). On an H200: the int4-awq batch-1 target at this tree (int4h and bf16 built, one
# TPOT each, then a second int4h run). On another card: int4h built, the greedy tokens with
# the qkv rotary epilogue off / on (toggle_tokens.py), then the int4h step trace in the time
# left. No outer time limit around a TPOT part (each run has its own): a stopped shell left
# its Python running, holding the GPU's memory (the thirty-ninth session's second visit).
# Usage on the GPU machine, repo root: LIMIT=seconds bash scripts/experiments/visit6.sh
set -u
export PYTHONPATH=.
left() { echo $((${LIMIT:-400} - SECONDS - 15)); }
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $N $(nproc) CPUs"; echo "$N" > $OUT/device.txt
F=scripts/experiments/f16_engine.sh
bash $F b
if echo "$N" | grep -q H200; then
  BFRUNS=1 bash $F bf
  LVALS=1 bash $F l
  [ $(left) -gt 45 ] && LVALS=1 bash $F l
else
  [ $(left) -gt 100 ] && QT_TIMEOUT=$(( $(left) < 160 ? $(left) : 160 )) bash $F qt
  [ $(left) -gt 60 ] && timeout $(left) python scripts/experiments/step_trace.py \
    $OUT/step-trace-int4h.json /tmp/eng-int4h 1 2>&1 | tail -24
fi
bash $F pack
