#!/usr/bin/env bash
# One device visit (2026-12-06, thirty-eighth session). On an H200: the int4-awq batch-1
# target first (f16_engine.sh b bf l st), the decode fast-path GPU tests, TPOT with the
# sampler's copies on the compute stream against a side stream (sc), then one build with
# threads only (build_procs.sh RUNS=0; the b part's build used processes). On an H100: the
# builds with and without compile processes, the kernel-record and fast-path GPU tests,
# bf16 and int4h TPOT, sc. Everything under $OUT packed.
# Usage on the GPU machine, repo root: bash scripts/experiments/visit3.sh
set -u
export PYTHONPATH=.
left() { echo $((560 - SECONDS - 20)); }
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $N $(nproc) CPUs"; echo "$N" > $OUT/device.txt
F16T="tests/test_wq_f16.py::test_float32_output_buffer_on_gpu"  # the head's out=
tests() { timeout $1 python -m pytest -q $2 -m gpu --junitxml=$OUT/tests-$3.xml 2>&1 | tail -4; }
if echo "$N" | grep -q H200; then
  BFRUNS="1 2" LVALS="1 1" timeout 380 bash scripts/experiments/f16_engine.sh b bf l st
  tests 100 "tests/test_gpu_fastpath.py $F16T" fastpath
  [ $(left) -gt 100 ] && SCVALS="0 1" timeout $(left) bash scripts/experiments/f16_engine.sh sc
  [ $(left) -gt 80 ] && RUNS=0 timeout $(left) bash scripts/experiments/build_procs.sh
else
  RUNS="default 0" timeout 200 bash scripts/experiments/build_procs.sh
  tests 130 "tests/test_gpu_fastpath.py tests/test_kernel_record.py $F16T" fastpath
  mkdir -p /tmp/eng-int4h && cp -r /tmp/bp-procs-default/. /tmp/eng-int4h/
  BFRUNS=1 LVALS=1 timeout $(left) bash scripts/experiments/f16_engine.sh bf l sc
fi
bash scripts/experiments/f16_engine.sh pack
