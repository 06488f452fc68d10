#!/usr/bin/env bash
# The FA3 top-k > 1 tree path on an H200 (repo root, FA3 importable, OUT set).  Stages:
#   bash benchmarks/gpu_tree.sh tests      # pytest -m gpu tests/test_gpu_tree.py: verify + draft decode,
#                                          # P 1/4/16/64 x topk 2/4/8, eager (fa3 + emulator) and CUDA graphs,
#                                          # T1 vs the fp32 slot oracle; the bf16 loop vs the fp32 oracle tree loop (T2)
#   bash benchmarks/gpu_tree.sh check      # python -m refspec check --device cuda --sections tree
#   bash benchmarks/gpu_tree.sh sanitizer  # the graphed tree tests under compute-sanitizer memcheck
#   bash benchmarks/gpu_tree.sh cpu        # the CPU tree suites (emulator, emulated graphs, fp32 bitwise)
#   bash benchmarks/gpu_tree.sh demo       # SmolLM2 (real weights installed): chain N = 4 vs top-k 4, N = 8, same
#                                          # draft; accept length and tokens/s, T2 vs greedy, production == oracle
#   bash benchmarks/gpu_tree.sh replay     # the committed SmolLM2 tree trace: every round's draft decode, verify and
#                                          # draft extend through the real FA3 kernel (bf16) vs the fp32 slot oracle
#   bash benchmarks/gpu_tree.sh mutants    # python -m refspec mutants --device cuda --only <the 5 tree variants>
# Look for: "120 passed" in gpu-tree-tests.log (72 attention: 24 verify eager, 12 verify graphed, 24 draft eager,
# 12 draft graphed; 48 loop: v1 and v2 (the non-overlapped v2 tree round) x P x k x eager/graphs),
# "0 FAIL" in check-tree-cuda.txt, "ERROR SUMMARY: 0 errors" in sanitizer-tree.log,
# "**PASS** (19 rounds)" in replay-tree-cuda.md, "caught 5/5" in mutants-tree-cuda.txt (the TREE_LOOP probes
# say "not run": fp32 CPU only).
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for what in "$@"; do
  case "$what" in
    tests)
      timeout 580 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 tests/test_gpu_tree.py \
        > "$OUT/gpu-tree-tests.log" 2>&1
      echo "gpu tree tests rc=$?"; tail -3 "$OUT/gpu-tree-tests.log" ;;
    check)
      timeout 540 python3 -m refspec check --device cuda --sections tree > "$OUT/check-tree-cuda.txt" 2>&1
      echo "check rc=$?"; tail -3 "$OUT/check-tree-cuda.txt" ;;
    sanitizer)
      timeout 500 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -m gpu -q -x \
        -p no:cacheprovider tests/test_gpu_tree.py -k "graphed" > "$OUT/sanitizer-tree.log" 2>&1
      echo "sanitizer rc=$?"; tail -5 "$OUT/sanitizer-tree.log" ;;
    demo)
      timeout 580 python3 -m refspec demo --device cuda --no-progress --versions v1 --page-sizes 1,16 \
        --topk 4 --num-draft-tokens 8 > "$OUT/demo-tree-cuda.txt" 2>&1
      echo "demo rc=$?"; tail -20 "$OUT/demo-tree-cuda.txt" ;;
    replay)
      timeout 300 python3 -m refspec replay benchmarks/traces/mtbench_smollm2_tree.json --device cuda \
        --out "$OUT/replay-tree-cuda.md" > "$OUT/replay-tree-cuda.log" 2>&1
      echo "replay rc=$?"; tail -3 "$OUT/replay-tree-cuda.md" ;;
    mutants)
      timeout 300 python3 -m refspec mutants --device cuda --only tree-mask-sibling-visible,expand-reads-prefix-twice,\
lse-merge-no-rescale,branch-no-tail-copy,draft-expand-unsliced-cache-loc > "$OUT/mutants-tree-cuda.txt" 2>&1
      echo "mutants rc=$?"; tail -9 "$OUT/mutants-tree-cuda.txt" ;;
    cpu)
      timeout 580 python3 -m pytest -q -p no:cacheprovider tests/test_tree_fa3_attention.py tests/test_tree_fa3_loop.py \
        tests/test_tree_fa3_graphs.py tests/test_tree_fa3_v2.py tests/test_tree_variants.py tests/test_tree_trace.py \
        > "$OUT/cpu-tree-tests.log" 2>&1
      echo "cpu tree tests rc=$?"; tail -3 "$OUT/cpu-tree-tests.log" ;;
  esac
done
