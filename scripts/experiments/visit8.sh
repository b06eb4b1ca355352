#!/usr/bin/env bash
# A short H200 visit (2026-12-06, thirty-ninth session, 266 s of device time left): int4h
# built and its batch-1 TPOT first, then bf16 built and its TPOT, so that the int4h figure
# comes back even if the time runs out before bf16's. Packed at the end.
# Usage on the GPU machine, repo root: bash scripts/experiments/visit8.sh
set -u
export PYTHONPATH=.
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $N $(nproc) CPUs"; echo "$N" > $OUT/device.txt
F=scripts/experiments/f16_engine.sh
bash $F b > $OUT/build-int4h.log 2>&1; tail -3 $OUT/build-int4h.log
LVALS=1 bash $F l
bash $F pack  # what there is so far, in case the time runs out below
BFRUNS=1 bash $F bf
( cd $OUT && mkdir -p part2 && mv *.json part2/ 2>/dev/null; tar czf visit2.tgz part2 && rm -rf part2 )
