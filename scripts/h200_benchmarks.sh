#!/usr/bin/env bash
# The committed H200 benchmarks of issue 6, in two parts (each fits one 10-minute call).
# Usage (on the GPU machine, repo root): KILN_COMMIT=<sha> bash scripts/h200_benchmarks.sh a|b
# Results: $OUT/*.json; copy them to benchmarks/results/ with the date and GPU in the name.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KILN_CACHE_DIR=/tmp/kc
kiln() { python -c 'import sys; from kiln.cli import main; sys.exit(main())' "$@"; }
ENG=/tmp/eng-llama-3.1-8b
common="--no-progress"
if [ "$1" = a ] || [ ! -f $ENG/manifest.json ]; then
  ( time kiln build --model dummy:llama-3.1-8b --output $ENG --device cuda --max-seq-len 4096 \
      --max-batch-size 1024 --max-num-tokens 8192 ) 2>&1 | tail -12
  cp $ENG/tuning.json $ENG/manifest.json $OUT/
fi
if [ "$1" = a ]; then
  kiln bench kernels --report-json $OUT/kernels.json > $OUT/kernels.txt 2>&1; tail -3 $OUT/kernels.txt
  kiln bench latency --model $ENG --batch-sizes 1,8,64 --isl 128 --osl 128 --iterations 3 \
      $common --report-json $OUT/latency.json 2>&1 | tail -5
  kiln bench throughput --model $ENG --num-requests 10000 --isl 128 --osl 128 $common \
      --report-json $OUT/throughput-128-128.json 2>&1 | tail -12
fi
if [ "$1" = b ]; then
  kiln bench throughput --model $ENG --num-requests 1000 --isl 2048 --osl 128 $common \
      --report-json $OUT/throughput-2048-128.json 2>&1 | tail -4
  kiln bench throughput --model $ENG --num-requests 1000 --isl 1000 --osl 1000 $common \
      --report-json $OUT/throughput-1000-1000.json 2>&1 | tail -4
  kiln bench throughput --model $ENG --num-requests 500 --isl 128 --osl 2048 $common \
      --report-json $OUT/throughput-128-2048.json 2>&1 | tail -4
fi
