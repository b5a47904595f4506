#!/usr/bin/env bash
# Here (no GPU), before device calls: fill the ignored folders a GPU call carries.
#   .whl/        py3.12 manylinux wheels the GPU image lacks (bench/device_env.sh installs them there)
#   .comfy_src/  ComfyUI 0.3.75's Python source (the harness's ComfyUI anchors), from .testenv/comfyui
#                (app/frontend_management included: a server imports it; bench/product_path_device.sh prepares
#                what a whole server needs)
# Both folders are ignored (.git/info/exclude); carry them: carry [".whl", ".comfy_src"].
# Needs scripts/setup_test_env.sh to have run (for .testenv/comfyui). Downloads about 20 MB.
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
