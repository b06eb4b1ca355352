#!/usr/bin/env bash
# step traces (tnew, told) and decode attention timings (dab) of this tree and f03a598's tree
# (old_f03a598/: `git archive f03a598 kiln`), 882 sequences of ~1,000 tokens; bold builds
# f03a598's engine (carry it afterwards as engines/eng-old). Usage: TT=100 bash THIS told tnew
set -u
export PYTHONUNBUFFERED=1 KILN_CACHE_DIR=/tmp/kc
S="--max-seq-len 4096 --max-batch-size 2048 --max-num-tokens 16384"
B=${TB:-882}; P=${TP:-1000}; T=${TT:-40}
for part in "$@"; do
  case $part in
  test)
    PYTHONPATH=. timeout 200 python -m pytest -q -m gpu tests/test_kv_fp8.py -k bf16_on_gpu 2>&1 | tail -3 ;;
  tnew)
    s0=$(date +%s)
    PYTHONPATH=. timeout 400 python scripts/experiments/step_trace.py $OUT/trace-new-$B-$P.json ${ENG_NEW:-engines/eng-fp8b} $B $P $T 2>&1 | grep -v Warn | tail -24
    echo "tnew $(( $(date +%s) - s0 )) s" ;;
  bold)
    s0=$(date +%s)
    (cd old_f03a598 && PYTHONPATH=. python -c 'import sys; from kiln.cli import main; sys.exit(main())' build --model dummy:llama-3.1-8b --output /tmp/eng-old --device cuda $S --quant fp8 --kv-cache-dtype fp8 2>&1 | tail -2 | cut -c1-300)
    echo "build old $(( $(date +%s) - s0 )) s"
    mkdir -p $OUT/eng-old; cp /tmp/eng-old/manifest.json /tmp/eng-old/tuning.json $OUT/eng-old/ ;;
  told)
    s0=$(date +%s)
    PYTHONPATH=old_f03a598 timeout 400 python scripts/experiments/step_trace.py $OUT/trace-old-$B-$P.json ${ENG_OLD:-$([ -f /tmp/eng-old/manifest.json ] && echo /tmp/eng-old || echo engines/eng-old)} $B $P $T 2>&1 | grep -v Warn | tail -24
    echo "told $(( $(date +%s) - s0 )) s" ;;
  dab)
    for t in old new; do
      [ $t = old ] && pp=old_f03a598 || pp=.
      PYTHONPATH=$pp timeout 200 python scripts/experiments/decode_ab_trees.py $OUT/decode-ab-$t.json 2>&1 | grep -v Warn | sed "s/^/$t /"
    done ;;
  esac
done
