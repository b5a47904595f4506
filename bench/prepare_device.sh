#!/usr/bin/env bash
# Two uses.
# On the GPU machine, from the repository root: `source bench/prepare_device.sh --device` installs the carried
#   wheels (.whl/) into /tmp/site and, when the Transformer Engine pieces were sent (/root/tec) with .tew carried,
#   builds and installs TE 2.20.2; it exports PYTHONPATH, CUDNN_PATH and LD_LIBRARY_PATH (PyTorch's cuDNN first).
# Here (no GPU), before device calls, `bash bench/prepare_device.sh` fills the ignored folders a GPU call carries.
#   .whl/        py3.12 manylinux wheels the GPU image lacks (`--device` installs them there)
#   .comfy_src/  ComfyUI 0.3.75's Python source (the harness's ComfyUI anchors), from .testenv/comfyui
#                (app/frontend_management included: a server imports it; bench/product_path_device.sh prepares
#                what a whole server needs)
# Both folders are ignored (.git/info/exclude); carry them: carry [".whl", ".comfy_src"].
# Needs scripts/setup_test_env.sh to have run (for .testenv/comfyui). Downloads about 20 MB.
if [ "${1:-}" = "--device" ]; then
  D=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn
  export PYTHONPATH=/tmp/site CUDNN_PATH=$D LD_LIBRARY_PATH=$D/lib PYTHONUNBUFFERED=1
  if [ -d .whl ] && [ ! -f /tmp/site/.wheels-ready ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
      && touch /tmp/site/.wheels-ready
  fi
  if [ -d .tew ] && ls /root/tec/tecore.part* >/dev/null 2>&1 && [ ! -f /tmp/site/.te-ready ]; then
    core=/root/tec/transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
    cat /root/tec/tecore.part* > "$core"
    echo "30063d3699e779cce63617c3458804f7a504ce8279f2749c98313db9daae273e  $core" | sha256sum -c
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$core" .tew/*.whl
    CPLUS_INCLUDE_PATH=$(ls -d /opt/torch/.venv/lib/python3.12/site-packages/nvidia/*/include | tr '\n' ':')
    export CPLUS_INCLUDE_PATH
    mkdir -p /tmp/tebuild && tar xzf .tew/transformer_engine_torch-2.20.2.tar.gz -C /tmp/tebuild
    (cd /tmp/tebuild/transformer_engine_torch-2.20.2 && NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_NO_LOCAL_VERSION=1 \
       MAX_JOBS=16 python3 -m pip wheel -q --no-build-isolation --no-deps -w /tmp/tew .)
    python3 -c "import zipfile,glob; zipfile.ZipFile(glob.glob('/tmp/tew/*.whl')[0]).extractall('/tmp/site')"
    python3 -c "import transformer_engine.pytorch as te; print('TE', te.is_fp8_available(return_reason=True))" \
      && touch /tmp/site/.te-ready
  fi
  return 0 2>/dev/null || exit 0
fi
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
mkdir -p .git/info
for p in /.whl/ /.comfy_src/; do
  grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >>.git/info/exclude
done
wheels=(diffsynth==2.1.12 modelscope modelscope-hub ftfy wcwidth cryptography cffi pycparser torchao==0.18.0
        nvidia-cudnn-frontend==1.16.0)
mkdir -p .whl
for w in "${wheels[@]}"; do
  name=${w%%==*}
  ls .whl/"$(echo "$name" | tr - _)"-* >/dev/null 2>&1 && continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64 -d .whl "$w"
done
if [ ! -d .comfy_src ]; then
  [ -d .testenv/comfyui ] || { echo "run scripts/setup_test_env.sh first (.testenv/comfyui missing)"; exit 1; }
  mkdir .comfy_src
  (cd .testenv/comfyui && tar cf - --exclude=__pycache__ --exclude='*.json' --exclude=tests --exclude=tests-unit \
     --exclude='*.safetensors' --exclude=models --exclude=web --exclude=input \
     --exclude=output --exclude=.git .) | (cd .comfy_src && tar xf -)
  # the harness's end-to-end part reads ComfyUI's Qwen2.5 tokenizer files (the other tokenizers are not needed)
  cp -r .testenv/comfyui/comfy/text_encoders/qwen25_tokenizer/. .comfy_src/comfy/text_encoders/qwen25_tokenizer/
fi
du -sh .whl .comfy_src
