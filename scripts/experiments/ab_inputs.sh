#!/usr/bin/env bash
# A/B of the decode step's work outside the CUDA graphs: this tree against OLD, the kiln
# package of an earlier commit (e.g. `git archive 641e7e0 kiln | tar -x -C old641`), on the
# same engines in one visit: batch-1 TPOT (kiln bench latency, 128/128) of int4-awq + int4
# head and bf16, and the int4h step trace (period against span, operations outside).
# Usage on the GPU machine, repo root: OLD=old641 bash scripts/experiments/ab_inputs.sh
set -u
export PYTHONUNBUFFERED=1 KILN_CACHE_DIR=/tmp/kc
root=$(pwd)
shape="--max-seq-len 4096 --max-batch-size 1024 --max-num-tokens 8192"
cli='import sys; from kiln.cli import main; sys.exit(main())'
for e in int4h bf16; do
  q=""; [ $e = int4h ] && q="--quant int4-awq --quantize-lm-head"
  [ -f /tmp/eng-$e/manifest.json ] || ( time PYTHONPATH=. python -c "$cli" build \
    --model dummy:llama-3.1-8b --output /tmp/eng-$e --device cuda $shape $q ) 2>&1 | tail -4
done
lat() {  # side (new|old), engine
  local dir=$root; [ $1 = old ] && dir=$root/$OLD
  ( cd $dir && PYTHONPATH=. timeout 170 python -c "$cli" bench latency --model /tmp/eng-$2 \
      --batch-sizes 1 --isl 128 --osl 128 --iterations 3 --no-progress \
      --report-json $OUT/latency-$2-$1.json 2>&1 | tail -2 )
}
trace() {  # side
  local pp=.; [ $1 = old ] && pp=$OLD
  PYTHONPATH=$pp timeout 170 python scripts/experiments/step_trace.py \
    $OUT/step-trace-int4h-$1.json /tmp/eng-int4h 1 2>&1 | tail -8
}
lat new int4h; lat old int4h; trace new; trace old; lat new bf16; lat old bf16
