#!/usr/bin/env bash
# One GPU session on the lent machine (run from the repo root there):
# build torchmem, run the GPU tests, then optional stages, logging under $OUT.
#   tools/gpu_session.sh [tests] [sanitizer] [bench] [batch] [ddp] ...
# Each stage's log is $OUT/<stage>.log; a summary line per stage goes to stdout.
set -uo pipefail
OUT=${OUT:-/tmp/torchmem-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests)

{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch,sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"

start=$(date +%s)
if ! python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > "$OUT/build.log" 2>&1; then
  echo "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
python3 -m torchmem info | tr -d '\n' ; echo

run_stage() {
  local name=$1; shift
  local t0=$(date +%s)
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "stage $name: rc=$rc, $(( $(date +%s) - t0 )) s :: $(tail -1 "$OUT/$name.log")"
}

for stage in "${stages[@]}"; do
  case $stage in
    tests) run_stage tests python3 -m pytest -q -m gpu -x --timeout=300 -p no:cacheprovider tests ;;
    alltests) run_stage alltests python3 -m pytest -q -p no:cacheprovider --timeout=300 tests ;;
    sanitizer) run_stage sanitizer compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 \
                 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu ;;
    bench) run_stage bench bash bench/run_gpu_bench.sh "$OUT/bench" ;;
    demo) run_stage demo python3 -m torchmem demo ;;
    *) if [ -f "$stage" ]; then run_stage "$(basename "$stage" .sh)" bash "$stage"; else echo "unknown stage $stage"; fi ;;
  esac
done
