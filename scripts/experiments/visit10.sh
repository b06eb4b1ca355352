#!/usr/bin/env bash
# The next visit (written in the fortieth session, 2026-12-06). int4h built, then its first
# load with the load's dry run on (the default since d0f8ecb): load seconds,
# kernel_warmup's figures and 8 greedy tokens (dry-load.json); then the int4-awq batch-1
# target: int4h TPOT (the engine now has its record) and bf16 built and timed beside it;
# then this tree against the session base's kiln (.old) on the same engine, and with time
# left the int4h step trace, the tuner's runner-up one-row picks for
# gate_up and down timed in engine copies (alt_picks.py, 2026-12-06, forty-first session),
# and the GPU tests of the fortieth session's changes.
# Usage on the GPU machine, repo root: LIMIT=seconds bash scripts/experiments/visit10.sh
# (the old tree: mkdir .old && git archive 7c528d3 kiln | tar -x -C .old, with .old/ in
# .git/info/exclude and carried by the device call: carry [".old"]). Ran once, on an
# H100 (results/2026-12-06-h100-visit10-73fd420.json).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KILN_CACHE_DIR=/tmp/kc
left() { echo $((${LIMIT:-200} - SECONDS - 10)); }
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $N $(nproc) CPUs"; echo "$N" > $OUT/device.txt
F=scripts/experiments/f16_engine.sh
source <(sed -n "/^shape=/,/^}/p;/^lat()/,/^}/p" $F)  # its build settings and lat()
bash $F b
timeout $(left) python - <<'PY'
import json, os, time
t0 = time.perf_counter()
from kiln import LLM, SamplingParams
llm = LLM("/tmp/eng-int4h", progress=False)
load_s = round(time.perf_counter() - t0, 1)
out = llm.generate([[128000, 791, 6864, 315]], SamplingParams(max_tokens=8, temperature=0.0),
                   use_tqdm=False)
res = {"load_s": load_s, "kernel_warmup": llm.kernel_warmup,
       "cuda_graph_capture_s": llm.cuda_graph_capture_s,
       "tokens": out[0].outputs[0].token_ids}
print(json.dumps(res)[:1500])
json.dump(res, open(os.environ["OUT"] + "/dry-load.json", "w"), indent=1)
PY
[ $(left) -gt 45 ] && LVALS=1 bash $F l
[ $(left) -gt 60 ] && BFRUNS=1 bash $F bf
# this session's loads before the waits (norm weights, the f16 kernel's scales and zeros,
# qkv's cos and sin) against the session base's kiln (7c528d3, in .old: carried, not
# committed), same engine and machine, alternating; then the scales' prefetch alone
for i in 1 2; do
  [ $(left) -gt 90 ] && lat int4h new$i
  [ -d .old/kiln ] && [ $(left) -gt 90 ] && lat int4h old$i PYTHONPATH=.old
done
[ $(left) -gt 80 ] && lat int4h szpf0 KILN_WQ_F16_SZPF=0
# the GPU tests of this session's kernels (norm weights, the f16 kernel's prefetch, qkv's
# cos and sin) and of the fortieth session's dry run
[ $(left) -gt 90 ] && timeout $(( $(left) < 170 ? $(left) - 20 : 150 )) python -m pytest -q -m "gpu or not gpu" \
  -o junit_logging=system-out --junitxml=$OUT/tests-gpu.xml tests/test_wq_rope.py \
  tests/test_f16_prep.py tests/test_partials.py tests/test_triton_kernels.py::test_rms_norm_kernel \
  tests/test_wq_f16.py tests/test_kernel_record.py tests/test_warmup.py 2>&1 | tail -4
[ $(left) -gt 180 ] && bash $F st
# the tuner's second and third one-row picks for gate_up and down, each in an engine copy
# (scripts/experiments/alt_picks.py), timed in the engine while time is left, then the
# engine's own pick again on the same machine
if [ $(left) -gt 150 ]; then
  python scripts/experiments/alt_picks.py /tmp/eng-int4h $OUT/alt-picks.json
  for e in /tmp/eng-int4h-alt*; do
    [ -d "$e" ] && [ $(left) -gt 100 ] && lat ${e#/tmp/eng-} run1
  done
  [ $(left) -gt 50 ] && lat int4h again
fi
bash $F pack
