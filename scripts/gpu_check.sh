#!/usr/bin/env bash
# Every GPU check in one call: the GPU test suite, the demo, then the benchmarks, on N ranks.
# Run from the repository root on a GPU machine:
#   bash scripts/gpu_check.sh [N] [tests|tests-core|tests-layers|tests-a|-b|-c|-d|tests-par|tests-gpu|tests-soak|bench|tune|ab|soak|soak-par|host|probe|a2a|quantize|all]
# N defaults to every GPU of the machine. Logs and CSVs go to $OUT (when set) or ./out.
# The whole suite compiles many kernel variants and does not fit one call of the 10-minute
# device limit: on GPUs of their own, 2 ranks took more than 9 minutes for tests-core alone
# (2x H100, 2026-11-25). Split it over tests-a to tests-d (tests-par runs the four at once,
# sharing the CPUs for compiling), and carry the compiled
# kernels from call to call: every call leaves Triton's cache in $OUT/00-triton-cache.tar.gz
# (in parts 00-triton-cache.tar.gz.part00, part01, ... when larger than a file that a call
# brings back); copy it to .triton-cache.tar.gz in the repository root, or the parts into
# .triton-cache.d/ (both ignored by git), and pass that path to the next call (the device
# tool's carry): it is unpacked into .triton-cache/ and that call compiles only what the
# earlier ones did not (a cache entry names its files by absolute path, so the repository must
# sit at the same path on every machine, as it does on the device).
# Every call also leaves all its logs, CSVs, plots and traces in $OUT/00-results.tar.gz, since a
# call brings back at most 8 files; pytest prints its durations, and a run that hits its time
# limit is interrupted (SIGINT) so that its failures are still summarized.
# On a machine with one GPU, TRITONEP_SHARED_GPU=1 runs every rank on GPU 0 (CUDA IPC between
# the rank processes): the compiled kernels are checked on real hardware, N defaults to 4;
# timings mean nothing then, so bench refuses to run. SKIP_DEMO=1 leaves the demo out of tests.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ "${TRITONEP_SHARED_GPU:-0}" != 0 ]; then gpus=4; else gpus=$(nvidia-smi -L | wc -l); fi
ranks=${1:-$gpus}
what=${2:-all}
out=${OUT:-out}
mkdir -p "$out"
status=0
limit() {
  # A step's time limit, cut to what is left of the call (CALL_LIMIT_S, default 570 s, under
  # the device's 10 minutes) less 25 s for packing, so that a call that runs long still packs
  # its results instead of being killed with them.
  local left=$(( ${CALL_LIMIT_S:-570} - SECONDS - 25 ))
  [ "$left" -gt 1 ] || left=1
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}
export TRITON_CACHE_DIR="$PWD/.triton-cache"
# A rank task running past 90 s writes its threads' stacks to $out/stacks/ (compiling or waiting?).
export TRITONEP_STACK_DUMP_S=${TRITONEP_STACK_DUMP_S:-90} TRITONEP_STACK_DUMP_DIR=${TRITONEP_STACK_DUMP_DIR:-$out/stacks}
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .triton-cache.tar.gz ]; then
  tar xzf .triton-cache.tar.gz -C "$TRITON_CACHE_DIR" && echo "triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) entries carried"
fi
if [ -d .triton-cache.d ]; then
  cat .triton-cache.d/*part* | tar xz -C "$TRITON_CACHE_DIR" && echo "triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) entries carried in parts"
fi
pack() {
  # 00- names sort first among the files a call brings back.
  tar czf /tmp/00-results.tar.gz -C "$out" --exclude='00-*' . && mv /tmp/00-results.tar.gz "$out/"
  # PACK_CACHE=0: the call's machine stays warm and keeps .triton-cache for the next call;
  # packing a full cache (1.4 GB after the GPU tests on 4 ranks) takes minutes.
  [ "${PACK_CACHE:-1}" != 0 ] || { ls -l "$out"/00-*; return; }
  local cache="$out/00-triton-cache.tar.gz"
  rm -f "$cache".part*  # parts of an earlier run in the same call would join the new ones
  tar czf "$cache" -C "$TRITON_CACHE_DIR" .
  if [ "$(stat -c %s "$cache")" -gt 16000000 ]; then
    # Over what a call brings back: keep what a cache hit reads (binaries, metadata, launchers).
    # Kernels linked with NVSHMEM are recognized from their binaries (nvshmem.py), so a cache
    # without PTX still gets their modules initialized.
    tar czf "$cache" -C "$TRITON_CACHE_DIR" --exclude='*.ptx' \
      --exclude='*.ttir' --exclude='*.ttgir' --exclude='*.llir' --exclude='*.source' .
  fi
  if [ "$(stat -c %s "$cache")" -gt 16000000 ]; then
    # Still over: parts that each come back (.triton-cache.d/ takes them in the next call).
    split -b 15000000 -d "$cache" "$cache.part" && rm "$cache"
  fi
  ls -l "$out"/00-*
}
trap pack EXIT
nvidia-smi -L
# A warm machine keeps processes an earlier call left (ranks of a test stopped by its limit):
# name them, since their kernels would share the GPUs with this call's.
left=$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null)
[ -z "$left" ] || { echo "processes already on the GPUs:"; echo "$left"; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
# The suite in four parts (every file that starts ranks or touches a GPU is in one of them).
TESTS_A="tests/test_heap.py tests/test_layout.py tests/test_normal.py tests/test_launch.py tests/test_launcher.py tests/test_torch_backend.py tests/test_validation.py"
TESTS_B="tests/test_low_latency.py tests/test_api.py tests/test_trace.py tests/test_demo.py tests/test_fp8.py tests/test_shrink.py"
TESTS_C="tests/test_layers.py tests/test_deep_ep.py tests/test_groups.py tests/test_examples.py"
TESTS_D="tests/test_internode.py tests/test_reliability.py"
case "$what" in
  tests-core) TESTS=${TESTS:-"tests/test_heap.py tests/test_layout.py tests/test_normal.py tests/test_low_latency.py tests/test_api.py tests/test_demo.py"}; what=tests ;;
  tests-layers) TESTS=${TESTS:-"tests/test_layers.py tests/test_deep_ep.py tests/test_groups.py tests/test_internode.py tests/test_trace.py tests/test_reliability.py"}; what=tests ;;
  tests-a) TESTS=${TESTS:-$TESTS_A}; what=tests ;;
  tests-b) TESTS=${TESTS:-$TESTS_B}; what=tests ;;
  tests-c) TESTS=${TESTS:-$TESTS_C}; what=tests ;;
  tests-d) TESTS=${TESTS:-$TESTS_D}; what=tests ;;
  # The tests that need GPUs (marked gpu: the large shapes, graphs, NVSHMEM legs, a GPU per
  # rank), one after another; the rest of the suite also runs on CPU ranks. The 50 took
  # 315 s on 4x H200 with a warm machine's kernels (2026-11-26, a share of the cores per rank).
  tests-gpu) TESTS=${TESTS:-tests}; PYTEST_ARGS="-m gpu ${PYTEST_ARGS:-}"; what=tests ;;
esac
per_test=""
# --timeout (pytest-timeout, on the GPU image): a stuck test fails with its stacks instead of
# eating the call's time limit.
python3 -c "import pytest_timeout" 2>/dev/null && per_test="--timeout=${TEST_TIMEOUT_S:-200}"
outcome() {  # a pytest log's verdict lines; fails when it has none
  grep -E "FAILED|ERROR|passed|failed|skipped|Interrupted" "$@"
}
pytest_cmd() {
  timeout -s INT -k 30 "$(limit "${TEST_LIMIT_S:-330}")" python3 -m pytest -v -rfE --tb=short \
    --durations=30 $per_test -p no:cacheprovider ${PYTEST_ARGS:-} "$@"
}
if [ "$what" = tests ] || [ "$what" = all ]; then
  pytest_cmd ${TESTS:-tests} 2>&1 | tee "$out/gpu_tests.log" | outcome || status=1
fi
if [ "$what" = tests-par ]; then
  # The four parts at once, on the same GPUs: compiling is most of a fresh machine's time and
  # each part compiles its own kernels, so the parts share the CPUs instead of queueing. The
  # ranks of different parts take turns on a GPU, so nothing here is a timing.
  threads=$(( $(nproc) / (4 * ranks) ))
  for part in A B C D; do
    eval "files=\$TESTS_$part"
    TRITONEP_RANK_THREADS=$(( threads > 0 ? threads : 1 )) pytest_cmd $files > "$out/gpu_tests-$part.log" 2>&1 &
  done
  wait
  for part in A B C D; do
    echo "== part $part"; outcome "$out/gpu_tests-$part.log" || status=1
  done
fi
if [ "$what" = tests ] || [ "$what" = tests-par ] || [ "$what" = all ]; then
  [ -n "${SKIP_DEMO:-}" ] || timeout "$(limit 60)" python3 -m tritonep.demo --ranks "$ranks" 2>&1 | tee "$out/demo.log" | tail -3 || status=1
fi
if [ "${TRITONEP_SHARED_GPU:-0}" != 0 ]; then
  case "$what" in
    all) what=tests ;;
    bench) echo "bench: ranks sharing one GPU take turns on it; no timing is taken that way" >&2
           exit 1 ;;
  esac
fi
bench_modes=" ${BENCH_MODES:-normal ll internode} "  # which benchmarks bench runs
if [ "$what" = bench ] || [ "$what" = all ]; then
  [[ $bench_modes != *" normal "* ]] || timeout "$(limit "${BENCH_LIMIT_S:-200}")" python3 -m tritonep.bench normal --ranks "$ranks" \
    --tokens "${NORMAL_TOKENS:-4096}" --sms "${NORMAL_SMS:-24}" --chunk "${NORMAL_CHUNK:-16}" \
    --ring "${NORMAL_RING:-128}" --iters 20 --csv "$out/normal.csv" --plot "$out/normal.png" --trace "$out/trace-normal-{rank}.json" 2>&1 \
    | tee "$out/bench_normal.log" | grep -v -i warn | tail -12 || status=1
  [[ $bench_modes != *" ll "* ]] || timeout "$(limit "${LL_LIMIT_S:-150}")" python3 -m tritonep.bench low-latency --ranks "$ranks" --tokens "${LL_TOKENS:-128,1,32,256}" \
    --iters 30 --csv "$out/ll.csv" --plot "$out/ll.png" --trace "$out/trace-ll-{rank}.json" 2>&1 | tee "$out/bench_ll.log" | grep -v -i warn | tail -8 || status=1
  if [ "$ranks" -ge 2 ] && [ $((ranks % 2)) -eq 0 ] && [[ $bench_modes == *" internode "* ]]; then
    timeout "$(limit "${INTERNODE_LIMIT_S:-150}")" python3 -m tritonep.bench internode --ranks "$ranks" \
      --gpus-per-node $((ranks / 2)) --tokens "${INTERNODE_TOKENS:-4096}" --iters 20 \
      --csv "$out/internode.csv" 2>&1 | tee "$out/bench_internode.log" | grep -v -i warn | tail -4 || status=1
    # The same with NVSHMEM puts on the network leg (the cluster's path, here over NVLink).
    timeout "$(limit "${INTERNODE_LIMIT_S:-150}")" python3 -m tritonep.bench internode --ranks "$ranks" \
      --gpus-per-node $((ranks / 2)) --nvshmem --tokens "${INTERNODE_TOKENS:-4096}" --iters 20 \
      --csv "$out/internode_nvshmem.csv" 2>&1 | tee "$out/bench_internode_nvshmem.log" | grep -v -i warn | tail -4 || status=1
    # Low-latency across 2 emulated nodes: NVSHMEM puts to the other node, stores within.
    timeout "$(limit "${LL_INTERNODE_LIMIT_S:-120}")" python3 -m tritonep.bench low-latency --ranks "$ranks" \
      --gpus-per-node $((ranks / 2)) --nvshmem --tokens 128 --iters 30 \
      --csv "$out/ll_internode.csv" 2>&1 | tee "$out/bench_ll_internode.log" | grep -v -i warn | tail -4 || status=1
  fi
  # Where the kernels spend their time, per phase (median and slowest program).
  for mode in normal ll; do
    ls "$out"/trace-$mode-*.json >/dev/null 2>&1 && python3 -m tritonep.bench trace-summary "$out"/trace-$mode-*.json
  done
fi
if [ "$what" = host ]; then
  # Host time of eager calls (one rank): where Python spends it, function by function.
  timeout "$(limit 300)" python3 scripts/host_profile.py --tokens "${HOST_TOKENS:-512}" 2>&1 | tee "$out/host_profile.log" | grep "===" || status=1
fi
if [ "$what" = probe ]; then
  # How fast one program copies rows (formulations of the kernels' copy loop), one GPU.
  timeout "$(limit "${PROBE_LIMIT_S:-300}")" python3 scripts/copy_probe.py --programs "${PROBE_PROGRAMS:-12}" ${PROBE_ARGS:-} 2>&1 \
    | tee "$out/copy_probe.log" | grep -v -i warn || status=1
fi
if [ "$what" = a2a ]; then
  # What P programs push to every peer at once, every rank together (the normal mode's bytes
  # at 4096 tokens; A2A_ARGS="--rows 115 --words 1852 --graph 10" the low-latency dispatch's).
  timeout "$(limit "${PROBE_LIMIT_S:-300}")" python3 scripts/a2a_probe.py --ranks "$ranks" \
    --programs "${A2A_PROGRAMS:-6,8,12,16,24,32}" ${A2A_ARGS:-} 2>&1 | tee "$out/a2a_probe.log" \
    | grep -v -i warn || status=1
fi
if [ "$what" = quantize ]; then
  # FP8 quantization of a batch of tokens (the normal mode's FP8 input): kernel vs reference.
  timeout "$(limit 300)" python3 scripts/quantize_probe.py 2>&1 | tee "$out/quantize_probe.log" | grep -v -i warn || status=1
fi
if [ "$what" = tune ]; then
  # Launch shapes of the normal mode side by side (tritonep.modes.normal.LAUNCH_CONSTANTS):
  # TUNE holds ';'-separated variants of space-separated NAME=VALUE (a setting that starts
  # with -- goes to the benchmark as it is, e.g. --chunk=32); the empty one is the default.
  # One CSV per variant, rows labelled with their constants (and chunk). By default, what the
  # first 4-rank run left open (BENCHMARKS.md, "First 4-GPU run"): its dispatch is bound by
  # the receivers' copy (30 GB/s a program, 46 possible), so larger receiver steps (more bytes
  # in flight, fewer flag rounds per row): no gain on 4x H200 (2026-11-26, BENCHMARKS.md),
  # the receivers' time is their copy; senders taking a share of the own rows (tried the
  # same day) was slower. The preset stays the default against the larger receiver steps.
  IFS=";" read -ra variants <<< "${TUNE:-;RECV_TILE=16384;STEP_ROWS=64 RECV_TILE=16384}"
  i=0
  for variant in "${variants[@]}"; do
    flags=""
    for setting in $variant; do
      case "$setting" in --*) flags="$flags $setting" ;; *) flags="$flags --launch $setting" ;; esac
    done
    timeout "$(limit "${TUNE_LIMIT_S:-120}")" python3 -m tritonep.bench normal --ranks "$ranks" \
      --tokens "${NORMAL_TOKENS:-4096}" --iters 20 --quiet $flags --csv "$out/tune-$i.csv" 2>&1 \
      | grep -v -i warn | tail -3 || status=1
    i=$((i + 1))
  done
fi
if [ "$what" = ab ]; then
  # Variants of a change in one call: the low-latency benchmark from each source tree of
  # TREES (directories holding a src/, e.g. `git archive COMMIT src | tar -x -C prev`; "." is
  # this tree), alternated AB_ROUNDS times on the same machine; one CSV per run, named by
  # tree and round. AB_VARIANTS: ';'-separated sets of extra benchmark flags, each run from
  # every tree (e.g. TREES=. AB_VARIANTS="; --logfmt"), labelled v0, v1, ...
  # AB_MODES: the benchmarks to run, "low-latency" (default) and/or "normal".
  IFS=";" read -ra ab_variants <<< "${AB_VARIANTS:-}"
  [ ${#ab_variants[@]} -gt 0 ] || ab_variants=("")
  for round in $(seq 1 "${AB_ROUNDS:-2}"); do
    for tree in ${TREES:?TREES: directories holding a src/, e.g. \"prev .\"}; do
      for mode in ${AB_MODES:-low-latency}; do
        tokens=$([ "$mode" = normal ] && echo "${NORMAL_TOKENS:-4096,128}" || echo "${LL_TOKENS:-128,1,256}")
        v=0
        for flags in "${ab_variants[@]}"; do
          label=$([ "$tree" = . ] && echo now || basename "$tree")
          [ ${#ab_variants[@]} -eq 1 ] || label="$label-v$v"
          [ "$mode" = low-latency ] || label="$label-$mode"
          PYTHONPATH="$PWD/$tree/src" timeout "$(limit "${AB_LIMIT_S:-150}")" python3 -m tritonep.bench "$mode" \
            --ranks "$ranks" --tokens "$tokens" --iters "${AB_ITERS:-50}" --quiet \
            ${AB_ARGS:-} $flags --csv "$out/ab-$label-$round.csv" 2>&1 | grep -v -i warn | tail -4 | sed "s/^/$label: /" || status=1
          v=$((v + 1))
        done
      done
    done
  done
fi
if [ "$what" = tests-soak ]; then
  # The GPU tests (tests-gpu) and the soaks (soak-par) at once on the same GPUs, as one
  # 4-GPU call ran them on 2026-11-26 (50 tests in 463 s beside a 10 000-call normal soak):
  # compiling shares the CPUs, nothing here is a timing. Logs gpu_tests.log, soak-MODE.log.
  TRITONEP_RANK_THREADS=${TEST_THREADS:-2} pytest_cmd -m gpu tests > "$out/gpu_tests.log" 2>&1 &
  tests_pid=$!
  what=soak-par
fi
if [ "$what" = soak-par ]; then
  # The soak's four modes at once, each its own run on all N ranks (2 nodes of N/2 for the
  # internode modes), their kernels taking turns on the GPUs: compiling, most of a fresh
  # machine's time, shares the CPUs. SOAK_SEED continues a stopped run (its progress lines
  # name the seed to continue from). One log per mode, soak-MODE.log.
  threads=$(( $(nproc) / (4 * ranks) ))
  for mode in ${SOAK_MODES:-normal low_latency internode low_latency_internode}; do
    TRITONEP_RANK_THREADS=$(( threads > 0 ? threads : 1 )) timeout -s INT -k 20 \
      "$(limit "${SOAK_LIMIT_S:-500}")" python3 -m tritonep.soak --ranks "$ranks" \
      --gpus-per-node $(( ranks > 1 ? ranks / 2 : 1 )) --modes "$mode" \
      --calls "${SOAK_CALLS:-10000}" --seed "${SOAK_SEED:-0}" --check-every "${SOAK_CHECK_EVERY:-100}" \
      --progress "${SOAK_PROGRESS:-250}" --timeout 60 > "$out/soak-$mode.log" 2>&1 &
  done
  wait
  if [ -n "${tests_pid:-}" ]; then
    echo "== GPU tests"; outcome "$out/gpu_tests.log" || status=1
  fi
  for mode in ${SOAK_MODES:-normal low_latency internode low_latency_internode}; do
    log="$out/soak-$mode.log"
    echo "== $mode"; grep -v -i warn "$log" | grep -v "^ " | tail -3
    if grep -q "every checked call matched" "$log"; then :
    elif grep -q "KeyboardInterrupt" "$log" && ! grep -q -i "mismatch\|timed out\|RankFailure" "$log"; then
      echo "(stopped by the time limit; SOAK_SEED=the seed its last progress line names continues it)"
    else status=1; fi
  done
fi
if [ "$what" = soak ]; then
  # Compiling the soak's shapes takes minutes on a fresh machine: within one call's 10 minutes,
  # run one mode per call (SOAK_ARGS="--modes normal"), and continue a stopped run with
  # SOAK_ARGS="--seed C" SOAK_CALLS=$((10000 - C)) after call C.
  timeout "$(limit "${SOAK_LIMIT_S:-500}")" python3 -m tritonep.soak --ranks "$ranks" --calls "${SOAK_CALLS:-10000}" ${SOAK_ARGS:-} \
    --check-every "${SOAK_CHECK_EVERY:-100}" 2>&1 | tee "$out/soak.log" | grep -v -i warn | tail -6 || status=1
fi
exit $status
