#!/usr/bin/env bash
# This session's device visit (either card): on an H200 the int4-awq batch-1 target first
# (int4h and bf16 built, TPOT of int4h with the float16-code kernel's scales and zeros
# packed and not, KILN_WQ_F16_PACK 0 / 1 at load, the step trace packed), then the scale / zero
# experiment (f16_sz.py) in the time left; on an H100 the float16-code tests first (PF 2
# and the packed reads), the int4h build and the packing A/B, then the experiment. Then
# everything under $OUT in one archive. Usage on the GPU machine, repo root:
# bash scripts/experiments/visit2.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-480}
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $N"
echo "$N" > $OUT/device.txt
left() { echo $((LIMIT - SECONDS)); }
if echo "$N" | grep -q H200; then
  BFRUNS="1 2" LVALS="0 1 0 1" timeout 330 bash scripts/experiments/f16_engine.sh b bf pk
  KILN_WQ_F16_PACK=1 timeout 80 bash scripts/experiments/f16_engine.sh st
  [ $(left) -gt 60 ] && timeout $(($(left) - 20)) python scripts/experiments/f16_sz.py \
    $OUT/f16-sz.json $(($(left) - 60)) 2>&1 | tail -40
else
  T_TIMEOUT=100 bash scripts/experiments/f16_engine.sh t
  LVALS="0 1 0 1" timeout 270 bash scripts/experiments/f16_engine.sh b pk
  [ $(left) -gt 60 ] && timeout $(($(left) - 20)) python scripts/experiments/f16_sz.py \
    $OUT/f16-sz.json $(($(left) - 60)) 2>&1 | tail -40
fi
bash scripts/experiments/f16_engine.sh pack
