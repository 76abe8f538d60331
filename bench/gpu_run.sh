#!/usr/bin/env bash
# bench/gpu_run.sh: the one entry point for GPU runs (tests, benchmarks, sanitizers) on the GPU
# machine, run from the repository root there. The verification run, in one device call. On two GPUs
# (nvidia-h200-x2) two lanes run side by side, each a list of jobs on its own
# GPU (on one GPU, one after the other), then DDP
# across both GPUs (torchrun) if time is left. Logs and JSON are packed into
# $OUT/run.tgz (the device tool brings back at most 8 files) with table.md.
#
#   LANE_A="tests" LANE_B="batch churn probe traces demo memcheck_core" bash bench/gpu_run.sh
#
# Jobs (each with its own timeout; see the functions below):
#   tests          every GPU test (pytest -m gpu), one pytest per file (TEST_FILES, TEST_K narrow it;
#                  TEST_ARGS adds pytest options, e.g. -rP for the output of passing tests)
#   bench          gpt2/llama_ckpt (torchmem, native) and kv_generate/vision
#                  (native, expandable, torchmem): one seed
#   churn          the torch.empty churn microbenchmark, four allocators (CHURN_ALLOCATORS), CHURN_ROUNDS rounds
#   probe          bench/gpu_probe.py: driver call costs on this GPU (probe.json; a later lockstep job's
#                  warm-up table prices its calls at them; PROBE_ARGS: its options)
#   busy           bench/vmm_busy_probe.py: the VMM calls with the device idle and busy (do they wait?)
#   traces         native memory-history traces of kv_generate and vision
#   batch          bench/batch_compare.py (torchmem, accelerate, lightning, sweep, forced_oom;
#                  BATCH_METHODS=... picks some)
#   examples       the four examples, short settings
#   demo           `python -m torchmem demo` (the README's main command, GPU path)
#   memcheck_core  compute-sanitizer memcheck: load + allocator + replay tests
#   memcheck_rest  compute-sanitizer memcheck: batch + surface tests
#                  (or memcheck_batch and memcheck_surface, one per lane)
#   micro          the C++ pool microbenchmark (CPU)
#   scene          tests/gpu/stream_safety_scene.py under this build and under the
#                  build in .old/ (a `git archive` of an older commit, carried):
#                  the foreign-stream reader that faulted before the device barrier
#   rounds         gpt2, llama_ckpt, kv_generate, vision (ROUND_WORKLOADS) under native, expandable
#                  and torchmem (ROUND_ALLOCATORS; "torchmem:backend=cuda_malloc" is torchmem with those
#                  options, its own row), ROUNDS rounds (default 2), order rotated each round;
#                  ROUND_STEPS steps cycling through ROUND_SHAPES shapes (default 14 and 4; the first
#                  cycle is the warm-up); ROUND_FRACTION=F runs every process under
#                  torch.cuda.set_per_process_memory_fraction(F); ROUND_KERNEL_TIME=1 adds one profiled
#                  step per shape (--kernel-time: the GPU's own time, which the host's speed does not move)
#   lockstep       bench/lockstep.py per workload (ROUND_WORKLOADS, ROUND_ALLOCATORS, ROUND_STEPS, ROUND_SHAPES,
#                  ROUND_KERNEL_TIME): LOCKSTEP_PER processes per allocator (default 2), alive together, taking
#                  turns step by step, one group per seed in LOCKSTEP_SEEDS (default "1 2"); lockstep.jsonl;
#                  LOCKSTEP_BUDGETS="1.05 1.10": each seed again under those multiples of its peak request,
#                  beside native with no budget (LOCKSTEP_REFERENCE=none leaves it out; LOCKSTEP_PEAK=BYTES, or
#                  "llama_ckpt=BYTES fsdp_accum=BYTES" per workload (one without a word runs its own unconstrained group): the
#                  peak request known from an earlier run, no unconstrained group); T_LOCKSTEP: seconds per
#                  workload (default 420; long runs that resolve the pooled table's 3% line need more)
#                  ROUND_ALLOCATORS may name NAME@S: NAME at S x each drawn batch ("native native@0.75 torchmem"
#                  at a budget native cannot fit: the per-sample table, time per sample at native's largest)
#   peer           PyTorch's test_cuda.py, native vs torchmem (.peer/, carried)
#   host           bench/host_bench.py and bench/offload_bench.py (pinned pool, offload;
#                  OFFLOAD_MODELS, OFFLOAD_KEEP: the --keep fractions, OFFLOAD_ROUNDS: --rounds)
#   timeline       bench/offload_timeline.py (OFFLOAD_MODELS, TIMELINE_KEEP, TIMELINE_PROFILE=1 for
#                  --host-profile): an offload step's time on the GPU and the host, from CUDA events
#                  (host and timeline: OFFLOAD_COPIES="native python" runs each model both ways)
#   ddp            bench/ddp_batch.py on both GPUs (torchrun, NCCL)
#   cusparse       one peer test (PEER_ONE) alone, 3x default, 3x stitch_above=0, once under memcheck
#   share          bench/share_scenario.py (elastic vs static, SHARE_PHASE_S per phase)
#   compile        bench/compile_reduce_overhead.py (reduce-overhead, native vs torchmem; COMPILE_MODES,
#                  COMPILE_BUDGETS="1.05 1.10": also under those multiples of the peak request)
#   fuzz           bench/empty_cache_fuzz.py (test_allocator_fuzz: churn with empty_cache), alone and under load
#   peer_one       the peer tests in PEER_TESTS, each once under torchmem, with durations
#   peer_order     the peer tests in PEER_TESTS (or the file PEER_TESTS_FILE, e.g.
#                  bench/peer_serial_order.txt) in this order in ONE pytest process, natively
#                  (PEER_ORDER_MODE=torchmem: under torchmem): does a failure follow from test order?
#                  MEMPROBE_MODE=watch|steps|history (MEMPROBE_TESTS): bench/peer_memprobe.py logs the device's
#                  memory around the tests into memprobe.jsonl; PEER_ORDER_ARGS: more pytest options (-n 1: one
#                  xdist worker, as the suite's serial phase runs)
#   startup        bench/startup_cost.py (8 processes starting together, beside 4 busy ones)
# DEADLINE_S (default 570) bounds the whole call: DDP runs only if 90 s are left.
set -uo pipefail
START=$(date +%s)
DEADLINE=$(( START + ${DEADLINE_S:-570} ))
FINAL_OUT=${OUT:-/tmp/torchmem-final}
# Logs are written outside $FINAL_OUT and packed into $FINAL_OUT/run.tgz after every job, so a
# call the device tool cuts at its limit still brings back what finished (it returns at most
# 8 files, and a call killed at its limit never reaches a packing at the end).
WORK=$(mktemp -d /tmp/torchmem-run.XXXXXX)
OUT="$WORK/run"; mkdir -p "$OUT"
pack() { tar czf "$FINAL_OUT/run.tgz.part.$BASHPID" -C "$WORK" run 2>/dev/null && mv -f "$FINAL_OUT/run.tgz.part.$BASHPID" "$FINAL_OUT/run.tgz"; }
mkdir -p "$FINAL_OUT"
export PYTHONUNBUFFERED=1
R="$OUT/results.jsonl"
{  # what ran where: the figures mean little without the machine and the versions
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch,sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
} > "$OUT/env.log" 2>&1
python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > "$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; exit 1; }
echo "built in $(( $(date +%s) - START )) s: $(python3 -m torchmem info | tr -d '\n ' | cut -c1-160)"

left() { echo $(( DEADLINE - $(date +%s) )); }
# PIN_CPUS=LIST runs the timed churn and step-time processes under `taskset -c LIST`; NO_ASLR=1 also
# runs them with address-space randomization off (setarch -R). Each process has its own host pace (the
# same meta loop at ~1.1 or ~2.2 us on the same CPU, with either or neither: BENCHMARKS.md, How to
# reproduce); these keep the CPU and layout fixed, they do not remove the bands
pinned() {
  local pre=()
  if [ "${NO_ASLR:-0}" = 1 ]; then
    if setarch "$(uname -m)" -R true 2>/dev/null; then pre=(setarch "$(uname -m)" -R); else echo "NO_ASLR: setarch -R refused here" >&2; fi
  fi
  if [ -n "${PIN_CPUS:-}" ]; then "${pre[@]}" taskset -c "$PIN_CPUS" "$@"; else "${pre[@]}" "$@"; fi
}
# bounded SECONDS: never past the deadline
bounded() { local want=$1; local l; l=$(left); [ "$l" -lt "$want" ] && want=$l; [ "$want" -lt 5 ] && want=5; echo "$want"; }

peer_site() {  # the peer suite's one extra package (expecttest), installed once into /tmp/site
  [ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .peer/wheels/*.whl > /dev/null 2>&1
}

job_tests() {  # one pytest per file, so each file's failures are written out even if a later one hangs
  local f rc
  if [ -d .peer ] && [ -z "${TORCHMEM_TORCH_TEST_CUDA:-}" ]; then
    # PyTorch's TestBlockStateAbsorption under torchmem (tests/gpu/test_gpu_compile.py) needs the peer
    # copy of test_cuda.py and expecttest (a wheel beside it)
    peer_site
    export TORCHMEM_TORCH_TEST_CUDA=$PWD/.peer/test_cuda.py PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  for f in ${TEST_FILES:-tests/gpu/test_*.py}; do
    [ "$(left)" -lt 20 ] && { echo "tests: no time left for $f"; continue; }
    timeout "$(bounded ${T_TESTS:-200})" python3 -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider \
      --durations=5 --timeout=180 ${TEST_ARGS:-} "$f" ${TEST_K:+-k "$TEST_K"} >> "$OUT/tests.log" 2>&1
    rc=$?
    echo "tests $(basename "$f") rc=$rc :: $(tail -1 "$OUT/tests.log" | cut -c1-150)"
  done
}

job_bench() {
  for w in gpt2 llama_ckpt; do for a in torchmem native; do
    timeout 60 python3 bench/gpu_workloads.py --workload $w --allocator $a --steps 16 --seed "${SEED:-1}" --out "$R" >> "$OUT/bench.log" 2>&1
  done; done
  for w in kv_generate vision; do for a in native expandable torchmem; do
    timeout 50 python3 bench/gpu_workloads.py --workload $w --allocator $a --steps 8 --seed "${SEED:-0}" --out "$R" >> "$OUT/bench.log" 2>&1
  done; done
  echo "bench: $(wc -l < "$R") results"
}

job_churn() {  # CHURN_PATTERNS (torchmem/analysis/patterns.py), CHURN_ALLOCATORS, CHURN_ITERS, CHURN_ROUNDS (2); order reversed each round
  local order="${CHURN_ALLOCATORS:-native expandable async torchmem}" round p a
  for round in $(seq 1 "${CHURN_ROUNDS:-2}"); do
    # one unrecorded run first: the first processes of a call have run 1.3-2.3x slower than the
    # same cells later
    timeout 40 python3 bench/churn_microbench.py --allocator native --pattern random --iters 5000 --repeats 1 \
      --seed 0 --out /tmp/churn_warm.jsonl > /dev/null 2>&1
    for p in ${CHURN_PATTERNS:-random}; do for a in $order; do
      [ "$(left)" -lt 20 ] && { echo "churn: no time left for round $round $p $a"; continue; }
      pinned timeout "$(bounded 40)" python3 bench/churn_microbench.py --allocator $a --pattern $p \
        --iters "${CHURN_ITERS:-50000}" --repeats 3 --seed $round --out "$OUT/churn.jsonl" >> "$OUT/churn.log" 2>&1
      pack
    done; done
    order=$(echo $order | tr ' ' '\n' | tac | tr '\n' ' ')
  done
  echo "churn: $(grep -c allocator "$OUT/churn.log") lines"; grep '^{' "$OUT/churn.log" | cut -c1-200
}

job_probe() {  # PROBE_ARGS: more options, e.g. "--live-granules 5000 --evict-mib 64" (Note [Probe conditions])
  timeout 120 python3 bench/gpu_probe.py ${PROBE_ARGS:-} --out "$OUT/probe.json" > "$OUT/probe.log" 2>&1
  echo "probe rc=$?"
}

job_busy() {
  timeout 90 python3 bench/vmm_busy_probe.py --repeats "${BUSY_REPEATS:-10}" --busy-ms "${BUSY_MS:-20}" \
    --out "$OUT/busy.json" > "$OUT/busy.log" 2>&1
  echo "busy rc=$?"; cat "$OUT/busy.log"
}

job_traces() {
  mkdir -p "$OUT/traces"
  for w in kv_generate vision; do
    timeout 60 python3 bench/gpu_workloads.py --workload $w --allocator native --steps 8 --seed 0 \
      --out "$OUT/trace_runs.jsonl" --record-trace "$OUT/traces/trace_${w}.json.gz" >> "$OUT/traces.log" 2>&1
    echo "trace $w rc=$?"
  done
}

job_batch() {
  timeout "$(bounded ${T_BATCH:-330})" python3 bench/batch_compare.py --steps 12 --out "$OUT/batch_compare.jsonl" \
    --methods "${BATCH_METHODS:-torchmem,accelerate,lightning,sweep,forced_oom}" \
    > "$OUT/batch_compare.log" 2>&1
  echo "batch_compare rc=$?"; tail -9 "$OUT/batch_compare.log"
}

job_examples() {
  local ex
  for ex in "gpt2_finetune_budget.py --steps 12" "batched_inference_oom_retry.py" \
            "lightning_example.py --steps 12" "hf_trainer_example.py --steps 12"; do
    echo "== examples/$ex" >> "$OUT/examples.log"
    timeout "$(bounded 120)" python3 examples/$ex >> "$OUT/examples.log" 2>&1
    echo "example ${ex%% *} rc=$?"
  done
}

job_demo() {
  timeout "$(bounded 150)" python3 -m torchmem demo > "$OUT/demo.log" 2>&1
  echo "demo rc=$? :: $(tail -3 "$OUT/demo.log" | tr '\n' ' ' | cut -c1-300)"
}

memcheck() {  # memcheck NAME pytest-args...
  local name=$1; shift
  timeout "$(bounded ${T_MEMCHECK:-300})" compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 \
    python3 -m pytest -v -m gpu -p no:cacheprovider "$@" > "$OUT/memcheck_$name.log" 2>&1
  echo "memcheck $name rc=$? :: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck_$name.log" | sort | uniq -c | tr '\n' ' ') $(tail -1 "$OUT/memcheck_$name.log")"
}
job_memcheck_core() { memcheck core tests/gpu/test_gpu_load.py tests/gpu/test_gpu_allocator.py tests/gpu/test_gpu_replay.py; }
job_memcheck_rest() { memcheck rest tests/gpu/test_gpu_batch.py tests/gpu/test_gpu_surface.py; }
job_memcheck_batch() { memcheck batch tests/gpu/test_gpu_batch.py; }
job_memcheck_surface() { memcheck surface tests/gpu/test_gpu_surface.py; }

job_ddp() {  # both GPUs, whatever lane runs it (the other lane's GPU is shared meanwhile)
  # ddp_batch.py gives each rank its GPU from LOCAL_RANK unless CUDA_VISIBLE_DEVICES is set
  env -u CUDA_VISIBLE_DEVICES NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 timeout "$(bounded 120)" \
    torchrun --standalone --nproc_per_node=2 bench/ddp_batch.py --steps 12 > "$OUT/ddp.log" 2>&1
  echo "ddp rc=$? :: $(tail -3 "$OUT/ddp.log" | tr '\n' ' ')"
}

job_micro() {
  make bench-micro CXX=g++ > "$OUT/microbench.log" 2>&1
  echo "microbench rc=$? :: $(grep -i 'ns' "$OUT/microbench.log" | tail -2 | tr '\n' ' ')"
  make bench-host-micro CXX=g++ >> "$OUT/microbench.log" 2>&1
  echo "host microbench rc=$? :: $(tail -1 "$OUT/microbench.log")"
}

job_scene() {
  for mode in "" record_stream; do
    timeout 120 python3 tests/gpu/stream_safety_scene.py $mode > "$OUT/scene_new_$mode.log" 2>&1
    echo "scene new ${mode:-no_record} rc=$? :: $(tail -2 "$OUT/scene_new_$mode.log" | tr '\n' ' ' | cut -c1-300)"
  done
  [ -d .old ] || return 0
  (cd .old && python3 setup.py build_ext --inplace > "$OUT/old_build.log" 2>&1) || { echo "old build failed"; tail -5 "$OUT/old_build.log"; return 0; }
  PYTHONPATH=$PWD/.old timeout 120 python3 tests/gpu/stream_safety_scene.py > "$OUT/scene_old.log" 2>&1
  echo "scene old rc=$? :: $(grep -m1 -iE 'illegal|error' "$OUT/scene_old.log" | cut -c1-200) $(tail -1 "$OUT/scene_old.log" | cut -c1-200)"
}

job_rounds() {
  local order="${ROUND_ALLOCATORS:-native expandable torchmem}" round w a
  # one unrecorded run first: the first process of a call found the GPU cold (clocks, module loads)
  timeout 60 python3 bench/gpu_workloads.py --workload gpt2 --allocator native --steps 4 --out /tmp/rounds_warm.jsonl > "$OUT/rounds_warm.log" 2>&1
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for w in ${ROUND_WORKLOADS:-gpt2 llama_ckpt kv_generate vision}; do for a in $order; do
      # a run needs ~15-25 s: never start one the deadline would cut, and keep what finished
      [ "$(left)" -lt 40 ] && { echo "rounds: no time left for round $round $w $a"; continue; }
      # a token "torchmem:OPTIONS" is torchmem with --torchmem-conf OPTIONS (its own row: torchmem[OPTIONS])
      pinned timeout "$(bounded 90)" python3 bench/gpu_workloads.py --workload $w --allocator "${a%%:*}" \
        $( [ "$a" != "${a#*:}" ] && echo --torchmem-conf "${a#*:}" ) --steps "${ROUND_STEPS:-14}" \
        --shapes "${ROUND_SHAPES:-4}" --seed "$round" ${ROUND_FRACTION:+--memory-fraction $ROUND_FRACTION} \
        $( [ "${ROUND_KERNEL_TIME:-0}" = 1 ] && echo --kernel-time ) \
        --out "$R" >> "$OUT/rounds.log" 2>&1 || echo "rounds $w $a rc=$?"
      pack
    done; done
    # rotate, not reverse: over as many rounds as allocators each takes every position once (the
    # position has decided more than the allocator: the third of a workload ran 1.18-1.29x slower)
    # (ROUND_TURN=reverse: two rounds in opposite orders put the first and the last allocator at both ends once)
    if [ "${ROUND_TURN:-rotate}" = reverse ]; then
      order=$(echo $order | awk '{for (i = NF; i > 1; i--) printf "%s ", $i; print $1}')
    else
      order=$(echo $order | awk '{for (i = 2; i <= NF; i++) printf "%s ", $i; print $1}')
    fi
  done
  echo "rounds: $(wc -l < "$R") results"
}

lockstep_peak() {  # LOCKSTEP_PEAK for workload $1: BYTES for every workload, or words W=BYTES
  local p
  for p in ${LOCKSTEP_PEAK:-}; do
    case $p in
      *=*) [ "${p%%=*}" = "$1" ] && { echo "${p#*=}"; return; } ;;
      *) echo "$p"; return ;;
    esac
  done
}

job_lockstep() {  # the steps of every allocator side by side in time (bench/lockstep.py says why)
  local w peak
  for w in ${ROUND_WORKLOADS:-gpt2 llama_ckpt kv_generate vision}; do
    [ "$(left)" -lt 60 ] && { echo "lockstep: no time left for $w"; continue; }
    peak=$(lockstep_peak "$w")
    pinned timeout "$(bounded ${T_LOCKSTEP:-420})" python3 bench/lockstep.py --workload "$w" \
      --allocators ${ROUND_ALLOCATORS:-native expandable torchmem} --per-allocator "${LOCKSTEP_PER:-2}" \
      --steps "${ROUND_STEPS:-14}" --shapes "${ROUND_SHAPES:-4}" --seeds ${LOCKSTEP_SEEDS:-1 2} \
      $( [ "${ROUND_KERNEL_TIME:-0}" = 1 ] && echo --kernel-time ) \
      ${LOCKSTEP_BUDGETS:+--budgets $LOCKSTEP_BUDGETS} ${LOCKSTEP_REFERENCE:+--reference $LOCKSTEP_REFERENCE} \
      ${peak:+--peak-request $peak} \
      --out "$OUT/lockstep.jsonl" >> "$OUT/lockstep.log" 2>&1 || echo "lockstep $w rc=$?"
    pack
  done
  # with the probe job's figures from this call, the warm-up table prices calls at this GPU's own costs
  [ -s "$OUT/lockstep.jsonl" ] && python3 bench/lockstep.py table "$OUT/lockstep.jsonl" \
    $( [ -s "$OUT/probe.json" ] && echo --costs "$OUT/probe.json" ${LOCKSTEP_COSTS_COLD:+--costs-cold $LOCKSTEP_COSTS_COLD} )
}

job_peer() {
  [ -d .peer ] || { echo "no .peer folder carried"; return 0; }
  OUT="$OUT/peer" PEER_S=${PEER_S:-400} timeout "$(bounded 480)" bash .peer/run_peer.sh > "$OUT/peer.log" 2>&1
  echo "peer rc=$? :: $(grep -E '^\| (native|torchmem)' "$OUT/peer/peer_compare.md" 2>/dev/null | tr '\n' ' ')"
}

job_host() {  # HOST_BENCH=0: offload only
  if [ "${HOST_BENCH:-1}" != 0 ]; then
    timeout "$(bounded 120)" python3 bench/host_bench.py --out "$OUT/host.json" > "$OUT/host.log" 2>&1
    echo "host_bench rc=$? :: $(grep -E '^fresh pinning' "$OUT/host.log")"
  fi
  local m
  for m in ${OFFLOAD_MODELS:-gpt2 llama}; do for c in ${OFFLOAD_COPIES:-native}; do
    TORCHMEM_OFFLOAD_COPIES=$c timeout "$(bounded 240)" python3 bench/offload_bench.py --model $m \
      ${OFFLOAD_KEEP:+--keep $OFFLOAD_KEEP} ${OFFLOAD_ROUNDS:+--rounds $OFFLOAD_ROUNDS} --out "$OUT/offload_${m}_$c.json" > "$OUT/offload_${m}_$c.log" 2>&1
    echo "offload_bench $m copies=$c rc=$? :: $(grep -E 'step .* ms' "$OUT/offload_${m}_$c.log" | tr -s ' ' | tr '\n' ';')"
  done; done
}

job_timeline() {  # OFFLOAD_COPIES="native python": each model under both (Note [Offload copies])
  local m c
  for m in ${OFFLOAD_MODELS:-llama gpt2}; do for c in ${OFFLOAD_COPIES:-native}; do
    TORCHMEM_OFFLOAD_COPIES=$c timeout "$(bounded 180)" python3 bench/offload_timeline.py --model $m \
      ${TIMELINE_KEEP:+--keep $TIMELINE_KEEP} ${TIMELINE_PROFILE:+--host-profile} \
      --out "$OUT/timeline_${m}_$c.json" > "$OUT/timeline_${m}_$c.log" 2>&1
    echo "offload_timeline $m copies=$c rc=$? ::"; grep -E '^(none|keep)' "$OUT/timeline_${m}_$c.log"
  done; done
}

job_cusparse() {  # the peer test that hit cudaErrorIllegalInstruction once: alone, repeated, under memcheck
  [ -d .peer ] || { echo "no .peer folder carried"; return 0; }
  local t=".peer/test_cuda.py::TestCuda::${PEER_ONE:-test_cusparse_multiple_threads_same_device}" i conf
  peer_site
  for conf in "" "stitch_above=0"; do for i in $(seq 1 "${CUSPARSE_RUNS:-3}"); do
    TORCHMEM_CONF=$conf PYTHONPATH=/tmp/site:$PWD/.peer/tm_site TORCHMEM_PEER=1 timeout "$(bounded 90)" \
      python3 -m pytest "$t" -c .peer/pytest.ini --rootdir .peer -q -p no:cacheprovider >> "$OUT/cusparse.log" 2>&1
    echo "cusparse conf=${conf:-default} run $i rc=$? :: $(grep -m1 -iE 'illegal|error:' "$OUT/cusparse.log" | cut -c1-160)"
  done; done
  PYTHONPATH=/tmp/site:$PWD/.peer/tm_site TORCHMEM_PEER=1 timeout "$(bounded 200)" compute-sanitizer --tool memcheck \
    --target-processes all --error-exitcode 9 python3 -m pytest "$t" -c .peer/pytest.ini --rootdir .peer -q \
    -p no:cacheprovider > "$OUT/cusparse_memcheck.log" 2>&1
  echo "cusparse memcheck rc=$? :: $(grep -E 'ERROR SUMMARY' "$OUT/cusparse_memcheck.log" | sort | uniq -c | tr '\n' ' ')"
}

job_share() {  # SHARE_VARIANTS: ';'-separated extra arguments, one scenario each (default: one, none)
  local i=0 v
  IFS=';' read -ra variants <<< "${SHARE_VARIANTS:-}"
  [ ${#variants[@]} -eq 0 ] && variants=("")
  for v in "${variants[@]}"; do
    i=$((i + 1))
    timeout "$(bounded 260)" python3 bench/share_scenario.py --phase-s "${SHARE_PHASE_S:-12}" $v \
      --out "$OUT/share_$i.json" > "$OUT/share_$i.log" 2>&1
    echo "share [$v] rc=$?"; tail -4 "$OUT/share_$i.log"
  done
}

job_fuzz() {  # bench/empty_cache_fuzz.py (test_allocator_fuzz): FUZZ_RUNS, ';'-separated argument sets
  local v
  IFS=';' read -ra runs <<< "${FUZZ_RUNS:-"--allocator native;--allocator torchmem;--allocator native --load 4;--allocator torchmem --load 4"}"
  for v in "${runs[@]}"; do
    [ "$(left)" -lt 30 ] && { echo "fuzz: no time left for [$v]"; continue; }
    timeout "$(bounded 90)" python3 bench/empty_cache_fuzz.py $v --out "$OUT/fuzz.jsonl" >> "$OUT/fuzz.log" 2>&1 \
      || echo "fuzz [$v] rc=$?"
    echo "[$v] $(tail -1 "$OUT/fuzz.log" | cut -c1-600)"
  done
}

job_startup() {  # bench/startup_cost.py: 8 processes starting at once, native / torchmem / monitor off
  timeout "$(bounded 150)" python3 bench/startup_cost.py --procs "${STARTUP_PROCS:-8}" --load "${STARTUP_LOAD:-4}" \
    --out "$OUT/startup.jsonl" > "$OUT/startup.log" 2>&1
  echo "startup rc=$?"; cat "$OUT/startup.log" | cut -c1-300
}

job_peer_one() {  # PEER_TESTS (space-separated Class::test), each once under torchmem, with its duration
  [ -d .peer ] || { echo "no .peer folder carried"; return 0; }
  local t
  peer_site
  for t in ${PEER_TESTS:-}; do
    PYTHONPATH=/tmp/site:$PWD/.peer/tm_site TORCHMEM_PEER=1 timeout "$(bounded 90)" python3 -m pytest \
      ".peer/test_cuda.py::$t" -c .peer/pytest.ini --rootdir .peer -q -p no:cacheprovider --durations=3 \
      >> "$OUT/peer_one.log" 2>&1
    echo "peer_one $t rc=$? :: $(grep -E '^[0-9.]+s call' "$OUT/peer_one.log" | tail -1)"
  done
}

job_peer_order() {
  [ -d .peer ] || { echo "no .peer folder carried"; return 0; }
  local t ids=()
  peer_site
  # PEER_TESTS_FILE: the order from a file (one Class::test per line), where it is too long for a command
  for t in ${PEER_TESTS:-} $( [ -n "${PEER_TESTS_FILE:-}" ] && grep -v "^#" "$PEER_TESTS_FILE" ); do
    ids+=(".peer/test_cuda.py::$t")
  done
  local tm=(); [ "${PEER_ORDER_MODE:-native}" = torchmem ] && tm=(env TORCHMEM_PEER=1)
  # MEMPROBE_MODE / MEMPROBE_TESTS: log the device's memory around the tests (bench/peer_memprobe.py)
  local probe=(); [ -n "${MEMPROBE_MODE:-}" ] && probe=(-p peer_memprobe)
  "${tm[@]}" env PYTHONPATH=/tmp/site:$PWD/.peer/tm_site:$PWD/bench MEMPROBE_OUT="${MEMPROBE_MODE:+$OUT/memprobe.jsonl}" \
    PYTORCH_TESTING_DEVICE_ONLY_FOR=cuda timeout "$(bounded 120)" python3 -m pytest "${ids[@]}" \
    -c .peer/pytest.ini --rootdir .peer -rfE -q -p no:cacheprovider "${probe[@]}" ${PEER_ORDER_ARGS:-} > "$OUT/peer_order.log" 2>&1
  echo "peer_order ${PEER_ORDER_MODE:-native} rc=$? :: $(grep -E '^(FAILED|ERROR)|passed|failed' "$OUT/peer_order.log" | tr '\n' ' ' | cut -c1-400)"
}

job_fsdp() {  # bench/fsdp_workload.py sweep, one rank (FSDP_ARGS: its options; FSDP_BUDGET_ARGS: a second sweep)
  timeout "$(bounded ${T_FSDP:-240})" python3 bench/fsdp_workload.py sweep --nproc 1 ${FSDP_ARGS:-} \
    --out "$OUT/fsdp.jsonl" > "$OUT/fsdp.log" 2>&1
  echo "fsdp rc=$?"; tail -12 "$OUT/fsdp.log"
  if [ -n "${FSDP_BUDGET_ARGS:-}" ]; then  # a second sweep: x the peak request at a fixed micro-batch
    timeout "$(bounded ${T_FSDP:-240})" python3 bench/fsdp_workload.py sweep --nproc 1 $FSDP_BUDGET_ARGS \
      --out "$OUT/fsdp.jsonl" > "$OUT/fsdp_budget.log" 2>&1
    echo "fsdp budgets rc=$?"; tail -12 "$OUT/fsdp_budget.log"
  fi
}

job_compile() {
  timeout "$(bounded ${T_COMPILE:-300})" python3 bench/compile_reduce_overhead.py --rounds "${COMPILE_ROUNDS:-2}" \
    ${COMPILE_MODES:+--modes $COMPILE_MODES} ${COMPILE_BUDGETS:+--budgets $COMPILE_BUDGETS} --out "$OUT/compile.json" \
    > "$OUT/compile.log" 2>&1
  echo "compile rc=$?"; tail -8 "$OUT/compile.log"
}

lane() {  # lane GPU JOBS...
  export CUDA_VISIBLE_DEVICES=$1; shift
  local job
  for job in "$@"; do
    [ "$(left)" -lt 15 ] && { echo "[gpu $CUDA_VISIBLE_DEVICES] no time left for $job"; continue; }
    local t0=$(date +%s)
    "job_$job" 2>&1 | sed "s/^/[gpu $CUDA_VISIBLE_DEVICES $job] /"
    echo "[gpu $CUDA_VISIBLE_DEVICES] $job took $(( $(date +%s) - t0 )) s"
    pack
  done
}

# Lane B's default list runs only when neither lane is named: a call that names LANE_A alone
# means those jobs only (the default list after them cost whole calls their deadline).
if [ -z "${LANE_A+set}" ]; then LANE_B=${LANE_B-bench churn micro memcheck_core batch}; else LANE_B=${LANE_B-}; fi
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$GPUS" -ge 2 ]; then
  lane 0 ${LANE_A-tests} > "$OUT/lane_a.txt" 2>&1 &
  lane 1 $LANE_B > "$OUT/lane_b.txt" 2>&1 &
  wait
else  # one GPU: the lanes run one after the other, so timings never overlap
  lane 0 ${LANE_A-tests} > "$OUT/lane_a.txt" 2>&1
  lane 0 $LANE_B > "$OUT/lane_b.txt" 2>&1
fi
cat "$OUT/lane_a.txt" "$OUT/lane_b.txt"
if [ "${DDP:-1}" = "1" ] && [ "$(left)" -gt 90 ] && [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  job_ddp
fi
[ -s "$R" ] && python3 bench/bench_table.py "$R" > "$OUT/table.md" 2>&1 && cat "$OUT/table.md"
echo "total $(( $(date +%s) - START )) s"
pack && rm -rf "$WORK"
