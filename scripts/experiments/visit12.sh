#!/usr/bin/env bash
# fp8 + fp8 KV throughput at TensorRT-LLM's four shapes on an H200 only (forty-second
# session): the figures of record were 8f34b94's; this re-measures them at the current tree
# on a fresh 2,048-row outlier-64 engine (h200_quant.sh fc, FC_ENGINE=fp8o64b). Any other
# card exits at once (status 3), or with ELSE_TESTS=1 runs the GPU tests named below, or
# with ANY_CARD=1 measures there too.
# Two calls on one warm machine, each packing $OUT/visit.tgz:
#   PART=1 bash scripts/experiments/visit12.sh   # build, 2048/128 (1,000), 128/128 (10,000)
#   PART=2 bash scripts/experiments/visit12.sh   # 1000/1000 (1,000), 128/2048 (800)
# or PART=all for the four in one call (about 480 s estimated from 8f34b94's build and runs).
# SHAPES="n isl osl concurrency;..." replaces a part's shapes.
# FC_ONE_LOAD=1 measures a part's shapes on one engine load (kiln bench throughput --cases:
# each with its warm-up and an emptied prefix cache), not one process per shape.
set -u
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $N $(nproc) CPUs"
echo "$N" > $OUT/device.txt
pack() { ( cd $OUT && tar czf visit.tgz --remove-files --exclude visit.tgz * ); }
# ANY_CARD=1 measures on whatever card came (the forty-sixth session's H100 baseline:
# results/2026-12-07-h100-fp8-outliers64-fp8kv-shapes-645d658.json)
case "${ANY_CARD:-0} $N" in
  "1 "*|*H200*) ;;
  *) # another card: the GPU tests of the modes and of the files changed since 7ac592c
    # (the last whole GPU run), each in its own process, TEST_JOBS at a time
    [ "${ELSE_TESTS:-0}" = 1 ] || { echo "not an H200: nothing run"; exit 3; }
    # (ELSE_FILES and ELSE_MODES replace the files and the test_quant_gpu modes)
    F=${ELSE_FILES:-"tests/test_gpu_fastpath.py tests/test_gpu.py tests/test_fp8_gemv.py tests/test_wq_gemm.py
       tests/test_tuning.py tests/test_triton_kernels.py tests/test_kv_fp8.py tests/test_int4_scale16.py"}
    files=""; for f in $F; do files="$files $f@gpu"; done
    QUANT_GPU_MODES=${ELSE_MODES:-"fp8 fp8-kv int8-wo int4-awq w8a8-sq fp8-outliers fp8-search int4-awq-lm-head"} \
      TEST_JOBS=${TEST_JOBS:-8} TEST_TIMEOUT=${TEST_TIMEOUT:-420} TEST_FILES="$files" \
      timeout ${LIMIT:-540} bash scripts/h200_quant.sh t
    pack; exit 0 ;;
esac
# warm-up requests as 8f34b94's figures of record had them (64, then 128), so the eager
# steps' kernel variants are loaded before the timed window
# (PART=all: the four in one call, the closest to 0.8x first, within FC_LIMIT seconds)
case "${PART:-1}" in
  1) S="1000 2048 128 2048;10000 128 128 2048"; W=64 ;;
  all) S="1000 2048 128 2048;800 128 2048 1024;1000 1000 1000 1024;10000 128 128 2048"; W=128 ;;
  *) S="1000 1000 1000 1024;800 128 2048 1024"; W=128 ;;
esac
WARMUP=${WARMUP:-$W} FC_ENGINE=fp8o64b FC_SHAPES="${SHAPES:-$S}" \
  timeout ${FC_LIMIT:-570} bash scripts/h200_quant.sh fc
pack
