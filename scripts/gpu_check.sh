#!/usr/bin/env bash
# Every GPU check in one call: the GPU test suite, the demo, then the benchmarks, on N ranks.
# Run from the repository root on a GPU machine: bash scripts/gpu_check.sh [N] [tests|bench|all]
# N defaults to every GPU of the machine. Logs and CSVs go to $OUT (when set) or ./out.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
ranks=${1:-$(nvidia-smi -L | wc -l)}
what=${2:-all}
out=${OUT:-out}
mkdir -p "$out"
status=0
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
if [ "$what" != bench ]; then
  # --timeout (pytest-timeout, on the GPU image): a stuck test fails with its stacks instead of
  # eating the call's time limit.
  timeout "${TEST_LIMIT_S:-330}" python3 -m pytest -v -rfE --tb=short --timeout=200 -p no:cacheprovider \
    ${TESTS:-tests} 2>&1 | tee "$out/gpu_tests.log" | grep -E "FAILED|ERROR|passed|failed" || status=1
  timeout 60 python3 -m tritonep.demo --ranks "$ranks" 2>&1 | tee "$out/demo.log" | tail -3 || status=1
fi
if [ "$what" != tests ]; then
  timeout "${BENCH_LIMIT_S:-200}" python3 -m tritonep.bench normal --ranks "$ranks" \
    --tokens "${NORMAL_TOKENS:-4096}" --sms "${NORMAL_SMS:-24}" --chunk "${NORMAL_CHUNK:-8}" \
    --ring "${NORMAL_RING:-128}" --iters 20 --csv "$out/normal.csv" 2>&1 \
    | tee "$out/bench_normal.log" | grep -v -i warn | tail -12 || status=1
  [ -n "${SKIP_LL:-}" ] || timeout "${LL_LIMIT_S:-150}" python3 -m tritonep.bench low-latency --ranks "$ranks" --tokens "${LL_TOKENS:-128,1,32,256}" \
    --iters 30 --csv "$out/ll.csv" 2>&1 | tee "$out/bench_ll.log" | grep -v -i warn | tail -8 || status=1
fi
exit $status
