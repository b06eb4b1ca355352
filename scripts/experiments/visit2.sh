#!/usr/bin/env bash
# The thirty-seventh session's device visit, on either card. At ee17a9b it ran on an H100:
# the float16-code tests, the int4h build, and TPOT with the kernel's scales and zeros packed
# and not (part pk, KILN_WQ_F16_PACK 0 / 1 at load). Then f16_sz.py. The packing lost
# (results/2026-12-06-h100-f16-pf2-pack.json) and was removed, with pk. As it stands: on an
# H200 the int4-awq batch-1 target first (int4h and bf16 built, TPOT, the step trace),
# then f16_sz.py in the time left; on an H100 the float16-code tests and the int4h build
# with its TPOT, then f16_sz.py. Then everything under $OUT in one archive. Usage on the GPU
# machine, repo root: bash scripts/experiments/visit2.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-480}
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $N"
echo "$N" > $OUT/device.txt
left() { echo $((LIMIT - SECONDS)); }
if echo "$N" | grep -q H200; then
  BFRUNS="1 2" LVALS="1 1" timeout 330 bash scripts/experiments/f16_engine.sh b bf l
  timeout 80 bash scripts/experiments/f16_engine.sh st
  [ $(left) -gt 60 ] && timeout $(($(left) - 20)) python scripts/experiments/f16_sz.py \
    $OUT/f16-sz.json $(($(left) - 60)) 2>&1 | tail -40
else
  T_TIMEOUT=100 bash scripts/experiments/f16_engine.sh t
  LVALS="1 1" timeout 270 bash scripts/experiments/f16_engine.sh b l
  [ $(left) -gt 60 ] && timeout $(($(left) - 20)) python scripts/experiments/f16_sz.py \
    $OUT/f16-sz.json $(($(left) - 60)) 2>&1 | tail -40
fi
bash scripts/experiments/f16_engine.sh pack
