#!/usr/bin/env bash
# The int4-awq batch-1 target on an H200 only (forty-first session, 2026-12-06): on any
# other card it exits at once (status 3), so a call that got an H100 costs only its start.
# int4h built, its TPOT (first load with the dry run, then from the record), bf16 built
# and timed twice, then the int4h step trace with the time left.
# Usage on the GPU machine, repo root: LIMIT=seconds bash scripts/experiments/visit11.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KILN_CACHE_DIR=/tmp/kc
left() { echo $((${LIMIT:-300} - SECONDS - 10)); }
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $N $(nproc) CPUs"
case "$N" in *H200*) ;; *) echo "not an H200: nothing run"; exit 3 ;; esac
echo "$N" > $OUT/device.txt
F=scripts/experiments/f16_engine.sh
bash $F b
[ $(left) -gt 60 ] && LVALS="${LVALS:-1 1}" bash $F l
[ $(left) -gt 60 ] && bash $F bf
[ $(left) -gt 120 ] && bash $F st
bash $F pack
