#!/usr/bin/env bash
# Everything measured on a GPU machine, in one call, from the repository root:
#   OUT=dir STEPS="env demo tests bench trace" bash benchmarks/device_run.sh [COMMIT]
# Steps run in the order given (default: env demo tests bench trace), each with its own timeout so
# the whole call ends within 10 minutes:
#   env    date, commit, versions, nvidia-smi, topology                          -> env.txt
#   demo   ctapipelining demo                                                    -> demo.log
#   example examples/llama_block.py (one GPU): a transformers Llama-8B block fused, checked, compiled, timed -> example.log
#   tests  the GPU tests (markers gpu, gpu2, or TESTS_MARK, e.g. "gpu2" alone on 2 GPUs, where the
#          whole suite may need more than one call's 10 minutes; TESTS: files, default all;
#          TESTS_TIMEOUT, default 560 s) -> gpu-tests.log
#   bench  ctapipelining bench at 2048, 8192, 16384 rows, BENCH_REPS repetitions (default 30);
#          BENCH_ENDS=R,D: the ends line with these prefill and drain rows     -> bench.log, bench/
#   decision (2 GPUs: issue 19's first part) the bench at 2048, 4096, 8192, 16384 rows: every method
#          and baseline (micro-batching on cuBLAS and on our GEMM, TP plain and overlapped, data
#          parallelism with replicas, the chain with and without ends), BENCH_REPS (default 30) -> decision.log, decision/
#   depth  (2 GPUs) the bench with 4 layers on 2 GPUs (two per GPU, each pair one chain kernel) at 2048,
#          8192, 16384 rows against the floor (two of our GEMMs on one GPU) and micro-batching -> depth.log, depth/
#   order  the bench at 16384 rows in fixed and in shuffled order (same machine) -> order-*.log, order-*/
#   hooks  the bench at 16384 rows with each hook's cost timed alone           -> hooks.log, hooks/
#   trace  ctapipelining trace under both policies (2 GPUs)                      -> trace.log, trace/
#   eager  benchmarks/eager.py: eager calls against graph replays, blocks, chunked prefill (one GPU; BLOCKS=0,
#          PREFILL=0 leave parts out) -> eager.log, eager.json
#   shared benchmarks/shared_gpu.py: two stages sharing one GPU against the floor -> shared_gpu.log, shared_gpu.json
#   sanitize compute-sanitizer memcheck, racecheck, synccheck on benchmarks/sanitize_chain.py (the chain
#          kernel, then the loopback for memcheck)                                -> sanitize-*.log
#   soak   (1 or 2 GPUs) benchmarks/soak.py: SOAK_CALLS (default 10000) checked calls on one pipeline, then as many on
#          the default one-GPU pipeline (bound eager calls) in two mixes of operands -> soak.log, soak.json
#   sancross (2 GPUs) compute-sanitizer memcheck, racecheck, synccheck on sanitize_chain.py cross -> sanitize-cross-*.log
#   mlp    (1 GPU) benchmarks/mlp_block.py: the fused MLP blocks against torch.compile and cuBLAS, MLP_REPS
#          (default 20), MLP_MODE (default max-autotune-no-cudagraphs; none: no compiled line), MLP_BLOCKS (default llama;
#          llama,gpt; decode; few; rows: the three blocks at 1-1024 rows, with the unfused line),
#          MLP_ONLY (shapes whose key contains it)                              -> mlp_block.log, mlp_block.json
#   tiles  (1 GPU) benchmarks/block_tiles.py: a block's two GEMMs at few rows under candidate tiles against
#          cuBLAS (nn.FEW_ROWS_CONFIGS), TILES_ROWS and TILES_BLOCKS (default the script's; gpt: the GPT
#          block), TILES_REPS (default 20) -> block_tiles.log, tiles/
#   parts  (1 GPU) benchmarks/mlp_parts.py: a Llama block's GEMMs part by part against cuBLAS, PARTS_SHAPES
#          (HIDDEN:INTERMEDIATE:M,...; default the Llama-70B block at 4096 rows), PARTS_OLD (a folder with an older
#          tree as ctapipelining_old: its block timed beside) -> mlp_parts.log, mlp_parts.json
#   stack  benchmarks/mlp_stack.py: two Llama blocks as one pipeline against the blocks one after
#          another; with 2 GPUs also two Llama-70B blocks, one per GPU, against one block on one GPU,
#          micro-batching and tensor parallelism; MLP_REPS (default 20), STACK_ONLY (shapes) -> mlp_stack.log, mlp_stack.json
#   dist   the one-process-per-GPU tests (tests/test_gpu_distributed.py), then examples/torchrun_chain.py
#          under torchrun on every GPU (one GPU: two stages on it), with and without --loopback, and
#          with fused Llama blocks (--blocks) -> dist-tests.log, torchrun*.json
#   configs benchmarks/configs.py: each tile configuration per row count, CONFIGS_KIND plain (the plain GEMM
#          against cuBLAS) or chain (two stages in one chain kernel against the floor), CONFIGS_ROWS
#          (default the script's), CONFIGS_REPS (default 20); OLD_PACKAGE_PARENT (plain): an older tree's
#          matmul timed in the same turns                                        -> configs-KIND.log, configs-KIND/
#   tune   benchmarks/tune.py at TUNE_M rows (default 16384), TUNE_REPS (default 20) -> tune.log, tune.json
# On a 2-GPU machine (issue 19's second part), the claims first, one call each (the steps'
# timeouts keep each under 10 minutes): STEPS="env depth"; "env stack"; "env dist";
# "env tests" with TESTS_MARK=gpu2; "env soak" with SOAK_CALLS=10000; "env sancross"; then
# "env tests" with TESTS_MARK=gpu (the one-GPU tests on that machine).
# The environment keeps NVLink multicast off (NCCL, symmetric memory, NVSHMEM). At most 8 files come
# back from a device call: everything but env.txt and gpu-tests.log travels in all.tar.gz.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-device-out}"
STEPS="${STEPS:-env demo tests bench trace}"
CLI="python3 -m ctapipelining"
SUMMARY='^(method|floor|triton|tp|micro|cta|dp|sequential|producer|consumer|visib)|"seq"|WRONG|Error'
mkdir -p "$OUT"
for step in $STEPS; do
  echo "== $step ($(date -u +%T))"
  case $step in
    env) { date -u; echo "commit ${1:-unknown}"; echo "steps $STEPS"
        nvidia-smi --query-gpu=index,name,clocks.max.sm,clocks.sm,power.limit,temperature.gpu --format=csv
        nvidia-smi topo -m
        python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__, 'gpus', torch.cuda.device_count())"
      } > "$OUT/env.txt" 2>&1
      cat "$OUT/env.txt" ;;
    demo) timeout 180 $CLI demo > "$OUT/demo.log" 2>&1; tail -12 "$OUT/demo.log" ;;
    example) timeout 300 python3 examples/llama_block.py > "$OUT/example.log" 2>&1; echo "rc $?" >> "$OUT/example.log"
      tail -6 "$OUT/example.log" ;;
    tests) timeout "${TESTS_TIMEOUT:-560}" python3 -m pytest -q -m "${TESTS_MARK:-gpu or gpu2}" ${TESTS:-tests} -rs \
        -p no:cacheprovider > "$OUT/gpu-tests.log" 2>&1
      grep -E "passed|failed|FAILED|Error" "$OUT/gpu-tests.log" | tail -14 ;;
    bench) timeout 300 $CLI bench --seq 2048,8192,16384 --chunks 512,1024,2048 --reps "${BENCH_REPS:-30}" \
        --hooks-seq 0 ${BENCH_ENDS:+--ends $BENCH_ENDS} --out "$OUT/bench" > "$OUT/bench.log" 2>&1
      grep -E "$SUMMARY" "$OUT/bench.log" | tail -60 ;;
    decision) timeout 560 $CLI bench --seq 2048,4096,8192,16384 --chunks 512,1024,2048 --reps "${BENCH_REPS:-30}" \
        --hooks-seq 0 --out "$OUT/decision" > "$OUT/decision.log" 2>&1
      grep -E "$SUMMARY|^ +[0-9]+ (placed|repl)" "$OUT/decision.log" | tail -60 ;;
    depth) timeout 400 $CLI bench --gpus 2 --layers 4 --seq 2048,8192,16384 --chunks 512,1024,2048 \
        --reps "${BENCH_REPS:-30}" --hooks-seq 0 --out "$OUT/depth" > "$OUT/depth.log" 2>&1
      grep -E "$SUMMARY|^ +[0-9]+ (placed|repl)" "$OUT/depth.log" | tail -40
      # the model's ratios against this run (sim.validate_depth)
      $CLI sim --validate "$OUT/depth/results.json" --out "$OUT/depth-sim" > "$OUT/depth-sim.log" 2>&1
      grep -A13 "more layers than GPUs, against" "$OUT/depth-sim.log" ;;
    order) for o in fixed shuffled; do
        timeout 150 $CLI bench --seq 16384 --chunks 512,1024,2048 --reps "${BENCH_REPS:-30}" \
          --hooks-seq 0 --order $o --out "$OUT/order-$o" > "$OUT/order-$o.log" 2>&1
        grep -E '"seq"|WRONG|Error' "$OUT/order-$o.log" | tail -3; done ;;
    hooks) timeout 200 $CLI bench --seq 16384 --chunks 512,1024,2048 --reps 25 \
        --hooks-seq 16384 --out "$OUT/hooks" > "$OUT/hooks.log" 2>&1
      grep -E "$SUMMARY" "$OUT/hooks.log" | tail -30 ;;
    trace) for p in static workqueue; do
        timeout 120 $CLI trace --policy $p --out "$OUT/trace" 2>&1 | tail -30; done > "$OUT/trace.log"
      cat "$OUT/trace.log" ;;
    eager) timeout 320 python3 benchmarks/eager.py "$OUT" 30 > "$OUT/eager.log" 2>&1; tail -30 "$OUT/eager.log" ;;
    shared) timeout 300 python3 benchmarks/shared_gpu.py "$OUT" 30 > "$OUT/shared_gpu.log" 2>&1; tail -8 "$OUT/shared_gpu.log" ;;
    sanitize) for tool in memcheck racecheck synccheck; do
        timeout 150 compute-sanitizer --tool $tool python3 benchmarks/sanitize_chain.py > "$OUT/sanitize-$tool.log" 2>&1
        echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|bitwise|Error" "$OUT/sanitize-$tool.log" | tail -4; done
      timeout 150 compute-sanitizer --tool memcheck python3 benchmarks/sanitize_chain.py loopback \
        > "$OUT/sanitize-memcheck-loopback.log" 2>&1
      echo "memcheck loopback rc=$?"; grep -E "ERROR SUMMARY|bitwise|Error" "$OUT/sanitize-memcheck-loopback.log" | tail -4 ;;
    mlp) timeout 500 python3 benchmarks/mlp_block.py "$OUT" "${MLP_REPS:-20}" "${MLP_MODE:-max-autotune-no-cudagraphs}" \
        "${MLP_BLOCKS:-llama}" "${MLP_ONLY:-}" \
        > "$OUT/mlp_block.log" 2>&1; echo "mlp rc=$?"; grep -E "^(GPT_)?H|Error" "$OUT/mlp_block.log" | tail -8 ;;
    tiles) timeout 300 python3 benchmarks/block_tiles.py "$OUT/tiles" "${TILES_REPS:-20}" \
        "${TILES_ROWS:-}" "${TILES_BLOCKS:-}" \
        > "$OUT/block_tiles.log" 2>&1; echo "tiles rc=$?"; grep -E "M=|up|down|Error" "$OUT/block_tiles.log" | tail -40 ;;
    parts) timeout 300 python3 benchmarks/mlp_parts.py "$OUT" "${MLP_REPS:-20}" "${PARTS_SHAPES:-8192:28672:4096}" \
        ${PARTS_OLD:-} > "$OUT/mlp_parts.log" 2>&1
      echo "parts rc=$?"; grep -E 'block|Error' "$OUT/mlp_parts.log" | tail -12 ;;
    stack) timeout 400 python3 benchmarks/mlp_stack.py "$OUT" "${MLP_REPS:-20}" "${STACK_ONLY:-}" \
        > "$OUT/mlp_stack.log" 2>&1; echo "stack rc=$?"; grep -E "^(2 GPUs )?H|Error" "$OUT/mlp_stack.log" | tail -8 ;;
    soak) timeout 400 python3 benchmarks/soak.py "$OUT" "${SOAK_CALLS:-10000}" > "$OUT/soak.log" 2>&1
      echo "soak rc=$?"; tail -c 1500 "$OUT/soak.log" ;;
    sancross) for tool in memcheck racecheck synccheck; do
        timeout 150 compute-sanitizer --tool $tool python3 benchmarks/sanitize_chain.py cross > "$OUT/sanitize-cross-$tool.log" 2>&1
        echo "$tool cross rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|bitwise|Error" "$OUT/sanitize-cross-$tool.log" | tail -4; done ;;
    dist) timeout 240 python3 -m pytest -q -m gpu tests/test_gpu_distributed.py -rs -p no:cacheprovider \
        > "$OUT/dist-tests.log" 2>&1; grep -E "passed|failed|FAILED|Error" "$OUT/dist-tests.log" | tail -8
      NG=$(nvidia-smi -L | wc -l); SPR=$(( NG == 1 ? 2 : 1 ))
      for lb in "" "--loopback"; do name="torchrun${lb:+-loopback}"
        timeout 180 torchrun --nproc-per-node "$NG" examples/torchrun_chain.py --rows "${DIST_ROWS:-4096}" \
          --stages-per-rank "$SPR" $lb --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
        echo "$name rc=$?"; grep -E "^\{|Error" "$OUT/$name.log" | tail -3; done
      # fused Llama-70B blocks, a block per rank (with one GPU: two blocks on one rank, no links)
      timeout 240 torchrun --nproc-per-node "$NG" examples/torchrun_chain.py --rows "${DIST_ROWS:-4096}" \
        --stages-per-rank "$SPR" --blocks --out "$OUT/torchrun-blocks.json" > "$OUT/torchrun-blocks.log" 2>&1
      echo "torchrun-blocks rc=$?"; grep -E "^\{|Error" "$OUT/torchrun-blocks.log" | tail -3 ;;
    configs) k="${CONFIGS_KIND:-plain}"
      timeout 400 python3 benchmarks/configs.py "$OUT/configs-$k" "${CONFIGS_REPS:-20}" "${CONFIGS_ROWS:-}" "$k" \
        > "$OUT/configs-$k.log" 2>&1; echo "configs rc=$?"; tail -14 "$OUT/configs-$k.log" ;;
    tune) timeout 300 python3 benchmarks/tune.py "$OUT" "${TUNE_M:-16384}" 8192 "${TUNE_REPS:-20}" > "$OUT/tune.log" 2>&1
      grep -E "^(cublas|plain|pipeline)|FAILED|WRONG|Error" "$OUT/tune.log" | tail -30 ;;
    *) echo "unknown step $step (see the list at the top of $0)" ;;
  esac
done
# everything but env.txt, gpu-tests.log and earlier tarballs travels in one tarball: all.tar.gz, or
# all-2.tar.gz, ... where a call ran this script more than once
cd "$OUT" && find . -type f ! -name env.txt ! -name gpu-tests.log ! -name 'all*.tar.gz' -printf '%P\n' > ../.out-files \
  && [ -s ../.out-files ] && { tarball=all.tar.gz n=1; while [ -e "$tarball" ]; do n=$((n + 1)) tarball=all-$n.tar.gz; done
    tar czf "$tarball" --remove-files -T ../.out-files && find . -type d -empty -delete; }
rm -f ../.out-files; ls -R
