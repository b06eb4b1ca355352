#!/usr/bin/env bash
# The thirty-seventh session's device visit, on either card. At ee17a9b it ran on an H100:
# the float16-code tests, the int4h build, and TPOT with the kernel's scales and zeros packed
# and not (part pk, KILN_WQ_F16_PACK 0 / 1 at load). Then scripts/experiments/f16_sz.py (the
# scales and zeros read as now, not at all, or packed, on its own copy of the kernel,
# wq_f16_sz.py; both at 6ee45a4, removed after). The packing lost
# (results/2026-12-06-h100-f16-pf2-pack.json) and was removed, with pk. As it stands: on an
# H200 the int4-awq batch-1 target (int4h and bf16 built, TPOT, the step trace); on an H100
# the float16-code tests and the int4h build with its TPOT. Then everything under $OUT in one
# archive. Usage on the GPU machine, repo root: bash scripts/experiments/visit2.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $N"
echo "$N" > $OUT/device.txt
if echo "$N" | grep -q H200; then
  BFRUNS="1 2" LVALS="1 1" timeout 330 bash scripts/experiments/f16_engine.sh b bf l
  timeout 80 bash scripts/experiments/f16_engine.sh st
else
  T_TIMEOUT=100 bash scripts/experiments/f16_engine.sh t
  LVALS="1 1" timeout 270 bash scripts/experiments/f16_engine.sh b l
fi
bash scripts/experiments/f16_engine.sh pack
