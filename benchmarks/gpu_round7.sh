#!/usr/bin/env bash
# Issue 41 on one warm H100 / H200 in back-to-back device calls: FA3's MLA kernel built from source
# (benchmarks/gpu_fa3_mla.sh) IN THE BACKGROUND while an EAGLE-3 head trains on the GPU
# (benchmarks/gpu_eagle3.sh), then the MLA probe + the MLA GPU tests on the built kernel, then the
# head's comparison with the committed one.  Both long jobs run as their own process sessions
# (setsid), which outlive a call while the machine is held; the calls in between keep it held.
#
# Prepared here first: ../shared/tools/real-weights-wheels (.w1 .w2), ../shared/tools/fa3-wheel --split
# (.whl1 .whl2), .tok/rows.npz (benchmarks/gpu_eagle3.sh's header), .fa3src (gpu_fa3_mla.sh kit).
# Calls (each carry list fits the 64 MiB limit beside the ~14 MiB repo):
#   1  carry .w1 .fa3src     bash benchmarks/gpu_round7.sh stash1 mla_bg
#   2  carry .whl1 .tok      bash benchmarks/gpu_round7.sh stash2
#   3  carry .w2             bash benchmarks/gpu_round7.sh weights train_bg
#   4  carry .whl2           bash benchmarks/gpu_round7.sh fa3 mla_wait mla_probe mla_tests
#   5                        bash benchmarks/gpu_round7.sh train_wait compare
# Results: $OUT of each call; commit them under benchmarks/results/ with the machine and the commit.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$SECONDS
left() { echo $((${CALL_S:-580} - (SECONDS - T0))); }
for stage in "$@"; do
  case "$stage" in
    stash1) bash benchmarks/gpu_eagle3.sh stash1 ;;
    stash2) bash benchmarks/gpu_eagle3.sh stash2 ;;
    weights) bash benchmarks/gpu_eagle3.sh weights ;;
    fa3) bash benchmarks/gpu_eagle3.sh fa3 ;;
    compare) bash benchmarks/gpu_eagle3.sh compare ;;
    mla_bg)  # the build, its own session, budget 540 s (gpu_fa3_mla.sh resumes a stopped build)
      mkdir -p /tmp/mlaout
      OUT=/tmp/mlaout BUILD_S=540 setsid nohup bash benchmarks/gpu_fa3_mla.sh build > /tmp/mlabuild.out 2>&1 < /dev/null &
      sleep 5; echo "MLA build started in the background (pid $!)"; tail -n 5 /tmp/mlabuild.out ;;
    train_bg)  # the EAGLE-3 training, its own session (gpu_eagle3.sh's train stage, one bounded run)
      mkdir -p /tmp/e3out
      OUT=/tmp/e3out TRAIN_SECONDS=${TRAIN_SECONDS:-480} BOUND=${BOUND:-560} setsid nohup bash benchmarks/gpu_eagle3.sh train \
        > /tmp/e3train.out 2>&1 < /dev/null &
      sleep 20; echo "EAGLE-3 training started in the background (pid $!)"; tail -n 5 /tmp/e3train.out ;;
    mla_wait)  # until the build's session ends (or this call's time runs short), then its files
      while pgrep -f "gpu_fa3_mla.sh build" > /dev/null && [ "$(left)" -gt 200 ]; do sleep 5; done
      if pgrep -f "gpu_fa3_mla.sh build" > /dev/null; then echo "MLA build still running"; else echo "MLA build ended"; fi
      tail -n 40 /tmp/mlabuild.out; cp /tmp/mlabuild.out /tmp/mlaout/* "$OUT/" 2>/dev/null
      if [ ! -f /tmp/fa3src/.built ] && ! pgrep -f "gpu_fa3_mla.sh build" > /dev/null; then
        echo "resuming the build in this call"; BUILD_S=$(( $(left) - 150 )) bash benchmarks/gpu_fa3_mla.sh build
      fi ;;
    mla_probe) [ -f /tmp/fa3src/.built ] && bash benchmarks/gpu_fa3_mla.sh probe ;;
    mla_tests)  # the MLA GPU tests and the check's MLA rows on the built kernel (its module first on the path)
      [ -f /tmp/fa3src/.built ] || { echo "no built MLA kernel: tests not run"; continue; }
      export PYTHONPATH=/tmp/fa3mla:$PWD
      timeout 30 python3 -m refspec info 2>&1 | tail -n 12 | tee "$OUT/mla-info.txt"
      timeout $(( $(left) > 60 ? $(left) - 40 : 20 )) python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
        tests/test_gpu_mla.py > "$OUT/gpu-mla-tests.log" 2>&1
      echo "MLA GPU tests rc=$?"; tail -n 15 "$OUT/gpu-mla-tests.log" ;;
    train_wait)
      while pgrep -f "gpu_eagle3.sh train" > /dev/null && [ "$(left)" -gt 330 ]; do sleep 5; done
      if pgrep -f "gpu_eagle3.sh train" > /dev/null; then echo "training still running"; else echo "training ended"; fi
      tail -n 12 /tmp/e3train.out; cp -r /tmp/e3out/* "$OUT/" 2>/dev/null ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
