#!/usr/bin/env bash
# One device call (fifty-second session): on an H200 the fp8 + fp8 KV throughput of record
# at TensorRT-LLM's four shapes (visit12.sh PART=all, one process per shape, about 620 s
# with the start; not yet run); on any other card, in about 4 minutes (an H100 at 92761e7:
# tests and cost 114 s, first 107 s):
#   1. the GPU tests of the sampler's memory (a full 256-row batch with every costly option
#      within the measured peak), the KV sizing and prompt logprobs (tests/test_gpu.py);
#   2. the sort-free top-p kernel and the sampling kernel (every gpu test of their files);
#   3. sampler_cost.py (each sampling option's cost a step, top-p sorted and sort-free, the
#      costly set in row chunks and in one);
#   4. first_load_memory.sh on the full Llama-3.1-8B fp8 + fp8 KV engine (why a first load
#      sizes a smaller KV cache: its memory plan against the second load's).
# Usage: KILN_COMMIT=<sha> bash scripts/experiments/visit13.sh   (results under $OUT)
set -u
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $N $(nproc) CPUs"
case "${VISIT13_TESTS:-0} $N" in  # VISIT13_TESTS=1: the list below on an H200 too
  "0 "*H200*) exec env PART=all FC_LIMIT=${FC_LIMIT:-570} bash scripts/experiments/visit12.sh ;;
esac
echo "$N" > $OUT/device.txt
export PYTHONPATH=. PYTHONUNBUFFERED=1 KILN_REPORT_DIR=$OUT
t() { timeout "$1" python -m pytest -q -s -p no:cacheprovider -rfE --tb=short -m gpu "${@:2}"; }
P=" ${VISIT13_PARTS:-tests cost first} "  # which of the four to run: tests (1, 2), cost, first
case $P in *" tests "*)
  t 150 tests/test_gpu.py -k "sampling or kv_cache_takes or prompt_logprobs" > $OUT/tests.txt 2>&1
  t 100 tests/test_top_p_kernel.py tests/test_sampling_kernel.py >> $OUT/tests.txt 2>&1
  grep -E "passed|failed|error" $OUT/tests.txt ;; esac
case $P in *" cost "*)
  timeout 120 python scripts/experiments/sampler_cost.py $OUT/sampler_cost.json \
    > $OUT/sampler_cost.txt 2>&1
  tail -24 $OUT/sampler_cost.txt ;; esac
case $P in *" first "*)
  DIAG_MODEL=dummy:llama-3.1-8b timeout 200 bash scripts/experiments/first_load_memory.sh \
    > $OUT/first_load.txt 2>&1
  tail -4 $OUT/first_load.txt ;; esac
