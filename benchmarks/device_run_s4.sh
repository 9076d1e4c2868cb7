#!/usr/bin/env bash
# The fourth and fifth sessions' 2-GPU runs (nvidia-h200-x2), from the repository root:
#   OUT=dir STEPS="tests bench trace clocks tune" bash benchmarks/device_run_s4.sh COMMIT
# Steps run in the order given: GPU tests; the bench; the bench at 16384 with REST_MS idle
# before each timed run (rested); the bench at 16384 in fixed and in shuffled order (order);
# the bench at 16384 with the hook costs (hooks); the host time of eager calls (eager);
# replayed traces with raw stamps; clocks and power under each phase of the chain; which agent
# moving the output costs GPU 0 its clock (transport, fifth session); where a call from idle
# GPUs loses time writing into the peer (rest); the tuning run (pipeline variants interleaved
# with the baselines; sixth session: prefill and drain rows, each GPU's path alone).
# BENCH_ENDS=R,D sets the bench's ends line; TUNE_M the tuning run's rows, TUNE_ENDS its ends. Each step has its own timeout, so the call ends
# within the device's 10 minutes. At most 8 files come back: all but env.txt and
# gpu-tests.log travel in all.tar.gz.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-device-out}"
STEPS="${STEPS:-tests clocks tune}"
mkdir -p "$OUT"
{ date -u; echo "commit ${1:-unknown}"; echo "steps $STEPS"
  nvidia-smi --query-gpu=index,name,clocks.max.sm,clocks.sm,power.limit,temperature.gpu --format=csv
  python3 -c "import torch,triton;print('torch',torch.__version__,'triton',triton.__version__,'gpus',torch.cuda.device_count())"; } > "$OUT/env.txt" 2>&1
for step in $STEPS; do
  echo "== $step ($(date -u +%T))"
  case $step in
    tests) timeout 280 python3 -m pytest -q -m "gpu or gpu2" tests -rs -p no:cacheprovider > "$OUT/gpu-tests.log" 2>&1
      grep -E "passed|failed|FAILED|Error" "$OUT/gpu-tests.log" | tail -14 ;;
    bench) timeout 290 python3 -m ctapipelining.cli bench --seq 2048,8192,16384 --chunks 512,1024,2048 --reps "${BENCH_REPS:-15}" \
        --hooks-seq 0 ${BENCH_ENDS:+--ends $BENCH_ENDS} --out "$OUT/bench" > "$OUT/bench.log" 2>&1
      grep -E "^(method|floor|triton|tp|micro|cta|sequential)|\"seq\"|WRONG|Error" "$OUT/bench.log" | tail -50 ;;
    rested) timeout 200 python3 -m ctapipelining.cli bench --seq 16384 --chunks 512,1024,2048 --reps "${BENCH_REPS:-15}" \
        --hooks-seq 0 --rest-ms "${REST_MS:-50}" --out "$OUT/rested" > "$OUT/rested.log" 2>&1
      grep -E "^(method|floor|triton|tp|micro|cta|sequential)|\"seq\"|WRONG|Error" "$OUT/rested.log" | tail -24 ;;
    order) for o in fixed shuffled; do  # the same bench at 16384 in both orders, same VM
        timeout 150 python3 -m ctapipelining.cli bench --seq 16384 --chunks 512,1024,2048 --reps "${BENCH_REPS:-15}" \
          --hooks-seq 0 --order $o --out "$OUT/order-$o" > "$OUT/order-$o.log" 2>&1
        grep -E '"seq"|WRONG|Error' "$OUT/order-$o.log" | tail -3; done ;;
    hooks) timeout 200 python3 -m ctapipelining.cli bench --seq 16384 --chunks 512,1024,2048 --reps 25 \
        --hooks-seq 16384 --out "$OUT/hooks" > "$OUT/hooks.log" 2>&1
      grep -E "^\||static|prologue|signal|visib|WRONG|Error" "$OUT/hooks.log" | tail -24 ;;
    eager) timeout 60 python3 benchmarks/profile_eager.py 16384 30 > "$OUT/profile_eager.log" 2>&1
      head -12 "$OUT/profile_eager.log" ;;
    trace) timeout 120 python3 benchmarks/trace_replay.py "$OUT" 16384 10 "${REST_MS:-0}" > "$OUT/trace_replay.log" 2>&1
      grep -v "^\s*$" "$OUT/trace_replay.log" | cut -c1-600 | tail -40 ;;
    rest) timeout 150 python3 benchmarks/rested_remote.py "$OUT" 16384 20 "${REST_MS:-50}" > "$OUT/rested_remote.log" 2>&1
      tail -10 "$OUT/rested_remote.log" ;;
    transport) timeout 120 python3 benchmarks/transport_power.py "$OUT" 16384 1.5 > "$OUT/transport.log" 2>&1
      tail -16 "$OUT/transport.log" ;;
    clocks) timeout 70 python3 benchmarks/clocks_under_load.py "$OUT" 16384 1.5 > "$OUT/clocks.log" 2>&1
      tail -6 "$OUT/clocks.log" ;;
    tune) timeout 300 python3 benchmarks/tune_transport.py "$OUT" "${TUNE_M:-16384}" 8192 "${TUNE_REPS:-25}" > "$OUT/tune.log" 2>&1
      grep -E "^(cublas|plain|micro|tp|cta|best)|WRONG|FAILED|Error" "$OUT/tune.log" | tail -30 ;;
  esac
done
# at most 8 files come back from $OUT: everything but env.txt and gpu-tests.log travels in one tarball
# (the list is made before the tarball exists, so the tarball is never in it)
cd "$OUT" && find . -type f ! -name env.txt ! -name gpu-tests.log -printf '%P\n' > ../.out-files \
  && [ -s ../.out-files ] && tar czf all.tar.gz --remove-files -T ../.out-files && find . -type d -empty -delete
rm -f ../.out-files; ls -R
