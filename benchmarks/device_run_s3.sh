#!/usr/bin/env bash
# The third session's 2-GPU run, in one call (nvidia-h200-x2), from the repository root:
#   OUT=dir bash benchmarks/device_run_s3.sh COMMIT
# GPU tests, split-tail stress (STRESS=1), the next_tile diagnosis, tuning variants, replayed
# traces with raw stamps. At most 8 files come back: the PNGs and logs that
# are not read first travel in extras.tar.gz.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-device-out}"
mkdir -p "$OUT"
{ date -u; echo "commit ${1:-unknown}"; nvidia-smi --query-gpu=index,name,clocks.max.sm,power.limit,temperature.gpu --format=csv
  python3 -c "import torch,triton;print('torch',torch.__version__,'triton',triton.__version__,'gpus',torch.cuda.device_count())"; } > "$OUT/env.txt" 2>&1
echo "== GPU tests"; timeout 200 python3 -m pytest -q -m "gpu or gpu2" tests -p no:cacheprovider > "$OUT/gpu-tests.log" 2>&1
grep -E "passed|failed|FAILED" "$OUT/gpu-tests.log" | tail -12
echo "== stress"; [[ ${STRESS:-0} == 1 ]] && { timeout 90 python3 benchmarks/stress_split_tail.py "$OUT" 120 > "$OUT/stress.log" 2>&1; tail -8 "$OUT/stress.log"; }
echo "== next_tile"; timeout 90 python3 benchmarks/diagnose_next_tile.py "$OUT" 20 > "$OUT/next_tile.log" 2>&1; cut -c1-400 "$OUT/next_tile.log" | tail -6
echo "== tune"; timeout 200 python3 benchmarks/tune_transport.py "$OUT" 16384 8192 25 > "$OUT/tune.log" 2>&1
grep -E "^(cublas|plain|micro|tp|cta|best)|WRONG|FAILED|Error" "$OUT/tune.log" | tail -30
echo "== replayed traces"; timeout 90 python3 benchmarks/trace_replay.py "$OUT" 16384 10 > "$OUT/trace_replay.log" 2>&1
grep -v "^\s*$" "$OUT/trace_replay.log" | tail -10
cd "$OUT" && tar czf extras.tar.gz --remove-files ./*.png ./*.log.txt stress.log trace_replay.log next_tile.log 2>/dev/null; ls
