#!/usr/bin/env bash
# fp8 + fp8 KV 2048/128 (1,000 requests, TensorRT-LLM's shape) on this tree and on the tree of
# f03a598 (old_f03a598/: `git archive f03a598`), each with its own 2,048-row engine built in the
# same visit, runs interleaved: is the drop from f03a598's 3,143 tok/s the code or the machine?
# AB_PARTS: b (build both), r (runs in AB_ORDER), rb2 (this tree's build again, tuning reused), e.g. AB_ORDER="new old new".
# AB_ISL / AB_OSL / AB_CONC / AB_WARMUP: another shape (2026-12-04: 1000/1000 at 1,024 in flight
# measured 0.730x at 5a4575d against f03a598's 0.869x, in the same 2,008 steps).
set -u
export PYTHONUNBUFFERED=1 KILN_CACHE_DIR=/tmp/kc
M=dummy:llama-3.1-8b
S="--max-seq-len 4096 --max-batch-size 2048 --max-num-tokens 16384"
root=$PWD
dir() { [ "$1" = old ] && echo "$root/old_f03a598" || echo "$root"; }
k() { (cd "$(dir "$1")" && PYTHONPATH=. python -c 'import sys; from kiln.cli import main; sys.exit(main())' "${@:2}"); }
gpu() { nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader; }
for part in ${AB_PARTS:-b r}; do
  case $part in
  b)
    for t in new old; do
      if [ -f "engines/eng-ab-$t/manifest.json" ]; then cp -r "engines/eng-ab-$t" /tmp/; echo "carried $t"; continue; fi
      s0=$(date +%s)
      k $t build --model $M --output /tmp/eng-ab-$t --device cuda $S --quant fp8 --kv-cache-dtype fp8 2>&1 | tail -2 | cut -c1-300
      echo "build $t $(( $(date +%s) - s0 )) s"
      mkdir -p "$OUT/eng-ab-$t"; cp /tmp/eng-ab-$t/manifest.json /tmp/eng-ab-$t/tuning.json "$OUT/eng-ab-$t/"
    done ;;
  r)
    i=0
    for t in ${AB_ORDER:-new old new}; do
      i=$((i + 1)); echo "run $i $t gpu: $(gpu)"
      s0=$(date +%s)
      (cd "$(dir $t)" && PYTHONPATH=. timeout ${AB_TIMEOUT:-200} python -c 'import sys; from kiln.cli import main; sys.exit(main())' \
        bench throughput --model /tmp/eng-ab-$t --num-requests ${AB_N:-1000} --isl ${AB_ISL:-2048} \
        --osl ${AB_OSL:-128} --concurrency ${AB_CONC:-2048} --warmup ${AB_WARMUP:-256} --no-progress \
        --report-json "$OUT/ab-$i-$t-${AB_ISL:-2048}-${AB_OSL:-128}-${AB_N:-1000}-$(date +%s).json") 2>&1 | tail -2 | cut -c1-400
      echo "run $i $t $(( $(date +%s) - s0 )) s; gpu after: $(gpu)"
    done ;;
  rb2)  # this tree's build again: its tuning reused from $KILN_CACHE_DIR (kiln.build.tuning_cache)
    s0=$(date +%s)
    k new build --model $M --output /tmp/eng-ab-new2 --device cuda $S --quant fp8 --kv-cache-dtype fp8 2>&1 | tail -2 | cut -c1-300
    echo "rebuild new $(( $(date +%s) - s0 )) s"
    mkdir -p "$OUT/eng-ab-new2"; cp /tmp/eng-ab-new2/manifest.json /tmp/eng-ab-new2/tuning.json "$OUT/eng-ab-new2/" ;;
  esac
done
