#!/usr/bin/env bash
# The product path at full size on the GPU machine in one command, and, here, what that command carries.
#
# Here (with network; once, in the checkout the device calls send):
#   bash bench/product_path_device.sh prepare --comfyui-033 PATH/comfyui-0.33.0.tar.gz
#       fills the ignored folder .device/ with xz archives: pack/ (diffsynth and what it imports), server/ (what a
#       ComfyUI server imports beyond the GPU image), av/ (PyAV), kitchen/ (comfy-kitchen, comfy-aimdo, blake3,
#       simpleeval: ComfyUI 0.33 only), comfyui-0.3.75/ (.testenv/comfyui's source, app/frontend_management
#       included), comfyui-0.33.0/ (the given tarball). py3.12 manylinux wheels, pinned below.
#   bash bench/product_path_device.sh commands
#       prints the device calls of every plan: command, carry list and MiB carried (64 MiB at most per call).
#
# On the GPU machine (from the repository root; results under $OUT):
#   bash bench/product_path_device.sh run PLAN [--dit fp8|bf16] [--drop-page-cache] [--comfyui-version V]
#                                                [product_path.py run options]
#       unpacks the carried (or stashed) archives into /root/qeh-site and /root/qeh-comfyui, writes the full-size
#       files with bench/full_size_files.py (kept when a warm machine already holds the same set), runs
#       bench/product_path.py's PLAN with a deadline inside this command's 600 s, leaves results.json, table.md,
#       the server logs and run.log in $OUT.
#   bash bench/product_path_device.sh stash
#       keeps the carried archives in /root/qeh-carry for the next call on the same warm machine (the machine is
#       given back 30 s after a call): what one call cannot carry within 64 MiB travels in an earlier one.
#   bash bench/product_path_device.sh files [--dit fp8|bf16] [--tiny]
#       only writes the files (needs .device/pack): an earlier call can spare a later one that minute.
#   bash bench/product_path_device.sh gpu-test [TEST ...]
#       the same set-up for ComfyUI 0.3.75, then the GPU tests named (default tests/gpu/test_product_path_tool_gpu.py).
#   bash bench/product_path_device.sh parallel [parallel_bench.py options]
#       the same set-up, then bench/parallel_bench.py on the models folder (it writes the fp8 DiT when missing) within
#       what is left of QEH_LIMIT; its output also goes to $OUT/parallel-<time>.log.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
DEV=.device
STASH=${QEH_STASH:-/root/qeh-carry}
SITE=${QEH_SITE:-/root/qeh-site}
SOURCES=${QEH_COMFYUI:-/root/qeh-comfyui}
LIMIT=${QEH_LIMIT:-580}   # seconds this command may take in all (the device tool stops it at 600)
PY=${PYTHON:-python3}
if [ -x .testenv/bin/python ] && [ -z "${PYTHON:-}" ]; then HERE_PY=.testenv/bin/python; else HERE_PY=$PY; fi

PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64
           --platform manylinux2010_x86_64 --platform manylinux_2_34_x86_64)
# What the GPU image lacks (its package list: aiohttp, yarl, pyyaml, safetensors, pillow, psutil, requests,
# transformers, einops, scipy, tqdm, ... are there), as the servers import it. Checked by starting both ComfyUI
# versions with only the image's packages and these: kornia (+kornia_rs) holds ImageScaleToTotalPixels' module,
# SQLAlchemy and pydantic are imported by 0.33's server, alembic by both versions' database set-up, and 0.33's
# video types import av.video.reformatter.ColorPrimaries, which av 16.0 lacks (hence av 18.1).
declare -A PKGS=(
  [pack]="diffsynth==2.1.12 modelscope==1.40.2 modelscope-hub==0.5.1 ftfy==6.3.1 wcwidth==0.9.4 cryptography==50.0.2
          cffi==2.1.1 pycparser==3.12 nvidia-cudnn-frontend==1.16.0"
  [server]="torchsde==0.2.6 trampoline==0.1.2 kornia==0.9.0 kornia-rs==0.2.0 spandrel==0.4.2 pydantic==2.14.4
            pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 pydantic-settings==2.16.3
            python-dotenv==1.2.4 alembic==1.20.1 mako==1.4.3 sqlalchemy==2.1.9"
  [av]="av==18.1.0"
  [kitchen]="comfy-kitchen==0.2.31 comfy-aimdo==0.4.13 blake3==1.0.11 simpleeval==1.0.8"
)
WHEEL_GROUPS=(pack server av kitchen)
COMFYUI_033_SHA256=54ee62205713a0acb9e04c40d5e297e8f4fdc01a2a6c3327b8f763a79463e368

say() { echo "== $* [${SECONDS}s]"; }
same() { [ -f "$1" ] && [ -f "$2" ] && [ "$(cat "$1")" = "$(cat "$2")" ]; }
die() { echo "ERROR: $*" >&2; exit 3; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }

# ------------------------------------------------------------------------------------------------ here

archive() {  # archive GROUP DIR CONTENTS: DIR's files -> .device/GROUP/GROUP.tar.xz, SHA256, CONTENTS
  local group=$1 dir=$2 contents=$3
  mkdir -p "$DEV/$group"
  tar -C "$dir" -cf - . | xz -9 -T0 > "$DEV/$group/$group.tar.xz.tmp" || die "packing $group"
  mv "$DEV/$group/$group.tar.xz.tmp" "$DEV/$group/$group.tar.xz"
  echo "$contents" > "$DEV/$group/CONTENTS"
  (cd "$DEV/$group" && sha256sum "$group.tar.xz" > SHA256)
  echo "$group: $(mib "$(stat -c %s "$DEV/$group/$group.tar.xz")") MiB ($contents)"
}

prepare() {
  local comfy033="" force=0
  while [ $# -gt 0 ]; do
    case $1 in
      --comfyui-033) comfy033=$2; shift 2 ;;
      --force) force=1; shift ;;
      *) die "prepare: unknown option $1" ;;
    esac
  done
  grep -qxF "/$DEV/" .gitignore || die ".gitignore must list /$DEV/"
  PREPARE_TMP=$(mktemp -d)
  trap 'rm -rf "$PREPARE_TMP"' EXIT
  local tmp=$PREPARE_TMP
  for group in "${WHEEL_GROUPS[@]}"; do
    local want; want=$(echo ${PKGS[$group]})
    if [ $force = 0 ] && [ -f "$DEV/$group/$group.tar.xz" ] && [ "$(cat "$DEV/$group/CONTENTS" 2>/dev/null)" = "$want" ]; then
      echo "$group: up to date"; continue
    fi
    # shellcheck disable=SC2086
    python3 -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 --implementation cp \
      "${PLATFORMS[@]}" --target "$tmp/$group" $want || die "pip could not fetch $group ($want)"
    # not imported by a server: comfy-kitchen's AMD backend, cudnn-frontend's C++ headers, bytecode caches
    rm -rf "$tmp/$group/comfy_kitchen/backends/hip" "$tmp/$group/include" "$tmp/$group/bin"
    find "$tmp/$group" -name __pycache__ -type d -prune -exec rm -rf {} +
    archive "$group" "$tmp/$group" "$want"
  done
  if [ $force = 1 ] || [ ! -f "$DEV/comfyui-0.3.75/comfyui-0.3.75.tar.xz" ]; then
    [ -f .testenv/comfyui/main.py ] || die "run scripts/setup_test_env.sh first (.testenv/comfyui missing)"
    mkdir -p "$tmp/c075"
    (cd .testenv/comfyui && tar cf - --exclude=__pycache__ --exclude=./tests --exclude=./tests-unit --exclude=./.git \
       --exclude='./models/*' --exclude='./output/*' --exclude='./input/*' --exclude='./user/*' \
       --exclude='./custom_nodes/*' --exclude='*.safetensors' .) | (cd "$tmp/c075" && tar xf -)
    [ -f "$tmp/c075/app/frontend_management.py" ] || die "ComfyUI 0.3.75 copy lacks app/frontend_management.py"
    archive comfyui-0.3.75 "$tmp/c075" "ComfyUI 0.3.75 from .testenv/comfyui"
  else
    echo "comfyui-0.3.75: up to date"
  fi
  if [ -n "$comfy033" ]; then
    echo "$COMFYUI_033_SHA256  $comfy033" | sha256sum -c --quiet || die "$comfy033 is not ComfyUI 0.33.0's tarball"
    mkdir -p "$tmp/c033" && tar xzf "$comfy033" -C "$tmp/c033"
    archive comfyui-0.33.0 "$tmp/c033" "ComfyUI 0.33.0 ($COMFYUI_033_SHA256)"
  elif [ ! -f "$DEV/comfyui-0.33.0/comfyui-0.33.0.tar.xz" ]; then
    echo "comfyui-0.33.0: not prepared (give --comfyui-033 PATH/comfyui-0.33.0.tar.gz)"
  fi
  commands
}

tree_bytes() {  # what a device call sends besides carried paths: tracked and untracked-not-ignored files
  git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1
}

commands() {
  local tree; tree=$(tree_bytes)
  local commit; commit=$(git rev-parse --short=10 HEAD)$(git diff --quiet HEAD -- 2>/dev/null || echo +dirty)
  echo "Working tree sent with every call: $(mib "$tree") MiB. Every call: timeout_s 600, kind nvidia-h100-x1"
  echo "(or nvidia-h200 for that card's table). Commit $commit is passed as --commit (the device has no .git)."
  call() {  # call "carry groups" "command"
    local total=$tree carry=() g
    for g in $1; do
      total=$((total + $(du -cb "$DEV/$g" | tail -1 | cut -f1)))
      carry+=("\"$DEV/$g\"")
    done
    echo "  command: $2"
    echo "  carry:   [$(IFS=,; echo "${carry[*]}")]   ($(mib $total) MiB)"
  }
  local base="pack server av"
  echo; echo "(a) ComfyUI 0.3.75 with its defaults: three independent calls"
  for plan in v075-first-images v075-twenty v075-twenty-warm-cache v075-core; do
    echo "- $plan: $($HERE_PY bench/product_path.py plan $plan --field description)"
    call "$base comfyui-0.3.75" "bash bench/product_path_device.sh run $plan --commit $commit"
  done
  echo; echo "(b) ComfyUI 0.33.0: comfy-kitchen kept on the machine and the files written first, then calls back to"
  echo "    back (each within 30 s of the last; a call that finds no kept archive stops at once and says so; one"
  echo "    that finds no files writes them)"
  call "kitchen pack" "bash bench/product_path_device.sh stash && bash bench/product_path_device.sh files [--dit bf16]"
  for plan in v033-defaults v033-twenty-warm-cache v033-no-dynamic-vram v033-core; do
    echo "- $plan: $($HERE_PY bench/product_path.py plan $plan --field description)"
    call "$base comfyui-0.33.0" "bash bench/product_path_device.sh run $plan --commit $commit"
  done
  echo "- v033-model-vram: $($HERE_PY bench/product_path.py plan v033-model-vram --field description)"
  call "$base comfyui-0.33.0" "bash bench/product_path_device.sh run v033-model-vram --dit bf16 --commit $commit"
  echo; echo "(c) The MODEL path against ComfyUI core's TorchCompileModel in one call: a first call compiles core's"
  echo "    prompt into caches kept on the machine (330-380 s), the second (within 30 s) runs both on one server"
  call "$base comfyui-0.3.75" "bash bench/product_path_device.sh run v075-model --dit bf16 --keep-caches --jobs core:compile --commit $commit"
  call "$base comfyui-0.3.75" "bash bench/product_path_device.sh run v075-model --dit bf16 --keep-caches --jobs core:compile*2,free,comfy_model_fp8*3,free,fastest*2 --commit $commit"
  echo "    On 0.33.0 (after the set-up of (b)), with a LoRA strength change on the MODEL path (ComfyUI's LoraLoaderModelOnly):"
  call "$base comfyui-0.33.0" "bash bench/product_path_device.sh run v033-model --dit bf16 --keep-caches --jobs core:compile --commit $commit"
  call "$base comfyui-0.33.0" "bash bench/product_path_device.sh run v033-model --dit bf16 --keep-caches --jobs core:compile*2,free,comfy_model_fp8*2,comfy_model_fp8:strength=1*2,comfy_model_fp8:strength=0.3*2,free,fastest*2 --commit $commit"
  echo; echo "(d) Several GPUs (kind nvidia-h200-x2 or larger): bench/parallel_bench.py with this set-up, e.g."
  call "$base comfyui-0.3.75" "bash bench/product_path_device.sh parallel --layouts 1,cfg2,u2"
  echo; echo "GPU test of this tool (tiny files through a GPU server):"
  call "$base comfyui-0.3.75" "bash bench/product_path_device.sh gpu-test"
  echo; echo "GPU tests that need no model files (one pytest log each under \$OUT), e.g. what the CUDA driver's JIT cache"
  echo "    does to the first cuDNN FP8 attention call:"
  call "$base comfyui-0.3.75" "bash bench/product_path_device.sh gpu-test tests/gpu/test_first_call_driver_cache_gpu.py"
  echo; echo "Afterwards, here: python3 bench/product_path.py record RESULTS.json [RESULTS.json ...]"
}

# ------------------------------------------------------------------------------------------------ device

find_group() {  # find_group GROUP: the folder holding GROUP's archive (carried, else stashed); keeps a carried one
  local group=$1
  if [ -f "$DEV/$group/$group.tar.xz" ]; then
    (cd "$DEV/$group" && sha256sum -c --quiet SHA256) || die "$DEV/$group: archive damaged (sha256)"
    if ! same "$DEV/$group/SHA256" "$STASH/$group/SHA256"; then
      mkdir -p "$STASH/$group" && cp -f "$DEV/$group"/* "$STASH/$group/"
    fi
    echo "$DEV/$group"
  elif [ -f "$STASH/$group/$group.tar.xz" ]; then
    echo "$STASH/$group"
  else
    return 1
  fi
}

unpack() {  # unpack GROUP INTO: extract GROUP's archive into INTO unless INTO already holds that archive
  local group=$1 into=$2 from
  from=$(find_group "$group") || return 1
  if ! same "$from/SHA256" "$into/.sha256"; then
    rm -rf "$into" && mkdir -p "$into"
    if command -v xz >/dev/null; then
      tar xJf "$from/$group.tar.xz" -C "$into" || die "unpacking $group"
    else  # no xz program: Python's own lzma
      $PY -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="tar")' \
        "$from/$group.tar.xz" "$into" || die "unpacking $group"
    fi
    cp "$from/SHA256" "$into/.sha256"
  fi
}

setup() {  # setup VERSION: site folders and ComfyUI source; exports PYTHONPATH, COMFYUI_SRC
  local version=$1 groups=(pack server av) missing=() group path=""
  [ "$version" = 0.33.0 ] && groups+=(kitchen)
  for group in "${groups[@]}" "comfyui-$version"; do
    find_group "$group" >/dev/null || missing+=("$group")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    die "missing ${missing[*]}: carry $(printf '.device/%s ' "${missing[@]}")or run 'stash' with them in an" \
        "earlier call on this warm machine (bash bench/product_path_device.sh commands, here, lists the calls)"
  fi
  for group in "${groups[@]}"; do
    unpack "$group" "$SITE/$group"
    path="$path:$SITE/$group"
  done
  unpack "comfyui-$version" "$SOURCES/$version"
  COMFYUI_SRC=$SOURCES/$version
  mkdir -p "$COMFYUI_SRC"/{custom_nodes,models,input,output,user}
  local cudnn=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn
  if [ -d $cudnn ]; then  # the cuDNN PyTorch loads, before a system copy
    export CUDNN_PATH=$cudnn LD_LIBRARY_PATH=$cudnn/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
  export PYTHONPATH=${path#:}${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 QWEN_EDIT_COMFYUI_DIR=$COMFYUI_SRC
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  say "ComfyUI $version in $COMFYUI_SRC; PYTHONPATH=$PYTHONPATH"
  $PY - <<'EOF' || die "the carried packages do not import"
import importlib.metadata as md, torch, diffsynth, av, aiohttp
print("python", __import__("sys").version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for name in ("diffsynth", "av", "comfy-kitchen", "comfy-aimdo", "kornia", "sqlalchemy", "pydantic", "transformers",
             "triton", "nvidia-cudnn-frontend"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name}: not installed")
EOF
}

models_dir() {  # the filesystem with the most room
  local best
  best=$(df --output=avail,target -B1 /root /tmp /var/tmp "$ROOT" 2>/dev/null | tail -n +2 | sort -rn | head -1)
  echo "$(echo "$best" | awk '{print $2}' | sed 's:/*$::')/qeh-models"
}

write_files() {  # write_files DIR DIT LORAS SIZE_FLAG: the plan's files, unless DIR holds that set already
  local dir=$1 dit=$2 loras=$3 tiny=$4 want
  want="dit=$dit loras=$loras $tiny"
  if [ "$(cat "$dir/.qeh-files" 2>/dev/null)" = "$want" ]; then
    say "files kept from an earlier call on this machine: $want ($(du -sh "$dir" | cut -f1))"
    return
  fi
  rm -rf "$dir" && mkdir -p "$dir"
  local need=$((31 * 2**30)) avail
  [ "$dit" = bf16 ] && need=$((52 * 2**30))
  [ -n "$tiny" ] && need=$((2**30))
  avail=$(df --output=avail -B1 "$dir" | tail -1)
  [ "$avail" -gt "$need" ] || die "$dir: $(mib "$avail") MiB free, the files need ~$(mib $need) MiB"
  say "writing files ($want) to $dir"
  # shellcheck disable=SC2086
  $PY bench/full_size_files.py "$dir" --dit "$dit" --loras "$loras" $tiny --json "$dir/written.json" \
    || die "writing the files failed"
  echo "$want" > "$dir/.qeh-files"
  sync
}

run() {
  local plan=${1:?usage: run PLAN [--dit fp8|bf16] [--drop-page-cache] [--comfyui-version V] [run options]}
  shift
  local dit=fp8 drop=0 tiny="" rest=() on=0.3.75
  while [ $# -gt 0 ]; do
    case $1 in
      --dit) dit=$2; shift 2 ;;
      --comfyui-version) on=$2; shift 2 ;;
      --drop-page-cache) drop=1; shift ;;
      --tiny) tiny=--tiny; rest+=("$1"); shift ;;
      *) rest+=("$1"); shift ;;
    esac
  done
  OUT=${OUT:-$ROOT/runs/product-path-$(date +%Y%m%d-%H%M%S)}
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/run.log") 2>&1
  say "run $plan on $(uname -n) $(date -u)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "cpus $(nproc); memory $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 2^20}' /proc/meminfo); disk:"
  df -h /root /tmp 2>/dev/null
  local version
  version=$($PY bench/product_path.py plan "$plan" --field comfyui) || die "unknown plan $plan"
  [ "$version" = any ] && version=$on  # the tiny plans run on either
  setup "$version"
  local models; models=${QEH_MODELS:-$(models_dir)}
  write_files "$models" "$dit" 4,8 "$tiny"  # the same set for every plan: a warm machine keeps it
  if [ $drop = 1 ]; then
    sync && echo 3 > /proc/sys/vm/drop_caches && say "page cache dropped: the first loads read the disk" \
      || say "could not drop the page cache"
  fi
  local left=$((LIMIT - SECONDS))
  say "product_path.py: $left s left"
  timeout -k 10 $((left - 5)) $PY bench/product_path.py run --comfyui "$COMFYUI_SRC" --models "$models" \
    --out "$OUT" --work "$(dirname "$models")/qeh-work" --plan "$plan" --deadline $((left - 15)) \
    --written "$models/written.json" "${rest[@]}"
  local rc=$?
  say "done (rc $rc)"
  return $rc
}

files_only() {
  local dit=fp8 tiny=""
  while [ $# -gt 0 ]; do
    case $1 in
      --dit) dit=${2:?--dit fp8|bf16}; shift 2 ;;
      --tiny) tiny=--tiny; shift ;;
      *) die "files: unknown option $1" ;;
    esac
  done
  unpack pack "$SITE/pack" || die "missing pack: carry .device/pack"
  export PYTHONPATH=$SITE/pack${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
  write_files "${QEH_MODELS:-$(models_dir)}" "$dit" 4,8 "$tiny"
  say "files ready"
}

stash() {
  local group found=0
  for group in "${WHEEL_GROUPS[@]}" comfyui-0.3.75 comfyui-0.33.0; do
    if [ -f "$DEV/$group/$group.tar.xz" ]; then
      find_group "$group" >/dev/null && found=1 && say "kept $group in $STASH/$group"
    fi
  done
  [ $found = 1 ] || die "nothing carried to keep: carry .device/GROUP"
  df -h "$STASH" | tail -1
}

gpu_test() {  # gpu_test [TEST ...]: the GPU tests named (default: this tool's) with ComfyUI 0.3.75 set up
  OUT=${OUT:-$ROOT/runs/product-path-test}
  mkdir -p "$OUT"
  setup 0.3.75
  [ $# -gt 0 ] || set -- tests/gpu/test_product_path_tool_gpu.py
  $PY -m pytest -m gpu -p no:cacheprovider -q -rs -s "$@" 2>&1 | tee "$OUT/pytest-$(date +%H%M%S).log"
}

parallel() {  # parallel [OPTION ...]: bench/parallel_bench.py with ComfyUI 0.3.75's set-up, within QEH_LIMIT
  OUT=${OUT:-$ROOT/runs/parallel}
  mkdir -p "$OUT"
  setup 0.3.75
  local models left log
  models=${QEH_MODELS:-$(models_dir)}
  left=$((LIMIT - SECONDS))
  [ $left -gt 30 ] || die "parallel: $left s left of QEH_LIMIT"
  log=$OUT/parallel-$(date +%H%M%S).log
  say "parallel_bench.py $* ($left s left)"
  timeout -k 10 $((left - 5)) $PY bench/parallel_bench.py "$models" "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  say "done (rc $rc)"
  return "$rc"
}

case ${1:-} in
  prepare) shift; prepare "$@" ;;
  commands) commands ;;
  run) shift; run "$@" ;;
  stash) stash ;;
  files) shift; files_only "$@" ;;
  gpu-test) shift; gpu_test "$@" ;;
  parallel) shift; parallel "$@" ;;
  *) sed -n '2,29p' "$0"; exit 2 ;;
esac
