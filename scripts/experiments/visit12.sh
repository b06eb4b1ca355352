#!/usr/bin/env bash
# fp8 + fp8 KV throughput at TensorRT-LLM's four shapes on an H200 only (forty-second
# session): the figures of record were 8f34b94's; this re-measures them at the current tree
# on a fresh 2,048-row outlier-64 engine (h200_quant.sh fc, FC_ENGINE=fp8o64b). Any other
# card exits at once (status 3). Two calls on one warm machine, each packing $OUT/visit.tgz:
#   PART=1 bash scripts/experiments/visit12.sh   # build, 2048/128 (1,000), 128/128 (10,000)
#   PART=2 bash scripts/experiments/visit12.sh   # 1000/1000 (1,000), 128/2048 (800)
set -u
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $N $(nproc) CPUs"
case "$N" in *H200*) ;; *) echo "not an H200: nothing run"; exit 3 ;; esac
echo "$N" > $OUT/device.txt
case "${PART:-1}" in
  1) S="1000 2048 128 2048;10000 128 128 2048" ;;
  *) S="1000 1000 1000 1024;800 128 2048 1024" ;;
esac
FC_ENGINE=fp8o64b FC_SHAPES="$S" bash scripts/h200_quant.sh fc
( cd $OUT && tar czf visit.tgz --remove-files --exclude visit.tgz * )
