#!/usr/bin/env bash
# Why a first load of an engine sizes a smaller KV cache than later loads (an H100,
# 2026-12-07: 868,160 tokens against 882,528 for the 8B fp8 + fp8 KV engine): a fresh
# engine loaded twice (three times with DIAG_THIRD=1), one process each, every load's
# report giving its memory plan (free bytes at sizing, the measured activation peak, the
# cache's bytes) and its kernel preload. DIAG_MODEL: the checkpoint (default Llama-3.1-8B
# at 2 layers), built as visit12.sh's engine (fp8 + fp8 KV, 64 outliers, 2,048 rows).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KILN_CACHE_DIR=/tmp/kc-diag
kiln() { python -c 'import sys; from kiln.cli import main; sys.exit(main())' "$@"; }
E=/tmp/eng-diag
rm -rf $E
kiln build --model "${DIAG_MODEL:-dummy:llama-3.1-8b,num_hidden_layers=2}" --output $E \
  --device cuda --quant fp8 --kv-cache-dtype fp8 --activation-scheme outliers \
  --act-outliers 64 --max-seq-len 4096 --max-batch-size 2048 --max-num-tokens 16384 2>&1 | tail -1
for i in 1 2 ${DIAG_THIRD:+3}; do
  kiln bench throughput --model $E --num-requests 32 --isl 128 --osl 8 --warmup 2 \
    --no-progress --report-json $OUT/first-load-$i.json 2>&1 | grep -E "^KV cache"
done
python - <<'PY'
import json, os
for i in (1, 2, 3):
    p = f"{os.environ['OUT']}/first-load-{i}.json"
    if not os.path.exists(p):
        continue
    s = json.load(open(p))["settings"]
    gib = {k: round(v / 2**30, 3) for k, v in s["memory_plan"].items()}
    pre = (s.get("kernel_warmup") or {}).get("preload")
    print(f"load {i}: {s['kv_cache_tokens']:,} tokens, GiB {gib}, preload {str(pre)[:200]}")
PY
