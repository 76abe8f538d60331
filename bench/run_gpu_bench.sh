#!/usr/bin/env bash
# run_gpu_bench.sh: the H200 benchmark matrix, every workload x allocator in its
# own process (an allocator is chosen once per process), then the churn
# microbenchmark, then a Markdown table of the results.
#
#   bench/run_gpu_bench.sh RESULTS_DIR [REPEATS]
#
# REPEATS (default 1) runs the whole matrix that many times with different seeds
# (SEED0 + 0, 1, ...; SEED0 defaults to 0) so the table can show run-to-run
# spread. To stay under a per-command time limit, run it once per seed into
# separate directories (SEED0=1 ...) and table the concatenation:
#   cat DIR*/results.jsonl > all.jsonl && python3 bench/bench_table.py all.jsonl STEPS (env, default 20) sets the steps
# per run; with the defaults the matrix takes ~6 minutes on an H200.
# TRACES=1 also records native traces of each workload under RESULTS_DIR/traces.
set -u
OUT_DIR=${1:?usage: bench/run_gpu_bench.sh RESULTS_DIR [REPEATS]}
REPEATS=${2:-1}
STEPS=${STEPS:-20}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT_DIR"
RESULTS="$OUT_DIR/results.jsonl"
LOG="$OUT_DIR/log.txt"
: > "$LOG"

for repeat in $(seq 1 "$REPEATS"); do
  seed=$((${SEED0:-0} + repeat - 1))
  for workload in gpt2 llama_ckpt kv_generate vision; do
    for allocator in native expandable async torchmem; do
      echo "== $workload / $allocator / seed $seed" | tee -a "$LOG"
      "$PYTHON" "$HERE/gpu_workloads.py" --workload "$workload" --allocator "$allocator" \
        --steps "$STEPS" --seed "$seed" --out "$RESULTS" >> "$LOG" 2>&1 \
        || echo "   FAILED (see $LOG)" | tee -a "$LOG"
    done
  done
  for allocator in native expandable async torchmem; do
    echo "== churn / $allocator" | tee -a "$LOG"
    "$PYTHON" "$HERE/churn_microbench.py" --allocator "$allocator" --iters 100000 --repeats 3 \
      --seed "$seed" --out "$RESULTS" >> "$LOG" 2>&1 || echo "   FAILED (see $LOG)" | tee -a "$LOG"
  done
done

if [ "${TRACES:-0}" = "1" ]; then
  mkdir -p "$OUT_DIR/traces"
  for workload in kv_generate vision; do
    "$PYTHON" "$HERE/gpu_workloads.py" --workload "$workload" --allocator native --steps "$STEPS" \
      --seed 0 --out "$OUT_DIR/trace_runs.jsonl" --record-trace "$OUT_DIR/traces/trace_${workload}.json.gz" \
      >> "$LOG" 2>&1 || echo "   trace of $workload FAILED (see $LOG)" | tee -a "$LOG"
  done
fi

"$PYTHON" "$HERE/bench_table.py" "$RESULTS" | tee "$OUT_DIR/table.md"
