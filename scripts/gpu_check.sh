#!/usr/bin/env bash
# Every GPU check in one call: the GPU test suite, the demo, then the benchmarks, on N ranks.
# Run from the repository root on a GPU machine: bash scripts/gpu_check.sh [N] [tests|bench|all]
# Logs and CSVs go to $OUT (when set) or ./out.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
ranks=${1:-4}
what=${2:-all}
out=${OUT:-out}
mkdir -p "$out"
status=0
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
if [ "$what" != bench ]; then
  # --timeout (pytest-timeout, on the GPU image): a stuck test fails with its stacks instead of
  # eating the call's time limit.
  timeout 480 python3 -m pytest -v --tb=short --timeout=150 -p no:cacheprovider tests 2>&1 \
    | tee "$out/gpu_tests.log" | grep -E "FAILED|ERROR|passed|failed" || status=1
  python3 -m tritonep.demo --ranks "$ranks" 2>&1 | tee "$out/demo.log" || status=1
fi
if [ "$what" != tests ]; then
  timeout 200 python3 -m tritonep.bench low-latency --ranks "$ranks" --tokens 128,1,8,32,64,256 \
    --csv "$out/ll.csv" 2>&1 | tee "$out/bench_ll.log" | grep -v -i warn | tail -8 || status=1
fi
exit $status
