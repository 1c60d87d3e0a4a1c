#!/usr/bin/env bash
# GPU checks on N ranks, run from the repository root of a GPU machine:
#   bash scripts/gpu_check.sh [N] [all|tests|tests-gpu|demo|bench|soak]
# N defaults to every GPU of the machine. TRITONEP_SHARED_GPU=1 puts the ranks (default 4) on
# GPU 0: the compiled kernels are checked on real hardware, but nothing can be timed that way.
#   tests      pytest on $TESTS (default tests/), extra pytest arguments in $PYTEST_ARGS
#   tests-gpu  only the tests marked gpu (large shapes, CUDA graphs, NVSHMEM legs)
#   demo       the MoE demo on N ranks, checked against a dense layer
#   bench      the benchmarks of BENCHMARKS.md: normal mode ($NORMAL_TOKENS), low-latency mode
#              ($LL_TOKENS), dispatch and combine beside a GEMM (launched from the host and
#              queued; then queued, the GEMM through cuBLASLt leaving $OVERLAP_CARVEOUT SMs,
#              default 16,24) and, for an even N, both modes across 2 emulated nodes; CSVs,
#              plots and kernel traces, then each kernel's time per phase
#   soak       randomized calls checked against the reference ($SOAK_ARGS: e.g. --calls 2000
#              --modes normal,low_latency,internode,low_latency_internode)
#   all        tests, demo and bench
# Logs, CSVs, plots and traces go to $OUT (default ./out). TEST_LIMIT_S stops pytest (with its
# summary) after that many seconds. A rank still busy after 90 s writes its threads' stacks to
# $OUT/stacks/ (TRITONEP_STACK_DUMP_S; docs/development.md).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${OUT:-out}
export TRITONEP_STACK_DUMP_S=${TRITONEP_STACK_DUMP_S:-90}
export TRITONEP_STACK_DUMP_DIR=${TRITONEP_STACK_DUMP_DIR:-$out/stacks}
shared=${TRITONEP_SHARED_GPU:-0}
if [ "$shared" != 0 ]; then gpus=4; else gpus=$(nvidia-smi -L 2>/dev/null | wc -l); fi
ranks=${1:-$gpus}
what=${2:-all}
mkdir -p "$out"
status=0

wants() { [ "$what" = "$1" ] || { [ "$what" = all ] && [[ " tests demo bench " == *" $1 "* ]]; }; }
run() {  # run NAME COMMAND...: the output into $out/NAME.log, its last lines here
  local name=$1
  shift
  "$@" 2>&1 | tee "$out/$name.log" | { grep -v -i warn || true; } | tail -n "${TAIL:-15}" || status=1
}

echo "$ranks ranks"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'GPUs', torch.cuda.device_count())"
if wants tests || wants tests-gpu; then
  [ "$what" != tests-gpu ] || PYTEST_ARGS="-m gpu ${PYTEST_ARGS:-}"
  per_test=""  # pytest-timeout, where installed: a stuck test fails with its stacks
  python3 -c "import pytest_timeout" 2>/dev/null && per_test="--timeout=${TEST_TIMEOUT_S:-300}"
  run tests timeout -s INT -k 30 "${TEST_LIMIT_S:-0}" python3 -m pytest -v -rfE --tb=short \
    --durations=20 -p no:cacheprovider $per_test ${PYTEST_ARGS:-} ${TESTS:-tests}
fi
if wants demo; then
  run demo python3 -m tritonep.demo --ranks "$ranks"
fi
if wants bench && [ "$shared" != 0 ]; then
  echo "bench: ranks sharing one GPU take turns on it; nothing is timed that way" >&2
  [ "$what" = all ] || status=1
elif wants bench; then
  bench() {  # bench NAME MODE ARGS...: one benchmark, its rows in $out/NAME.csv
    local name=$1
    shift
    run "bench-$name" python3 -m tritonep.bench "$@" --ranks "$ranks" --csv "$out/$name.csv"
  }
  bench normal normal --tokens "${NORMAL_TOKENS:-4096,128}" --iters 20 --copy-combine \
    --plot "$out/normal.png" --trace "$out/trace-normal-{rank}.json"
  bench ll low-latency --tokens "${LL_TOKENS:-128,1,32,256}" --iters 30 \
    --plot "$out/ll.png" --trace "$out/trace-ll-{rank}.json"
  bench overlap overlap --start host,queued
  bench overlap-carveout overlap --start queued --blas cublaslt --carveout "${OVERLAP_CARVEOUT:-16,24}"
  if [ $((ranks % 2)) -eq 0 ]; then  # 2 emulated nodes of N/2 GPUs
    nodes="--gpus-per-node $((ranks / 2))"
    bench internode internode $nodes --tokens 4096 --iters 20
    bench internode-nvshmem internode $nodes --nvshmem --tokens 4096 --iters 20
    bench ll-internode low-latency $nodes --nvshmem --tokens 128 --iters 30
  fi
  for mode in normal ll; do
    ls "$out"/trace-"$mode"-*.json > /dev/null 2>&1 || continue
    run "trace-$mode" python3 -m tritonep.bench trace-summary "$out"/trace-"$mode"-*.json
  done
fi
if [ "$what" = soak ]; then
  run soak python3 -m tritonep.soak --ranks "$ranks" \
    --gpus-per-node $((ranks > 1 ? ranks / 2 : 1)) --progress 250 ${SOAK_ARGS:-}
fi
exit $status
