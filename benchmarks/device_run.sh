#!/usr/bin/env bash
# Everything measured on the GPU machine, in one call: environment, GPU tests, kernel
# inspection, benchmark. Run from the repository root on nvidia-h200-x2:
#   bash benchmarks/device_run.sh [extra args for `ctapipelining bench`]
# Writes under $OUT (default ./device-out): env.txt, gpu-tests.log, bench.log, results.json,
# results.csv, fig4/fig5 PNGs, consumer_workqueue.ptx.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-device-out}"
STEPS="${STEPS:-env demo tests bench trace}"   # a subset, e.g. STEPS=bench, to re-run one part
mkdir -p "$OUT"
[[ $STEPS == *env* ]] && {
  date -u; nvidia-smi; nvidia-smi topo -m
  python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__, 'gpus', torch.cuda.device_count())"
  echo "== kernel inspection"
  timeout 240 python3 benchmarks/inspect_kernels.py "$OUT" 2>&1
} > "$OUT/env.txt" 2>&1
[[ $STEPS == *env* ]] && tail -30 "$OUT/env.txt"
[[ $STEPS == *demo* ]] && echo "== demo" && timeout 120 python3 -m ctapipelining.cli demo 2>&1 | tail -8
[[ $STEPS == *tests* ]] && echo "== GPU tests" && timeout 300 python3 -m pytest -q -m "gpu or gpu2" tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
[[ $STEPS == *bench* ]] && echo "== bench" && timeout 420 python3 -m ctapipelining.cli bench --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v '\r' | tail -60
[[ $STEPS == *trace* ]] && echo "== trace" && for p in workqueue static; do timeout 120 python3 -m ctapipelining.cli trace --policy $p --out "$OUT" 2>&1 | tail -40; done
