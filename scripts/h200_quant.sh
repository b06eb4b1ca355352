#!/usr/bin/env bash
# The committed H200 runs of issue 7 (quantization). Usage on the GPU machine, repo root:
#   KILN_COMMIT=<sha> bash scripts/h200_quant.sh t|k|l|fa|fb|cap ...   (parts run in order)
# t: GPU tests of the quantized paths (TEST_FILES, FILE@EXPR for a -k subset); mma: the tensor-core few-row int4 experiment; pipe: the cp.async-pipelined one-row int4 experiment; if: the one-row int4 in-flight experiment
# (INFLIGHT_BIG=1: whole-K tiles); dv: fp8-cache decode attention variants; k: kernel
# benchmarks (kiln.bench.quant_bench), kd: their weight-only decode part; rot: the fp8 cache
# write with and without the KV rotation; l: batch-1 latency bf16 / int4-awq / fp8; l4h:
# int4-awq with --quantize-lm-head; lm: batch 1-16 latency (int4h, LM_ENGINES); pdl: batch 1 at each KILN_PDL level; fa, fb:
# fp8 + fp8-KV throughput (TensorRT-LLM's four shapes); fo: the same with fp8 outlier
# channels (two shapes, latency); fo64: with 64 channels (fo64b: 2,048 rows, against fp8b); fod: in the down projections
# only; b1prof: a kernel profile of one int4-awq request (B1PROF_ENGINE=int4h); db1: decode attention's candidates at batch 1 (BATCHES=1,16,32: more sequences too); gus: SiLU·mul fused into the int4
# gate_up epilogue (experiment); l2: the one-row int4 projections L2-cold vs hot; rp: a decode
# step against its CUDA graph alone (STEP_ENGINES); st: one decode step kernel by kernel
# (ST_ENGINES, ST_BATCHES); blk: fp8 "block" (tests, kernels, two shapes against fp8b); pf: decode attention's prefetch on / off (PF_BATCHES);
# sc: the streaming ceiling of the projections' packed bytes (SC_MANY_ROWS); f8s: fp8
# decode with the fp8 skinny kernel and without (KILN_FP8_SKINNY); gap: levers and diagnostics
# on the one-row int4 kernel (int4_gap.py; GAP_SET levers,ring,tiled,diag); nreg: that kernel
# with ptxas register caps (int4_maxnreg.py); ncu: Nsight Compute on the one-row int4 projections (int4_ncu.py);
# f16: the tensor-core int4 kernel with float16 codes (int4_mma_f16.py; f16hot: L2-hot); pcf takes PCF_WORKERS (default "0 default"); mtma: the tensor-core int4 kernel fed by a TMA ring (int4_mma_tma.py); mtncu: Nsight Compute on it; mtdiag: it without its arithmetic; pcw: the int4h weight-only tuning with and without precompile; pcb: int4h builds so; pcf: the fp8 + fp8 KV engine built so;
# engines/eng-NAME (a carried manifest + tuning) skips a build; ds: greedy tokens with and without the
# deferred split-K sums (kiln.kernels.partials); m16: the tensor-core int4 kernel at 9-16 rows; mr: at 16-128 rows (ROWS; KILN_WQ_ZSUB=1 adds the zero-point-off-the-codes candidates); fc: fa and fb's shapes with more requests and
# a 2,048-row engine (FC_ENGINE=fp8o64b: fo64b's); FC_SHAPES picks "n isl osl concurrency;...", FC_ARGS more bench args
# (e.g. --scheduler-policy max_utilization), WARMUP
# the warm-up requests: 64 compile the eager steps' kernel variants before measuring); prof: a kernel
# profile of 2048/128 on that engine; fr: whole prompts over their own K/V off / on (KILN_FRESH_PREFILL); fda: that engine as built against the same with decode
# attention's large-batch pick set to FDA_PICK; dmt: that tier's candidates on its build cases
# and on cases in its range; kr: two cold-cache loads of that engine, the second from the
# first's kernel-variant record; rb: build time with every kernel timed, then the same build
# reusing that tuning (kiln.build.tuning_cache); cap: KV-cache capacity in 2k-token sequences, bf16 vs fp8 KV.
# fp8 and fp8b engines are per token (--activation-scheme dynamic, fp8's default until 2321e42);
# fp8o64b is the outlier default (FC_ENGINE=fp8o64b).
# Results: $OUT/*.json (copy to benchmarks/results/ with the date and GPU in the name).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KILN_CACHE_DIR=/tmp/kc
# the kernel-variant records the loads wrote, for engines/eng-NAME/kernel_variants next visit
keep_records() { for d in /tmp/eng-*/kernel_variants; do [ -d "$d" ] || continue
  n=${d#/tmp/eng-}; mkdir -p $OUT/kernel_variants-${n%%/*}; cp $d/*.json $OUT/kernel_variants-${n%%/*}/; done; }
trap keep_records EXIT
kiln() { python -c 'import sys; from kiln.cli import main; sys.exit(main())' "$@"; }
M=dummy:llama-3.1-8b
shape="--max-seq-len 4096 --max-batch-size 1024 --max-num-tokens 8192"
build() {  # name, extra build args
  [ -f /tmp/eng-$1/manifest.json ] && return
  # an engine carried from an earlier visit (dummy: engines are a manifest and a tuning)
  # (with the Triton variants an earlier load recorded, if carried: kiln.runtime.kernel_record)
  [ -f engines/eng-$1/manifest.json ] && { cp -r engines/eng-$1 /tmp/; chmod -R u+w /tmp/eng-$1
    echo "carried eng-$1"; return; }
  ( time kiln build --model $M --output /tmp/eng-$1 --device cuda $shape ${@:2} ) 2>&1 | tail -4
  cp /tmp/eng-$1/manifest.json $OUT/manifest-$1.json; cp /tmp/eng-$1/tuning.json $OUT/tuning-$1.json 2>/dev/null
}
tput() {  # name, requests, isl, osl
  kiln bench throughput --model /tmp/eng-$1 --num-requests $2 --isl $3 --osl $4 --no-progress \
    --report-json $OUT/throughput-$1-$3-$4.json 2>&1 | tail -4
}
ab() {  # engines A and B, interleaved: 2048/128 (1,000 requests) and 128/128 (10,000)
  for r in "1000 2048 128 2048" "10000 128 128 2048"; do
    read -r n i o c <<< "$r"
    for e in "$@"; do
      timeout ${FC_TIMEOUT:-150} python -c 'import sys; from kiln.cli import main; sys.exit(main())' \
        bench throughput --model /tmp/eng-$e --num-requests $n --isl $i --osl $o \
        --concurrency $c --warmup ${WARMUP:-64} --no-progress \
        --report-json $OUT/throughput-$e-$i-$o-$n.json 2>&1 | tail -3
    done
  done
}
for part in "$@"; do
  echo "=== part $part"
  case $part in
  t)  # every file (and each test_quant_gpu mode) in its own process, TEST_JOBS at a time
    # with the CPU threads shared out, each with its own time limit; reports in $OUT/tests.txt
    jobs=()
    for f in ${TEST_FILES:-tests/test_kv_fp8.py tests/test_wq_gemm.py tests/test_quant_act.py tests/test_quant_act_search.py \
        tests/test_quant_core.py tests/test_kv_rotation.py tests/test_rotary_kv.py \
        tests/test_gemv.py}; do
      # FILE@EXPR: that file's tests matching the -k expression EXPR, in a process of
      # their own (e.g. tests/test_wq_mma.py@many_rows, whose compiles take minutes)
      case $f in *@*) jobs+=("${f%%@*}|${f#*@} and not smollm2") ;; *) jobs+=("$f|not smollm2") ;; esac
    done
    for m in ${QUANT_GPU_MODES:-fp8 fp8-kv int8-wo int4-awq w8a8-sq fp8-outliers fp8-search int4-awq-lm-head}; do
      [ "$m" = none ] && continue  # QUANT_GPU_MODES=none: the test files alone
      jobs+=("tests/test_quant_gpu.py::test_quantized_engine_graphs_eager_and_emulation[$m]|gpu")
    done
    i=0
    P=${TEST_JOBS:-3}
    for j in "${jobs[@]}"; do
      i=$((i + 1))
      while [ "$(jobs -rp | wc -l)" -ge "$P" ]; do wait -n; done
      # SmolLM2's package is not on the GPU image (CI runs those tests)
      # each job's summary and log reach $OUT as it ends (a visit cut short keeps them)
      ( OMP_NUM_THREADS=$((16 / P)) timeout ${TEST_TIMEOUT:-300} python -m pytest -q -p no:cacheprovider -rfE --tb=short \
          -k "${j#*|}" ${j%%|*} > /tmp/t$i.txt 2>&1
        rc=$?; { flock 9; echo "${j%%|*} [${j#*|}] rc=$rc $(tail -1 /tmp/t$i.txt)" >> $OUT/trc.txt
          cat /tmp/t$i.txt >> $OUT/tests.txt; } 9>/tmp/t.lock ) &
    done
    wait
    cat $OUT/trc.txt; grep -E "^(FAILED|ERROR)" $OUT/tests.txt | cut -c1-200 ;;
  if) timeout ${V_TIMEOUT:-360} python scripts/experiments/int4_gemv_inflight.py \
       $OUT/int4_inflight.json 2>&1 | grep -v WRONG | tail -40 ;;
  dv) timeout ${V_TIMEOUT:-300} python scripts/experiments/fp8kv_decode_variants.py \
       $OUT/fp8kv_decode_variants.json 2>&1 | tail -20 ;;
  mma) timeout ${V_TIMEOUT:-500} python scripts/experiments/int4_mma.py $OUT/int4_mma.json \
       ${MMA_ARGS:-} 2>&1 | tail -40 ;;
  pipe) timeout ${V_TIMEOUT:-500} python scripts/experiments/int4_row_pipe.py \
       $OUT/int4_row_pipe.json 2>&1 | grep -v WRONG | tail -30 ;;
  v) timeout ${V_TIMEOUT:-360} python scripts/experiments/int4_gemv_variants.py \
       $OUT/int4_variants.json 2>&1 | grep -v WRONG | tail -40 ;;
  b1prof)  # kernel time of one int4-awq request (batch 1, 128/256) by kernel;
    # B1PROF_ENGINE=int4h: with the int4 head
    e=${B1PROF_ENGINE:-int4}
    case $e in int4h) build int4h --quant int4-awq --quantize-lm-head ;; *) build int4 --quant int4-awq ;; esac
    timeout ${PROF_TIMEOUT:-150} python scripts/experiments/profile_throughput.py \
      $OUT/profile-$e-b1.json --model /tmp/eng-$e --num-requests 1 --isl 128 --osl 256 \
      --no-progress 2>&1 | tail -30 ;;
  ds)  # the int4h engine's greedy tokens with split-K sums left to the consumers and without
    build int4h --quant int4-awq --quantize-lm-head
    timeout ${V_TIMEOUT:-200} python scripts/experiments/defer_split_check.py /tmp/eng-int4h \
      $OUT/defer_split_check.json 2>&1 | tail -4 ;;
  l2) timeout ${V_TIMEOUT:-300} python scripts/experiments/int4_l2_hot.py \
       $OUT/int4_l2_hot.json 2>&1 | tail -8 ;;
  db1) timeout ${V_TIMEOUT:-300} python scripts/experiments/decode_b1_configs.py \
       $OUT/decode_b1_configs.json 2>&1 | tail -40 ;;
  gus) timeout ${V_TIMEOUT:-300} python scripts/experiments/gate_up_silu.py \
       $OUT/gate_up_silu.json 2>&1 | tail -30 ;;
  rg) timeout ${V_TIMEOUT:-400} python scripts/experiments/int4_16_regress.py \
       $OUT/int4_16_regress.json 2>&1 | tail -20 ;;
  f8s)  # fp8 + fp8 KV decode at 1-16 sequences with the fp8 skinny kernel where the build's
    # tuner picked it, and the same engine with KILN_FP8_SKINNY=0 (torch._scaled_mm)
    build fp8 --quant fp8 --activation-scheme dynamic --kv-cache-dtype fp8
    for v in ${F8S_MODES:-1 0}; do  # F8S_MODES=1: the tuned kernels only
      KILN_FP8_SKINNY=$v timeout 150 python -c 'import sys; from kiln.cli import main; sys.exit(main())' \
        bench latency --model /tmp/eng-fp8 --batch-sizes ${F8S_BATCHES:-1,4,16} --isl 128 --osl 128 \
        --iterations 3 --no-progress --report-json $OUT/latency-fp8-skinny$v.json 2>&1 | tail -1
    done ;;
  sc)  # the streaming ceiling of each projection's packed bytes (int4_stream_ceiling.py),
    # against the int4 kernel's one-row times of SC_MANY_ROWS (an int4_many_rows.py file)
    timeout ${V_TIMEOUT:-300} python scripts/experiments/int4_stream_ceiling.py \
      $OUT/int4_stream_ceiling.json ${SC_MANY_ROWS:-benchmarks/results/2026-12-02-h200-int4-many-rows-zs-b6dc027.json} 2>&1 | tail -8 ;;
  nreg) timeout ${V_TIMEOUT:-420} python scripts/experiments/int4_maxnreg.py $OUT/int4_maxnreg.json 2>&1 |
    grep -E "best|chain|error|Error" | cut -c1-400 ;;
  ncu)  # Nsight Compute on the one-row int4 projections (scripts/experiments/int4_ncu.py):
    # pipes, issue slots, occupancy and stall reasons of each case's 3 profiled launches
    timeout ${V_TIMEOUT:-480} ncu --clock-control none --profile-from-start off \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section InstructionStats --section SourceCounters -o $OUT/int4_ncu -f \
      python scripts/experiments/int4_ncu.py $OUT/int4_ncu.json 2>&1 | tail -12
    ncu --import $OUT/int4_ncu.ncu-rep --csv --page details > $OUT/int4_ncu_details.csv 2>&1
    ncu --import $OUT/int4_ncu.ncu-rep --page details 2>&1 | grep -E "^  [a-z_]+|Issue Slots Busy|Executed Ipc A|No Eligible|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Memory Throughput|Duration|Stall" | head -150 ;;
  f16)  # the tensor-core int4 kernel with float16 codes and x prepared by its producer
    # (int4_mma_f16.py): odd-shape checks, each projection's engine tuning and float16
    # candidates at one row, the words row-major and tile-major, the 32-layer chain
    timeout ${V_TIMEOUT:-560} python scripts/experiments/int4_mma_f16.py \
      $OUT/int4_mma_f16.json 2>&1 | grep -v "^$" | tail -150 ;;
  f16hot)  # the same candidates with one weight called over and over (L2-hot where it fits)
    timeout ${V_TIMEOUT:-560} python scripts/experiments/int4_mma_f16.py --hot \
      $OUT/int4_mma_f16_hot.json 2>&1 | grep -v "^$" | grep "engine\|top" | tail -40 ;;
  mtma)  # the tensor-core int4 kernel fed by a TMA ring (int4_mma_tma.py): gate_up and down
    # swept, each candidate checked bit for bit against the engine kernel's same tiles, and
    # the 32-layer chain
    timeout ${MTMA_TIMEOUT:-330} python scripts/experiments/int4_mma_tma.py \
      $OUT/int4_mma_tma.json 2>&1 | grep -v "^$" | tail -60 ;;
  pcb)  # int4h built twice on empty Triton, kiln and tuning caches: variants compiled one by
    # one as first called (KILN_COMPILE_WORKERS=0), then precompiled in threads (default);
    # then each engine's batch-1 TPOT
    for w in 0 default; do
      ( export TRITON_CACHE_DIR=$(mktemp -d) KILN_CACHE_DIR=$(mktemp -d) KILN_TUNING_CACHE=0
        [ $w = 0 ] && export KILN_COMPILE_WORKERS=0
        echo "build, compile workers $w"
        ( time kiln build --model $M --output /tmp/eng-pc$w --device cuda $shape --quant int4-awq \
            --quantize-lm-head ) 2>&1 | tail -4 | tee -a $OUT/pcb-build-$w.txt
        cp /tmp/eng-pc$w/tuning.json $OUT/tuning-pc$w.json
        kiln bench latency --model /tmp/eng-pc$w --batch-sizes 1 --isl 128 --osl 128 \
          --iterations 3 --no-progress --report-json $OUT/latency-pc$w.json 2>&1 | tail -3 )
    done ;;
  pcf)  # the 2,048-row fp8 + fp8 KV engine (rb's) built twice on empty Triton, kiln and tuning
    # caches: compiles one by one (KILN_COMPILE_WORKERS=0), then precompiled in threads (the
    # fp8 phase's included, e50c3df); each build's wall time and phases, then batch-1 TPOT
    for w in ${PCF_WORKERS:-0 default}; do
      ( export TRITON_CACHE_DIR=$(mktemp -d) KILN_CACHE_DIR=$(mktemp -d) KILN_TUNING_CACHE=0
        [ $w = 0 ] && export KILN_COMPILE_WORKERS=0
        echo "fp8 build, compile workers $w"
        ( time kiln build --model $M --output /tmp/eng-pf$w --device cuda --max-seq-len 4096 \
            --max-batch-size 2048 --max-num-tokens 16384 --quant fp8 --kv-cache-dtype fp8 ) 2>&1 |
          tail -4 | tee -a $OUT/pcf-build-$w.txt
        cp /tmp/eng-pf$w/tuning.json $OUT/tuning-pf$w.json
        kiln bench latency --model /tmp/eng-pf$w --batch-sizes 1 --isl 128 --osl 128 \
          --iterations 3 --no-progress --report-json $OUT/latency-pf$w.json 2>&1 | tail -3 )
    done
    python -c 'import json
def pre(d, path=""):  # every "precompile" entry: what it compiled and how long it took
    for k, v in d.items():
        if k == "precompile" and isinstance(v, dict):
            yield path, {a: b for a, b in v.items() if a in ("compiled", "seconds", "failed")}
        elif isinstance(v, dict):
            yield from pre(v, path + "/" + k)
for w in "'"${PCF_WORKERS:-0 default}"'".split():
    t = json.load(open(f"'$OUT'/tuning-pf{w}.json"))["measured"]
    print(w, "phase_s", t.get("phase_s"), "precompile", list(pre(t)))' 2>&1 | cut -c1-1500 ;;
  pcw)  # the int4h weight-only tuning on an empty Triton cache, compiles one by one, then
    # all at once in threads first (precompile_wo.py, each in a fresh process)
    KILN_COMPILE_WORKERS=0 timeout ${V_TIMEOUT:-300} python scripts/experiments/precompile_wo.py \
      $OUT/precompile_wo-serial.json 2>&1 | tail -3
    timeout ${V_TIMEOUT:-300} python scripts/experiments/precompile_wo.py \
      $OUT/precompile_wo-threads.json 2>&1 | tail -8 ;;
  mtdiag)  # that ring on gate_up at 2-8 slots with and without its arithmetic (NOMATH)
    timeout ${V_TIMEOUT:-300} python scripts/experiments/int4_mma_tma.py --diag \
      $OUT/int4_mma_tma_diag.json 2>&1 | grep -v "^$" | tail -30 ;;
  mtncu)  # Nsight Compute on that ring at two and four slots and on the engine kernel (gate_up)
    timeout ${V_TIMEOUT:-300} ncu --clock-control none --profile-from-start off \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
      -o $OUT/int4_mma_tma_ncu -f python scripts/experiments/int4_mma_tma.py --ncu \
      $OUT/int4_mma_tma_ncu.json 2>&1 | tail -6
    ncu --import $OUT/int4_mma_tma_ncu.ncu-rep --csv --page details > $OUT/int4_mma_tma_ncu.csv 2>&1
    ncu --import $OUT/int4_mma_tma_ncu.ncu-rep --page details 2>&1 | grep -E "^  [a-z_]+|Duration|DRAM Throughput|Memory Throughput|L2 Hit|L1/TEX Hit|Issue Slots Busy|No Eligible|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|Stall|Dynamic Shared|Block Limit" | head -120 ;;
  gap) timeout ${V_TIMEOUT:-400} python scripts/experiments/int4_gap.py $OUT/int4_gap.json 2>&1 |
       grep -v "^$" | tail -${GAP_TAIL:-80} ;;
  mr) timeout ${V_TIMEOUT:-400} python scripts/experiments/int4_many_rows.py \
       $OUT/int4_many_rows.json 2>&1 | grep -v "^$" | tail -40 ;;
  m16) timeout ${V_TIMEOUT:-400} python scripts/experiments/int4_mma16.py \
       $OUT/int4_mma16.json 2>&1 | tail -30 ;;
  k) timeout 400 python -m kiln.bench.quant_bench $OUT/quant_kernels.json 2>&1 | tail -3 ;;
  rot) timeout 200 python -m kiln.bench.quant_bench $OUT/kv_rotation.json rot 2>&1 | tail -5 ;;
  kd) timeout 300 python -m kiln.bench.quant_bench $OUT/quant_kernels_decode.json wo-decode 2>&1 |
    python -c 'import sys, json
for line in sys.stdin:
    try: r = json.loads(line)
    except ValueError: print(line.rstrip()[:200]); continue
    print(r["mode"], r["shape"], r["m"], "fused %.4f tuned %.4f bf16 %.4f" % (r["fused_ms"], r["tuned_ms"], r["bf16_ms"]), r["tuned_config"])' ;;
  l4h)  # batch-1 / 16 latency of int4-awq with lm_head in int4 too
    build int4h --quant int4-awq --quantize-lm-head
    kiln bench latency --model /tmp/eng-int4h --batch-sizes 1,16 --isl 128 --osl 128 \
      --iterations 3 --no-progress --report-json $OUT/latency-int4h.json 2>&1 | tail -3 ;;
  pdl)  # batch-1 latency with programmatic dependent launch at each KILN_PDL level
    # (PDL_LEVELS, default "0 1 2 0 1 2") of the engines in PDL_ENGINES (int4h and/or bf16)
    for e in ${PDL_ENGINES:-int4h}; do
      case $e in int4h) build int4h --quant int4-awq --quantize-lm-head ;; bf16) build bf16 ;; esac
      for v in ${PDL_LEVELS:-0 1 2 0 1 2}; do
        KILN_PDL=$v timeout 120 python -c 'import sys; from kiln.cli import main; sys.exit(main())' \
          bench latency --model /tmp/eng-$e --batch-sizes 1 --isl 128 --osl 128 --iterations 5 \
          --no-progress --report-json $OUT/latency-$e-pdl$v.json 2>&1 | tail -1 | sed "s/^/pdl$v /"
      done
    done ;;
  lm)  # int4-awq (+ int4 head; LM_ENGINES adds int4, bf16) at batch 1-64 with the tensor-core
    # few-row kernel among the tuner's candidates
    for e in ${LM_ENGINES:-int4h}; do
      case $e in int4h) build int4h --quant int4-awq --quantize-lm-head ;;
        int4h8)  # the tensor-core kernel at 1-8 rows only (as before 2026-12-01), built and run
          export KILN_WQ_MMA_ROWS=8; build int4h8 --quant int4-awq --quantize-lm-head ;;
        int4h16)  # at 1-16 rows (the ninth session's), built and run
          export KILN_WQ_MMA_ROWS=16; build int4h16 --quant int4-awq --quantize-lm-head ;;
        int4) build int4 --quant int4-awq ;; bf16) build bf16 ;; esac
      # LM_ENV: one run per setting, e.g. "KILN_WQ_MMA=0 KILN_WQ_MMA=1" (the same engine
      # without / with the MMA kernel) or "KILN_PDL=0 KILN_PDL=2"
      for v in ${LM_ENV:-KILN_WQ_MMA=1}; do
        tag=$(echo $v | tr -d '=_' | tr 'A-Z' 'a-z')
        ( export $v; kiln bench latency --model /tmp/eng-$e --batch-sizes ${LM_BATCHES:-1,8,16,32,64} \
          --isl 128 --osl 128 --iterations 3 --no-progress \
          --report-json $OUT/latency-$e-$tag.json 2>&1 | tail -6 | sed "s/^/$v /" )
      done
      unset KILN_WQ_MMA_ROWS
    done ;;
  st)  # one decode step kernel by kernel (scripts/experiments/step_trace.py) of the engines
    # in ST_ENGINES (int4h, bf16) at ST_BATCHES
    for e in ${ST_ENGINES:-int4h}; do
      case $e in int4h) build int4h --quant int4-awq --quantize-lm-head ;; bf16) build bf16 ;; esac
      timeout ${V_TIMEOUT:-200} python scripts/experiments/step_trace.py $OUT/step-trace-$e.json \
        /tmp/eng-$e ${ST_BATCHES:-1} 2>&1 | tail -24
    done ;;
  pf)  # decode attention's prefetch before the PDL wait, on and off: step traces and TPOT
    # of the int4h engine at PF_BATCHES (scripts/experiments/step_trace.py, kiln bench latency)
    build int4h --quant int4-awq --quantize-lm-head
    for r in 1a 0a 1b; do
      KILN_DECODE_PREFETCH=${r:0:1} timeout ${V_TIMEOUT:-120} python scripts/experiments/step_trace.py \
        $OUT/step-trace-int4h-prefetch$r.json /tmp/eng-int4h ${PF_BATCHES:-1,16} 2>&1 | grep batch
    done
    LM_ENV="KILN_DECODE_PREFETCH=1 KILN_DECODE_PREFETCH=0" LM_BATCHES=${PF_BATCHES:-1,16} \
      bash $0 lm ;;
  rp)  # a decode step against its CUDA graph alone (scripts/experiments/step_replay.py)
    timeout ${V_TIMEOUT:-300} python scripts/experiments/step_replay.py $OUT/step_replay.json \
      ${STEP_ENGINES:-/tmp/eng-int4h /tmp/eng-bf16} 2>&1 | tail -12 ;;
  l)
    build bf16; build int4 --quant int4-awq
    for e in bf16 int4; do
      kiln bench latency --model /tmp/eng-$e --batch-sizes 1,16 --isl 128 --osl 128 \
        --iterations 3 --no-progress --report-json $OUT/latency-$e.json 2>&1 | tail -3
    done ;;
  fc)  # the fp8 shapes again with enough requests to fill the batch (a 2,048-row engine;
    # the two long shapes capped at 1,024 in flight), reports in $OUT
    shape="--max-seq-len 4096 --max-batch-size 2048 --max-num-tokens 16384"
    if [ "${FC_ENGINE:-fp8b}" = fp8o64b ]; then
      build fp8o64b --quant fp8 --kv-cache-dtype fp8 --activation-scheme outliers --act-outliers 64
    else
      build fp8b --quant fp8 --activation-scheme dynamic --kv-cache-dtype fp8
    fi
    IFS=";" read -ra fc_shapes <<< "${FC_SHAPES:-1000 128 2048 1024;1000 1000 1000 1024;10000 128 128 2048;1000 2048 128 2048}"
    if [ "${FC_ONE_LOAD:-0}" = 1 ]; then  # every shape on one load (bench throughput --cases)
      cases=""
      for r in "${fc_shapes[@]}"; do
        read -r n i o c <<< "$r"; cases="$cases${cases:+,}${n}x${i}x${o}@${c}"
      done
      python -c 'import sys; from kiln.cli import main; sys.exit(main())' \
        bench throughput --model /tmp/eng-${FC_ENGINE:-fp8b} --cases "$cases" \
        --warmup ${WARMUP:-2} --no-progress ${FC_ARGS:-} \
        --report-json "$OUT/throughput-${FC_ENGINE:-fp8b}-{case}.json" 2>&1 | grep -v '^\['
      fc_shapes=()
    fi
    for r in "${fc_shapes[@]}"; do
      read -r n i o c <<< "$r"
      timeout ${FC_TIMEOUT:-150} python -c 'import sys; from kiln.cli import main; sys.exit(main())' \
        bench throughput --model /tmp/eng-${FC_ENGINE:-fp8b} --num-requests $n --isl $i --osl $o \
        --concurrency $c --warmup ${WARMUP:-2} --no-progress ${FC_ARGS:-} \
        --report-json $OUT/throughput-${FC_ENGINE:-fp8b}-$i-$o-$n-$(date +%s).json 2>&1 | tail -3  # a shape twice: two files
    done ;;
  fda)  # the fp8b engine as built and with decode attention's large-batch pick set to
    # FDA_PICK (target programs / warps / blocks a step; f03a598's 1056/4/4), TensorRT-LLM's
    # 128/128 and 2048/128 on each in FDA_ORDER (2026-12-02: 0.838x / 0.772x with 1056/4/2;
    # engines/eng-fp8b carried is that build)
    shape="--max-seq-len 4096 --max-batch-size 2048 --max-num-tokens 16384"
    build fp8b --quant fp8 --activation-scheme dynamic --kv-cache-dtype fp8
    IFS=/ read -r p w n <<< "${FDA_PICK:-1056/4/4}"
    python - /tmp/eng-fp8b /tmp/eng-fp8bx $p $w $n <<'PY'
import hashlib, json, shutil, sys
src, dst, p, w, n = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
shutil.copytree(src, dst, dirs_exist_ok=True)
t = json.load(open(f"{dst}/tuning.json"))
t["kernels"]["decode_attention"].update(target_programs=p, num_warps=w, blocks_per_step=n)
body = json.dumps(t, indent=1).encode()
open(f"{dst}/tuning.json", "wb").write(body)
m = json.load(open(f"{dst}/manifest.json"))
m["files"]["tuning.json"] = {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}
json.dump(m, open(f"{dst}/manifest.json", "w"), indent=1)
PY
    for e in ${FDA_ORDER:-fp8b fp8bx}; do  # each pair of runs about 2.5 minutes
      for r in "10000 128 128" "1000 2048 128"; do
        read -r n i o <<< "$r"
        timeout ${FC_TIMEOUT:-150} python -c 'import sys; from kiln.cli import main; sys.exit(main())' \
          bench throughput --model /tmp/eng-$e --num-requests $n --isl $i --osl $o \
          --concurrency 2048 --warmup 256 --no-progress \
          --report-json $OUT/throughput-$e-$i-$o-$(date +%s).json 2>&1 | tail -1 | cut -c1-200
      done
    done ;;
  fr)  # whole prompts over their own K/V (KILN_FRESH_PREFILL) off and on, same engine and
    # machine, in FR_ORDER; 2048/128 (1,000 requests) and FR_MORE shapes ("n isl osl;...")
    shape="--max-seq-len 4096 --max-batch-size 2048 --max-num-tokens 16384"
    build fp8b --quant fp8 --activation-scheme dynamic --kv-cache-dtype fp8
    IFS=";" read -ra fr_shapes <<< "1000 2048 128${FR_MORE:+;$FR_MORE}"
    for f in ${FR_ORDER:-0 1 1 0}; do
      for r in "${fr_shapes[@]}"; do
        read -r n i o <<< "$r"
        KILN_FRESH_PREFILL=$f timeout ${FC_TIMEOUT:-240} python -c 'import sys; from kiln.cli import main; sys.exit(main())' \
          bench throughput --model /tmp/eng-fp8b --num-requests $n --isl $i --osl $o \
          --concurrency 2048 --warmup 256 --no-progress \
          --report-json $OUT/throughput-fp8-fresh$f-$i-$o-$n-$(date +%s).json 2>&1 | tail -1 | cut -c1-220
      done
    done ;;
  kr)  # the kernel-variant record (kiln.runtime.kernel_record): two loads of the fp8b engine,
    # each with an empty Triton cache; the first compiles one variant at a time and records
    # them, the second compiles the record in threads first; $OUT/kernel-record.jsonl
    shape="--max-seq-len 4096 --max-batch-size 2048 --max-num-tokens 16384"
    build fp8b --quant fp8 --activation-scheme dynamic --kv-cache-dtype fp8
    [ "${KR_KEEP:-0}" = 1 ] || rm -rf /tmp/eng-fp8b/kernel_variants
    for i in 1 2; do
      rm -rf /tmp/triton-kr$i
      TRITON_CACHE_DIR=/tmp/triton-kr$i timeout ${KR_TIMEOUT:-400} python - $i <<'PY'
import json, os, sys, time
t0 = time.perf_counter()
from kiln import LLM
llm = LLM("/tmp/eng-fp8b", progress=False)
out = {"load": int(sys.argv[1]), "seconds": round(time.perf_counter() - t0, 1),
       "kernel_warmup": llm.kernel_warmup, "cuda_graph_capture_s": llm.cuda_graph_capture_s,
       "workers": os.cpu_count(), "commit": os.environ.get("KILN_COMMIT")}
print(json.dumps(out)[:600], flush=True)
with open(os.environ["OUT"] + "/kernel-record.jsonl", "a") as f:
    f.write(json.dumps(out) + "\n")
PY
    done ;;
  dmt)  # decode attention's 18 candidates on the main tier's build cases and on cases in its
    # range (scripts/experiments/decode_main_tier.py; DMT_ARGS=--bf16-kv: a bf16 cache)
    timeout ${V_TIMEOUT:-300} python scripts/experiments/decode_main_tier.py \
      $OUT/decode_main_tier.json ${DMT_ARGS:-} 2>&1 | tail -4 ;;
  prof)  # kernel time of 200 requests at 2048/128 on the fp8b engine (torch.profiler)
    shape="--max-seq-len 4096 --max-batch-size 2048 --max-num-tokens 16384"
    build fp8b --quant fp8 --activation-scheme dynamic --kv-cache-dtype fp8
    timeout ${PROF_TIMEOUT:-150} python scripts/experiments/profile_throughput.py \
      $OUT/profile-fp8-2048-128.json --model /tmp/eng-fp8b --num-requests 200 --isl 2048 \
      --osl 128 --no-progress 2>&1 | tail -28 ;;
  fa) build fp8 --quant fp8 --activation-scheme dynamic --kv-cache-dtype fp8; tput fp8 10000 128 128; tput fp8 1000 2048 128 ;;
  fo)  # fp8 with outlier channels (+ fp8 KV): two throughput shapes and batch-1 latency
    build fp8o --quant fp8 --activation-scheme outliers --kv-cache-dtype fp8
    tput fp8o 10000 128 128; tput fp8o 1000 2048 128
    kiln bench latency --model /tmp/eng-fp8o --batch-sizes 1,16 --isl 128 --osl 128 \
      --iterations 3 --no-progress --report-json $OUT/latency-fp8o.json 2>&1 | tail -3 ;;
  fo64)  # 64 outlier channels (K + 128 GEMM columns), same shapes and latency
    build fp8o64 --quant fp8 --activation-scheme outliers --act-outliers 64 --kv-cache-dtype fp8
    tput fp8o64 10000 128 128; tput fp8o64 1000 2048 128
    kiln bench latency --model /tmp/eng-fp8o64 --batch-sizes 1,16 --isl 128 --osl 128 \
      --iterations 3 --no-progress --report-json $OUT/latency-fp8o64.json 2>&1 | tail -3 ;;
  fo64b)  # 64 outlier channels on a 2,048-row engine against the fp8b engine (fc's), same
    # machine, interleaved: 2048/128 and 128/128 (ab)
    shape="--max-seq-len 4096 --max-batch-size 2048 --max-num-tokens 16384"
    build fp8b --quant fp8 --activation-scheme dynamic --kv-cache-dtype fp8
    build fp8o64b --quant fp8 --kv-cache-dtype fp8 --activation-scheme outliers --act-outliers 64
    ab fp8b fp8o64b ;;
  fod)  # outlier channels in the down projections only (--outlier-modules), same shapes
    build fp8od --quant fp8 --activation-scheme outliers --outlier-modules '*.mlp.down' \
      --kv-cache-dtype fp8
    tput fp8od 10000 128 128; tput fp8od 1000 2048 128 ;;
  fb) build fp8 --quant fp8 --activation-scheme dynamic --kv-cache-dtype fp8; tput fp8 1000 1000 1000; tput fp8 500 128 2048 ;;
  qs)  # the fp8 per-token scale search (--act-scale-search): its quantizers at 0-8 candidates,
    # then 2048/128 and 128/128 on a 2,048-row fp8 + fp8 KV engine built with QS_N candidates
    # against the fp8b engine (fc's), same machine, interleaved
    timeout 300 python -m kiln.bench.quant_bench $OUT/act_search.json search 2>&1 | tail -3
    shape="--max-seq-len 4096 --max-batch-size 2048 --max-num-tokens 16384"
    build fp8b --quant fp8 --activation-scheme dynamic --kv-cache-dtype fp8
    build fp8s --quant fp8 --kv-cache-dtype fp8 --act-scale-search ${QS_N:-4}
    ab fp8b fp8s ;;
  blk)  # fp8 "block" (--activation-scheme block): its GPU tests, torch._scaled_mm with block
    # scales against row-wise and the group quantizers (kiln.bench.block_bench), then 2048/128
    # and 128/128 on a 2,048-row fp8 block + fp8 KV engine against the fp8b engine (fc's)
    timeout 500 python -m pytest -q -m gpu tests/test_fp8_block.py tests/test_quant_gpu.py \
      -k "block" 2>&1 | tail -5 | tee $OUT/tests-block.txt
    timeout 300 python -m kiln.bench.block_bench $OUT/block_kernels.json 2>&1 | tail -3
    shape="--max-seq-len 4096 --max-batch-size 2048 --max-num-tokens 16384"
    build fp8b --quant fp8 --activation-scheme dynamic --kv-cache-dtype fp8
    build fp8blk --quant fp8 --kv-cache-dtype fp8 --activation-scheme block
    ab fp8b fp8blk
    kiln bench latency --model /tmp/eng-fp8blk --batch-sizes 1,16 --isl 128 --osl 128 \
      --iterations 3 --no-progress --report-json $OUT/latency-fp8blk.json 2>&1 | tail -3 ;;
  rb)  # build time: the 2,048-row fp8 + fp8 KV engine built with every kernel timed
    # (--no-tuning-cache), then the same build again (its tuning reused from /tmp/kc);
    # each build's wall time, and the first one's seconds per kernel tuned (phase_s)
    for name in fp8r fp8r2; do
      extra=""; [ $name = fp8r ] && extra="--no-tuning-cache"
      s0=$(date +%s%N)
      kiln build --model $M --output /tmp/eng-$name --device cuda --max-seq-len 4096 \
        --max-batch-size 2048 --max-num-tokens 16384 --quant fp8 --kv-cache-dtype fp8 \
        $extra 2>&1 | grep -E "tuning|built" | cut -c1-200
      echo "$name wall $(( ($(date +%s%N) - s0) / 1000000 )) ms"
      cp /tmp/eng-$name/manifest.json $OUT/manifest-$name.json
      cp /tmp/eng-$name/tuning.json $OUT/tuning-$name.json
    done
    python -c 'import json; t = json.load(open("/tmp/eng-fp8r/tuning.json")); print("phase_s", t["measured"]["phase_s"], "reused", json.load(open("/tmp/eng-fp8r2/tuning.json")).get("reused"))' ;;
  cap)
    build bf16; build bf16kv8 --kv-cache-dtype fp8; build fp8 --quant fp8 --activation-scheme dynamic --kv-cache-dtype fp8
    python - <<'PY' 2>&1 | tail -5
import json, os
import torch
from kiln.llm import LLM
out = {"commit": os.environ.get("KILN_COMMIT"), "device": torch.cuda.get_device_name(),
       "versions": {"torch": torch.__version__}}
for name in ("bf16", "bf16kv8", "fp8"):
    llm = LLM(f"/tmp/eng-{name}", enforce_eager=True)
    tokens = llm.kv_capacity_tokens
    per_seq = -(-2048 // llm.kv.tokens_per_block) * llm.kv.tokens_per_block
    out[name] = {"kv_tokens": tokens, "seqs_2k": tokens // per_seq}
    print(name, out[name], flush=True)
    del llm
    torch.cuda.empty_cache()
out["ratio_kv_fp8_vs_bf16"] = out["bf16kv8"]["seqs_2k"] / out["bf16"]["seqs_2k"]
json.dump(out, open(os.environ["OUT"] + "/kv_capacity.json", "w"), indent=1)
print(out)
PY
    ;;
  esac
done
