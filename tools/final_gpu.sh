#!/usr/bin/env bash
# The verification run on a two-GPU machine (nvidia-h200-x2), in one call:
#   lane A (GPU 0): every GPU test;
#   lane B (GPU 1): the benchmark subset, the churn microbenchmark, the batch-size
#                   comparison and compute-sanitizer memcheck over GPU tests;
#   then DDP across both GPUs (torchrun). Logs and JSON under $OUT.
# Lanes have their own time limits so the whole run ends inside one device call.
set -uo pipefail
FINAL_OUT=${OUT:-/tmp/torchmem-final}
# Everything goes to one folder that is packed at the end (the device tool
# brings back at most 8 files).
OUT="$FINAL_OUT/run"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T=${T_LANE:-330}
python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > "$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; exit 1; }
echo "built: $(python3 -m torchmem info | tr -d '\n ' | cut -c1-200)"

lane_a() {
  CUDA_VISIBLE_DEVICES=0 timeout "${T_TESTS:-380}" python3 -m pytest -v -rfE -m gpu -p no:cacheprovider \
    --timeout=200 tests > "$OUT/tests.log" 2>&1
  echo "lane A tests rc=$? :: $(tail -1 "$OUT/tests.log")"
}

lane_b() {
  export CUDA_VISIBLE_DEVICES=1
  local end=$(( $(date +%s) + T ))
  local R="$OUT/results.jsonl"
  (make bench-micro CXX=g++ > "$OUT/microbench.log" 2>&1; echo "microbench rc=$?" >> "$OUT/microbench.log") &
  for w in gpt2 llama_ckpt; do for a in torchmem native; do
    timeout 60 python3 bench/gpu_workloads.py --workload $w --allocator $a --steps 16 --seed 1 --out "$R" >> "$OUT/bench.log" 2>&1
  done; done
  TORCHMEM_CONF=alias_reclaim=0 timeout 60 python3 bench/gpu_workloads.py --workload gpt2 --allocator torchmem \
    --steps 16 --seed 1 --out "$OUT/no_alias.jsonl" >> "$OUT/bench.log" 2>&1
  for w in kv_generate vision; do for a in native expandable torchmem; do
    timeout 50 python3 bench/gpu_workloads.py --workload $w --allocator $a --steps 8 --seed 0 --out "$R" >> "$OUT/bench.log" 2>&1
  done; done
  for a in native expandable async torchmem; do
    timeout 40 python3 bench/churn_microbench.py --allocator $a --iters 50000 --repeats 3 --out "$R" >> "$OUT/bench.log" 2>&1
  done
  echo "lane B bench: $(wc -l < "$R") results, $(( end - $(date +%s) )) s left"
  timeout 100 compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_load.py \
    "tests/gpu/test_gpu_allocator.py::test_limit_gives_torch_oom_error_and_recovers" \
    "tests/gpu/test_gpu_allocator.py::test_eight_threads_write_and_check_cookies" > "$OUT/sanitizer.log" 2>&1
  echo "lane B sanitizer rc=$? :: $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/sanitizer.log" | tail -2 | tr '\n' ' ')"
  local left=$(( end - $(date +%s) ))
  [ $left -gt 30 ] && timeout $left python3 bench/batch_compare.py --methods torchmem,accelerate,lightning,sweep \
    --steps 8 --out "$OUT/batch_compare.jsonl" > "$OUT/batch_compare.log" 2>&1
  echo "lane B batch_compare rc=$? ($left s given)"
  wait
}

lane_a & lane_b & wait
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 timeout 120 torchrun --standalone --nproc_per_node=2 \
    bench/ddp_batch.py --steps 12 > "$OUT/ddp.log" 2>&1
  echo "ddp rc=$? :: $(tail -3 "$OUT/ddp.log" | tr '\n' ' ')"
fi
python3 bench/bench_table.py "$OUT/results.jsonl" > "$OUT/table.md" 2>&1; cat "$OUT/table.md"
tar czf "$FINAL_OUT/run.tgz" -C "$FINAL_OUT" run && cp "$OUT/table.md" "$FINAL_OUT/" && rm -rf "$OUT"
