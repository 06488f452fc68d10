#!/usr/bin/env bash
# Build FlashAttention-3's MLA forward kernel (q/k head dim 64, v head dim 512, bf16, sm90, paged KV,
# split KV) FROM SOURCE on the GPU machine, then probe it against an fp32 reference. The
# tokenspeed-fa3 wheel (the one refspec's GPU runs use) was built without HDIMDIFF64, so SGLang's MLA
# call `flash_attn_with_kvcache(q=q_rope, k_cache=k_rope, v_cache=c_kv, qv=q_nope, ...)` has no
# kernel there; this script makes one.
#
# Sources: flash-attention 0251105a2fb19d2957484b7f023cd8c115286ced (hopper/: setup.py, the headers,
# flash_api*.cpp, the combine and scheduler kernels, the Python package, the bf16 sm90 forward
# instantiations; README.md, LICENSE) and cutlass 7127592069c2fe01b041e174ba4345ef9b279671 (include/,
# the submodule's commit), packed by the `kit` stage into .fa3src/fa3src.tar.xz (1.1 MiB; 29 MiB
# unpacked; /.fa3src/ and /.fa3mla/ are in .git/info/exclude). What gets compiled: flash_api_stable.cpp,
# flash_fwd_combine.cu, flash_prepare_scheduler.cu and the five hdim64_512 bf16 units (plain,
# packgqa, paged, split, paged_split) that run_mha_fwd's dispatch names; each unit holds 8 kernels
# (causal x varlen x qv on/off). fa3_mla_patch.py drops (64,64) and (64,256), which setup.py's flags
# cannot (they are named by the same dispatch): such calls then raise "fa3kit MLA-only build".
#
# ---------------------------------------------------------------------------------------------------
# HOW TO RUN (the lead). The device tool sends the session's checkout (/work/main), so the kit must
# sit there: after merging, in /work/main run `bash benchmarks/gpu_fa3_mla.sh kit` (needs the git
# mirrors under /work/.mirror), or `cp -r /work/wt/fa3kit/.fa3src /work/main/`.
#   Optional negative control (tokenspeed-fa3 in two halves, as gpu_peer.sh uses it), in /work/main:
#       ../shared/tools/fa3-wheel --split          # writes .whl1/ .whl2/ (~30 MiB each)
#   Then back to back on ONE warm machine (it goes back ~30 s after a call; /tmp survives between
#   back-to-back calls; a fresh machine is bare). Each call carries <= 14 MiB of repo + 1.1 MiB kit
#   + ~30 MiB wheel half, under the 64 MiB limit.
#   call 1  run(command="bash benchmarks/gpu_fa3_mla.sh stash1 build probe",
#               carry=[".fa3src", ".whl1"], timeout_s=600)
#           unpacks the kit, builds (budget BUILD_S=480 s, less what the call has used), packs the
#           .so into $OUT, then probes the built module if time is left (~60 s are enough).
#           Without the negative control: "bash benchmarks/gpu_fa3_mla.sh build probe", carry [".fa3src"].
#           Expected: ~1-2 min machine start + ~5-6 min command (build ~4-5 min: estimate below).
#   call 2  run(command="bash benchmarks/gpu_fa3_mla.sh neg build probe", carry=[".fa3src", ".whl2"],
#               timeout_s=600)
#           installs tokenspeed-fa3 into /tmp/site (neg); `build` is a no-op if call 1 finished it, else
#           resumes it (ninja rebuilds only the missing objects; on a fresh machine it starts over from
#           the carried kit); then probes the built module and, in a separate process, tokenspeed-fa3
#           (expected there: every configuration FAILS or raises: the measured negative control).
#           Expected: ~2 min (install ~20 s, two probes ~30-60 s each). Skip it if call 1 printed
#           "PROBE built: PASS" and no negative control is wanted.
#   Estimated device time: ~10-12 min for both calls; worst case (build not done in call 1) ~20 min.
#   Build-time basis (measured here, on a shared 2.8 GHz Xeon core, nvcc 13.0.88 from the pip wheel,
#   setup.py's exact flags): one hdim64_512 unit (paged_split, 8 kernels) took 214 s of CPU time
#   (4.9 GB peak RSS, 3.6 MB object); flash_fwd_combine.cu 249 s and flash_prepare_scheduler.cu 140 s,
#   each for two archs (sm80 + sm90a) that NVCC_THREADS=2 compiles side by side; flash_api_stable.cpp
#   ~30 s of g++. All 8 compile at once (MAX_JOBS=16 on 16 cores, ~30 GB), so the wall time is about
#   the slowest unit (~3.5-4 min) + setup.py and link (< 1 min). The .so should be ~30 MB (xz ~10x
#   smaller: one fa3mla.tar.xz). The BUILD TIME lines and ninja-times.txt give the measured numbers.
#   Look for: "fa3kit sources (8)", "undefined run_mha_fwd symbols (must be none): 0", five
#   "run_mha_fwd_<90, cutlass::bfloat16_t, 64, 512, ...>" lines, "load check: import ok",
#   "PROBE built: PASS (114/114 pass ...)", "PROBE tokenspeed-fa3: 114/114 configurations FAIL or raise".
#   Files back ($OUT, <= 8): fa3mla.tar.xz (or fa3mla.tar.xz.part-aa, -ab, ... past 15 MiB),
#   build.log.xz, ninja-times.txt, probe.txt, env.txt.
#
# REUSE WITHOUT REBUILDING (a later device session)
#   Here: mkdir -p .fa3mla && cp <files_at>/fa3mla.tar.xz* .fa3mla/   (/.fa3mla/ is in .git/info/exclude)
#   run(command="bash benchmarks/gpu_fa3_mla.sh use probe", carry=[".fa3mla"], timeout_s=300)
#   `use` reassembles the parts, unpacks to /tmp/fa3mla; anything can then import the built module
#   with PYTHONPATH=/tmp/fa3mla (module names flash_attn_interface / flash_attn_3._C, the SAME names
#   as tokenspeed-fa3's, and both register the torch op namespace flash_attn_3: never import both in
#   one process; the probe runs each in its own process).
#
# STAGES
#   kit      (CPU) pack .fa3src/fa3src.tar.xz from the git mirrors (FA_GIT, CUT_GIT override them)
#   stash1   (device) keep .whl1/* in /tmp/fa3neg for `neg`
#   neg      (device) join .whl1 + .whl2 halves, pip-install tokenspeed-fa3 into /tmp/site
#   build    (device) unpack to /tmp/fa3src (once), patch (benchmarks/fa3_mla_patch.py), build with
#            setup.py's flags within BUILD_S seconds (default 480); resumable: run `build` again on
#            the same warm machine; on success: load check, symbol list, `pack`
#   pack     (device) /tmp/fa3mla -> $OUT/fa3mla.tar.xz (split into 15 MiB parts when larger)
#   use      (device) .fa3mla/fa3mla.tar.xz[.part-*] -> /tmp/fa3mla
#   probe    (device) benchmarks/fa3_mla_probe.py on /tmp/fa3mla, then on /tmp/site (tokenspeed) if there
#   clean    (device) rm -rf /tmp/fa3src /tmp/fa3mla (a rebuild from scratch on a warm machine)
# Knobs: BUILD_S (build budget, s), MLA_ONLY=0 (also build the (64,64) and (64,256) kernels: 15 TUs
# instead of 5), MAX_JOBS (16), NVCC_THREADS (2), SPLIT_COMPILE (N > 0 adds nvcc --split-compile=N).
# ---------------------------------------------------------------------------------------------------
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
REPO=$PWD
KIT=.fa3src/fa3src.tar.xz
SRC=/tmp/fa3src
ART=/tmp/fa3mla
FA_REV=0251105a2fb19d2957484b7f023cd8c115286ced
CUT_REV=7127592069c2fe01b041e174ba4345ef9b279671
T0=$SECONDS
stamp() { echo "BUILD TIME $1: $((SECONDS - T0)) s since the command started"; }

unpack_xz() {  # tarball dest: tar's xz, else Python's lzma
  tar -xJf "$1" -C "$2" 2>/dev/null || python3 -c \
    "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" "$1" "$2"
}
xz_stream() {  # stdin -> xz on stdout: xz if installed, else Python's lzma
  if command -v xz >/dev/null; then xz -6 -T0; else
    python3 -c "import lzma, shutil, sys; shutil.copyfileobj(sys.stdin.buffer, lzma.open(sys.stdout.buffer, 'wb', preset=6))"
  fi
}

do_kit() {
  local fa=${FA_GIT:-/work/.mirror/Dao-AILab+flash-attention/repo}
  local cut=${CUT_GIT:-/work/.mirror/NVIDIA+cutlass/repo}
  local sub
  sub=$(git --git-dir="$fa" ls-tree "$FA_REV" csrc/cutlass | awk '{print $3}')
  [ "$sub" = "$CUT_REV" ] || { echo "cutlass submodule at $FA_REV is $sub, expected $CUT_REV"; return 1; }
  local tmp
  tmp=$(mktemp -d)
  mkdir -p "$tmp/fa3src/csrc/cutlass"
  # hopper/: the build files, every header, the two API sources, the combine and scheduler kernels,
  # the Python package, and the bf16 sm90 forward instantiations of every head dim (100 files of a
  # few hundred bytes: only hdim64_512 is built here; the rest lets a later build with other flags
  # in do_build, e.g. hdim192_128 for MLA's non-absorbed prefill, use the same kit).
  local files
  files=$(git --git-dir="$fa" ls-tree -r --name-only "$FA_REV" hopper | grep -E \
    '^hopper/([^/]+\.(h|hpp)|setup\.py|__init__\.py|flash_attn_interface\.py|flash_api(_stable)?\.cpp|flash_fwd_combine\.cu|flash_prepare_scheduler\.cu|flash_attn_3/[^/]+\.py|instantiations/flash_fwd_[^/]*bf16[^/]*_sm90\.cu)$')
  # shellcheck disable=SC2086
  git --git-dir="$fa" archive "$FA_REV" README.md LICENSE AUTHORS $files 2> >(grep -v 'invalid object' >&2) \
    | tar -x -C "$tmp/fa3src" || return 1
  git --git-dir="$cut" archive "$CUT_REV" include LICENSE.txt 2> >(grep -v 'invalid object' >&2) \
    | tar -x -C "$tmp/fa3src/csrc/cutlass" || return 1
  printf 'flash-attention %s\ncutlass %s\n' "$FA_REV" "$CUT_REV" > "$tmp/fa3src/KIT_SOURCES"
  mkdir -p .fa3src
  tar -C "$tmp" --sort=name --owner=0 --group=0 --numeric-owner --mtime=2026-08-15 -cf - fa3src \
    | xz -9 -T1 > "$KIT.tmp" && mv "$KIT.tmp" "$KIT"
  echo "files: $(find "$tmp/fa3src" -type f | wc -l) ($(find "$tmp/fa3src/hopper" -type f | wc -l) in hopper/," \
    "$(find "$tmp/fa3src/csrc" -type f | wc -l) in csrc/cutlass/); unpacked $(du -sh "$tmp/fa3src" | cut -f1)"
  rm -rf "$tmp"
  ls -l "$KIT"; sha256sum "$KIT"
}

do_build() {
  if [ -f "$SRC/.built" ] && ls "$ART"/flash_attn_3/_C*.so >/dev/null 2>&1; then
    echo "already built on this machine ($(ls "$ART"/flash_attn_3/_C*.so)): nothing to do (stage clean to rebuild)"
    return 0
  fi
  if [ ! -f "$SRC/.unpacked" ]; then
    [ -f "$KIT" ] || { echo "no $KIT here: carry .fa3src (made by the kit stage)"; return 2; }
    rm -rf "$SRC" && mkdir -p /tmp/fa3unpack && unpack_xz "$KIT" /tmp/fa3unpack && mv /tmp/fa3unpack/fa3src "$SRC" \
      && rmdir /tmp/fa3unpack || return 2
    python3 "$REPO/benchmarks/fa3_mla_patch.py" "$SRC/hopper" $([ "${MLA_ONLY:-1}" = 0 ] && echo --all-hdim64) \
      | tee "$SRC/patch.txt" || return 2
    touch "$SRC/.unpacked"
    stamp unpacked
  else
    echo "resuming the build in $SRC (unpacked by an earlier call on this machine)"
  fi
  {
    echo "host: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB RAM, /tmp free $(df -h /tmp | awk 'NR==2{print $4}')"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1
    nvcc --version 2>&1 | tail -2
    python3 - <<'PY' 2>&1
import importlib.metadata as md, sys, torch
from torch.utils.cpp_extension import CUDA_HOME
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "CUDA_HOME", CUDA_HOME)
for name in ("setuptools", "wheel", "packaging", "ninja"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "MISSING")
PY
    command -v ninja >/dev/null && echo "ninja binary $(ninja --version)" || echo "ninja binary: not on PATH"
  } | tee "$OUT/env.txt"
  # A pip-installed CUDA (nvidia/cu13 layout) ships libcudart.so.13 but no libcudart.so, and the link
  # step says -lcudart: give the linker an unversioned name through LIBRARY_PATH when it is missing.
  local cuda_home
  cuda_home=$(python3 -c "from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or '')" 2>/dev/null)
  if [ -n "$cuda_home" ] && [ ! -e "$cuda_home/lib64/libcudart.so" ] && [ ! -e "$cuda_home/lib/libcudart.so" ]; then
    local rt
    rt=$(ls "$cuda_home"/lib*/libcudart.so.* 2>/dev/null | head -1)
    [ -z "$rt" ] && rt=$(python3 -c "import glob, nvidia, os; print((glob.glob(os.path.join(nvidia.__path__[0], '*', 'lib', 'libcudart.so.*')) or [''])[0])" 2>/dev/null)
    if [ -n "$rt" ]; then
      mkdir -p /tmp/fa3libs && ln -sf "$rt" /tmp/fa3libs/libcudart.so
      export LIBRARY_PATH=/tmp/fa3libs${LIBRARY_PATH:+:$LIBRARY_PATH}
      echo "no libcudart.so under $cuda_home: linking through /tmp/fa3libs/libcudart.so -> $rt"
    fi
  fi
  local drop=""
  [ "${MLA_ONLY:-1}" = 0 ] || drop="flash_fwd_hdim64_bf16 flash_fwd_hdim64_256_bf16"
  local nvcc_append=""
  [ "${SPLIT_COMPILE:-0}" -gt 0 ] && nvcc_append="--split-compile=${SPLIT_COMPILE}"
  # Only the bf16 sm90 forward kernels of head dim 64 (setup.py's own switches): no backward, fp16,
  # fp8, sm80, other head dims, 192/128, softcap, local (sliding window) or append-KV; split,
  # paged KV, pack-GQA and varlen stay on because SGLang's MLA call reaches them (see the report).
  # The build gets BUILD_S seconds, less if the command has already used time (stash, unpack), so
  # that the log, the symbol list and the pack still fit in the call's 600 s.
  local budget=${BUILD_S:-480} log=/tmp/fa3build.log
  local room=$((540 - (SECONDS - T0)))
  [ "$room" -lt "$budget" ] && budget=$room
  echo "building (budget ${budget} s; FA3KIT_DROP='$drop'; NVCC_APPEND_FLAGS='$nvcc_append')"
  ( cd "$SRC/hopper" && exec env \
      FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTENTION_OFFLINE_BUILD=1 \
      FLASH_ATTENTION_DISABLE_BACKWARD=TRUE FLASH_ATTENTION_DISABLE_FP16=TRUE FLASH_ATTENTION_DISABLE_FP8=TRUE \
      FLASH_ATTENTION_DISABLE_SM80=TRUE FLASH_ATTENTION_DISABLE_HDIM96=TRUE FLASH_ATTENTION_DISABLE_HDIM128=TRUE \
      FLASH_ATTENTION_DISABLE_HDIM192=TRUE FLASH_ATTENTION_DISABLE_HDIM256=TRUE \
      FLASH_ATTENTION_DISABLE_HDIMDIFF192=TRUE FLASH_ATTENTION_DISABLE_SOFTCAP=TRUE \
      FLASH_ATTENTION_DISABLE_LOCAL=TRUE FLASH_ATTENTION_DISABLE_APPENDKV=TRUE FLASH_ATTENTION_DISABLE_CLUSTER=TRUE \
      FA3KIT_DROP="$drop" ${nvcc_append:+"NVCC_APPEND_FLAGS=$nvcc_append"} MAX_JOBS=${MAX_JOBS:-16} NVCC_THREADS=${NVCC_THREADS:-2} \
      NINJA_STATUS='[%f/%t %es] ' setsid python3 setup.py build_ext --inplace ) >> "$log" 2>&1 &
  local pid=$! end=$((SECONDS + budget)) stopped=0
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$SECONDS" -ge "$end" ]; then
      echo "build budget of ${budget} s used up: stopping it; call 'build' again on this warm machine to resume"
      kill -INT -- "-$pid" 2>/dev/null; sleep 8; kill -KILL -- "-$pid" 2>/dev/null; stopped=1; break
    fi
    sleep 3
  done
  wait "$pid"; local rc=$?
  stamp "build (setup.py rc=$rc)"
  grep -E '^fa3kit sources|^\[[0-9]+/[0-9]+ [0-9.]+s\]|error|Error|FAILED|undefined' "$log" \
    | grep -v -E 'warning|Werror|error_|_error|errors\.h' | sed -E 's/(\[[0-9]+\/[0-9]+ [0-9.]+s\]) .* -c ([^ ]+) .*/\1 \2/' | tail -n 40
  local bdir
  bdir=$(ls -d "$SRC"/hopper/build/temp.* 2>/dev/null | head -1)
  if [ -n "$bdir" ] && [ -f "$bdir/.ninja_log" ]; then
    awk -F'\t' 'NR>1 {printf "%7.1f s  %s\n", ($2-$1)/1000, $4}' "$bdir/.ninja_log" | sed "s#$SRC/hopper/##" \
      | sort -k3 | tee "$OUT/ninja-times.txt"
    echo "objects done: $(ls "$bdir"/*.o "$bdir"/instantiations/*.o 2>/dev/null | wc -l)"
  fi
  xz_stream < "$log" > "$OUT/build.log.xz"
  [ "$stopped" = 0 ] && [ "$rc" = 0 ] || { echo "BUILD NOT DONE (rc=$rc, stopped=$stopped)"; return 3; }
  local so
  so=$(ls "$SRC"/hopper/flash_attn_3/_C*.so 2>/dev/null | head -1)
  [ -n "$so" ] || { echo "no flash_attn_3/_C*.so after the build"; return 3; }
  rm -rf "$ART" && mkdir -p "$ART/flash_attn_3"
  cp "$so" "$ART/flash_attn_3/" && cp "$SRC"/hopper/flash_attn_3/*.py "$ART/flash_attn_3/" \
    && cp "$SRC/hopper/flash_attn_interface.py" "$SRC/hopper/flash_attn_config.py" "$ART/" \
    && cp "$SRC/KIT_SOURCES" "$SRC/patch.txt" "$ART/" || return 3
  echo "built: $(ls -l "$ART"/flash_attn_3/_C*.so | awk '{print $5, $NF}') ($(du -h "$ART"/flash_attn_3/_C*.so | cut -f1))"
  echo "run_mha_fwd instantiations defined in the .so:"
  nm -C --defined-only "$ART"/flash_attn_3/_C*.so 2>/dev/null | grep -o 'run_mha_fwd_<[^>]*>' | sort -u
  echo "undefined run_mha_fwd symbols (must be none): $(nm -C --undefined-only "$ART"/flash_attn_3/_C*.so \
    | grep -c 'run_mha_fwd')"
  echo "sm90 cubins: $(cuobjdump --list-elf "$ART"/flash_attn_3/_C*.so 2>/dev/null | grep -c sm_90)"
  (cd /tmp && PYTHONPATH=$ART python3 -c "import torch, flash_attn_3._C as c, flash_attn_config as f; \
print('load check: import ok', c.__file__); print('config', {k: v for k, v in f.CONFIG['build_flags'].items() if not v})") \
    || { echo "load check FAILED"; return 3; }
  touch "$SRC/.built"
  stamp "load check"
  do_pack
  stamp pack
}

do_pack() {
  [ -d "$ART/flash_attn_3" ] || { echo "nothing to pack: $ART is missing (build or use first)"; return 4; }
  rm -f "$OUT"/fa3mla.tar.xz*
  tar -C "$ART" -cf - . | xz_stream > /tmp/fa3mla.tar.xz || return 4
  local size
  size=$(stat -c %s /tmp/fa3mla.tar.xz)
  if [ "$size" -gt $((15 * 1024 * 1024)) ]; then
    split -b 15M /tmp/fa3mla.tar.xz "$OUT/fa3mla.tar.xz.part-"
    echo "packed: fa3mla.tar.xz $size bytes, in parts: $(ls "$OUT"/fa3mla.tar.xz.part-* | xargs -n1 basename | tr '\n' ' ')"
    echo "reassemble: cat fa3mla.tar.xz.part-* > fa3mla.tar.xz"
  else
    cp /tmp/fa3mla.tar.xz "$OUT/" && echo "packed: $OUT/fa3mla.tar.xz ($size bytes)"
  fi
  sha256sum /tmp/fa3mla.tar.xz
}

do_use() {
  local dir=.fa3mla
  if ls "$dir"/fa3mla.tar.xz.part-* >/dev/null 2>&1; then
    cat "$dir"/fa3mla.tar.xz.part-* > /tmp/fa3mla.tar.xz
  else
    cp "$dir/fa3mla.tar.xz" /tmp/fa3mla.tar.xz || { echo "no $dir/fa3mla.tar.xz: carry .fa3mla"; return 5; }
  fi
  rm -rf "$ART" && mkdir -p "$ART" && unpack_xz /tmp/fa3mla.tar.xz "$ART" || return 5
  ls -l "$ART" "$ART/flash_attn_3"
}

do_probe() {
  ls "$ART"/flash_attn_3/_C*.so >/dev/null 2>&1 || { echo "no built module in $ART: build (or use) first"; return 6; }
  local probe="$REPO/benchmarks/fa3_mla_probe.py" left=$((585 - (SECONDS - T0)))
  if [ "$left" -lt 60 ]; then
    echo "only ${left} s left in this call: run 'probe' in the next call (the build stays in $ART)"; return 6
  fi
  local each=$(( left / 2 < ${PROBE_S:-240} ? left / 2 : ${PROBE_S:-240} ))
  # Each FA3 in its own process, from /tmp so that no source tree shadows the module.
  (cd /tmp && PYTHONPATH=$ART timeout "$each" python3 "$probe" --label built) 2>&1 | tee "$OUT/probe.txt"
  stamp "probe built"
  if [ -f /tmp/site/flash_attn_3/__init__.py ] || ls /tmp/site/flash_attn_3/_C*.so >/dev/null 2>&1; then
    (cd /tmp && PYTHONPATH=/tmp/site timeout "$each" python3 "$probe" --label tokenspeed-fa3 \
      --negative-control) 2>&1 | tee -a "$OUT/probe.txt"
    stamp "probe tokenspeed-fa3"
  else
    echo "tokenspeed-fa3 not installed in /tmp/site: negative control skipped (stages stash1 + neg)" | tee -a "$OUT/probe.txt"
  fi
}

FA3WHL=tokenspeed_fa3-3.0.0.post20260810-cp39-abi3-manylinux_2_28_x86_64.whl
for what in "$@"; do
  case "$what" in
    kit) do_kit || exit 1 ;;
    stash1) mkdir -p /tmp/fa3neg && cp .whl1/* /tmp/fa3neg/ && echo "stashed .whl1" ;;
    neg)
      cp .whl2/* /tmp/fa3neg/ && cat /tmp/fa3neg/fa3.part.* > "/tmp/fa3neg/$FA3WHL" \
        && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          "/tmp/fa3neg/$FA3WHL" && echo "tokenspeed-fa3 installed in /tmp/site" || echo "neg: install FAILED" ;;
    build) do_build || exit $? ;;
    pack) do_pack || exit $? ;;
    use) do_use || exit $? ;;
    probe) do_probe ;;
    clean) rm -rf "$SRC" "$ART" /tmp/fa3build.log /tmp/fa3libs && echo "cleaned" ;;
    *) echo "unknown stage $what (kit stash1 neg build pack use probe clean)"; exit 2 ;;
  esac
done
