#!/usr/bin/env bash
# The H200 runs behind benchmarks/results/*.md.  Usage (repo root, FA3 importable, OUT set):
#   bash benchmarks/gpu_run.sh tests      # the GPU test suite (pytest -m gpu)
#   bash benchmarks/gpu_run.sh mutants    # python -m refspec mutants --device cuda
#   bash benchmarks/gpu_run.sh check      # python -m refspec check --device cuda
#   bash benchmarks/gpu_run.sh bench      # python -m refspec bench (full grid)
#   bash benchmarks/gpu_run.sh trace      # replay the committed MT-Bench trace on CUDA
#   bash benchmarks/gpu_run.sh demo       # python -m refspec demo --device cuda (real weights installed)
#   bash benchmarks/gpu_run.sh profile    # bench sections kernel, profile, seed (real weights if installed)
#   bash benchmarks/gpu_run.sh host       # issue 14's round targets: B = 1, 16, v2 overlap: GPU-busy, wall,
#                                         # wall/busy, launches + host ops per round; then launch_audit by site
#   bash benchmarks/gpu_run.sh sanitizer  # graph tests under compute-sanitizer memcheck
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 - > "$OUT/env.txt" 2>&1 <<'PY'
import importlib.metadata as md, torch
print("gpu:", torch.cuda.get_device_name(), "sm_%d%d" % torch.cuda.get_device_capability())
print("torch:", torch.__version__, "cuda:", torch.version.cuda)
for name in ("tokenspeed-fa3",):
    try:
        print(name + ":", md.version(name))
    except md.PackageNotFoundError:
        print(name + ": not found")
PY
for what in "$@"; do
  case "$what" in
    tests)
      timeout 540 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=15 tests/test_gpu_*.py \
        tests/test_mutants.py > "$OUT/gpu-tests.log" 2>&1
      echo "gpu tests rc=$?"; tail -3 "$OUT/gpu-tests.log" ;;
    mutants)
      timeout 300 python3 -m refspec mutants --device cuda > "$OUT/mutants-cuda.txt" 2>&1
      echo "mutants rc=$?"; tail -3 "$OUT/mutants-cuda.txt" ;;
    check)
      timeout 540 python3 -m refspec check --device cuda > "$OUT/check-cuda.txt" 2>&1
      echo "check rc=$?"; tail -3 "$OUT/check-cuda.txt" ;;
    bench)
      timeout 400 python3 -m refspec bench --device cuda --out "$OUT" > "$OUT/bench.log" 2>&1
      echo "bench rc=$?"; tail -5 "$OUT/bench.log" ;;
    trace)
      timeout 540 python3 -m refspec replay benchmarks/traces/mtbench_smollm2.json --device cuda \
        --versions v1,v2 --page-sizes 1,4,16 --out "$OUT/trace-replay.md" > "$OUT/trace-replay.log" 2>&1
      echo "replay rc=$?"; tail -5 "$OUT/trace-replay.log" ;;
    demo)
      timeout 400 python3 -m refspec demo --device cuda --no-progress > "$OUT/demo-cuda.txt" 2>&1
      echo "demo rc=$?"; tail -25 "$OUT/demo-cuda.txt" ;;
    profile)
      timeout 540 python3 -m refspec bench --device cuda --sections kernel,profile,seed,drafts --out "$OUT/profile" \
        > "$OUT/profile.log" 2>&1
      echo "profile rc=$?"; grep -A40 "### profile" "$OUT/profile.log" | head -60 ;;
    host)
      timeout 420 python3 -m refspec bench --device cuda --sections host --out "$OUT/host" > "$OUT/host.log" 2>&1
      echo "host rc=$?"; sed -n '/^### host/,$p' "$OUT/host.log" | head -45
      timeout 150 python3 -m refspec.audits.launch --device cuda --batch 1 --top 30 \
        > "$OUT/launch_audit_b1.txt" 2>&1
      echo "launch_audit rc=$?"; head -4 "$OUT/launch_audit_b1.txt" ;;
    sanitizer)
      timeout 400 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -m gpu -q -x \
        -p no:cacheprovider tests/test_gpu_graphs.py -k "${SANITIZER_K:-}" > "$OUT/sanitizer.log" 2>&1
      echo "sanitizer rc=$?"; tail -5 "$OUT/sanitizer.log" ;;
  esac
done
