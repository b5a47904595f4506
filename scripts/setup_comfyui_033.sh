#!/usr/bin/env bash
# Build (or reuse) ComfyUI 0.33.0 beside 0.3.75 in the test environment; setup_test_env.sh calls it
# after the base environment (.testenv, ComfyUI 0.3.75) is ready.
#
# ComfyUI 0.33.0 (upstream master of 2026-08-22, commit 783545f689a0af730065994b46b382ae24844c99) is not
# on the package index as a source tree: it comes from the vendored archive comfyui-0.33.0.tar.gz, taken
# from $QWEN_EDIT_VENDOR_DIR, else from the folder shared/vendor beside this checkout, and checked
# against its sha256. It gives:
#   - .testenv/comfyui-0.33.0: the archive's tree, plus the empty user folders the archive leaves out;
#   - .testenv/venv-0.33.0: a virtualenv holding what 0.33.0 needs beyond the base environment (its
#     requirements.txt: comfy-kitchen, comfy-aimdo, frontend 1.49.6, templates, SQLAlchemy, blake3, ...).
#     It sees the base environment's packages (torch, diffsynth, the pack's requirements) through a .pth
#     file, after its own: 0.33.0 runs its own frontend and templates, and the same torch as 0.3.75
#     (constraints-test.txt pins torch/torchvision/torchaudio). About 0.9 GB and 20 s, against 6 GB and
#     minutes for a second full environment.
# Reused while the archive, the constraints, the pack's requirements and this script are unchanged.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
env_dir="$root/.testenv"
comfy_dir="$env_dir/comfyui-0.33.0"
venv_dir="$env_dir/venv-0.33.0"
constraints="$root/scripts/constraints-test.txt"
archive_name="comfyui-0.33.0.tar.gz"
archive_sha256="54ee62205713a0acb9e04c40d5e297e8f4fdc01a2a6c3327b8f763a79463e368"
vendor_dir=${QWEN_EDIT_VENDOR_DIR:-$(dirname "$root")/shared/vendor}
archive="$vendor_dir/$archive_name"
base_py="$env_dir/bin/python"

[ -x "$base_py" ] || { echo "ComfyUI 0.33.0: the base environment $env_dir is missing (run scripts/setup_test_env.sh)"; exit 1; }
stamp_src=$(cat "$0" "$constraints" "$root/requirements.txt" | sha256sum | cut -d' ' -f1)-$archive_sha256
if [ -f "$venv_dir/.ready" ] && [ "$(cat "$venv_dir/.ready")" = "$stamp_src" ] && [ -d "$comfy_dir/comfy" ]; then
  echo "ComfyUI 0.33.0: reusing $comfy_dir and $venv_dir"
  exit 0
fi

if [ ! -f "$archive" ]; then
  echo "ComfyUI 0.33.0: source archive not found at $archive."
  echo "  The tests run on ComfyUI 0.3.75 and 0.33.0; 0.33.0 comes from $archive_name (sha256 $archive_sha256)."
  echo "  Put it in the folder shared/vendor beside this checkout, or set QWEN_EDIT_VENDOR_DIR to its folder."
  exit 1
fi
actual=$(sha256sum "$archive" | cut -d' ' -f1)
if [ "$actual" != "$archive_sha256" ]; then
  echo "ComfyUI 0.33.0: $archive has sha256 $actual, expected $archive_sha256: not the vendored release; refusing it"
  exit 1
fi

echo "ComfyUI 0.33.0: building $comfy_dir and $venv_dir"
rm -rf "$comfy_dir" "$venv_dir"
mkdir -p "$comfy_dir"
tar -xzf "$archive" -C "$comfy_dir"
mkdir -p "$comfy_dir"/{custom_nodes,models,input,output,user}

"$base_py" -m venv "$venv_dir"
py="$venv_dir/bin/python"
base_site=$("$base_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
venv_site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$base_site" >"$venv_site/qwen-edit-testenv-base.pth"
"$py" -c 'import torch' || { echo "ComfyUI 0.33.0: the venv does not see the base environment's torch"; exit 1; }
"$py" -m pip install --disable-pip-version-check -q -c "$constraints" \
  -r "$comfy_dir/requirements.txt" -r "$root/requirements.txt"
torch_base=$("$base_py" -c 'import torch; print(torch.__version__)')
torch_venv=$("$py" -c 'import torch; print(torch.__version__)')
[ "$torch_base" = "$torch_venv" ] || { echo "ComfyUI 0.33.0: torch changed ($torch_base -> $torch_venv)"; exit 1; }

(cd "$comfy_dir" && "$py" main.py --cpu --quick-test-for-ci --database-url sqlite:///:memory: \
  >"$env_dir/comfyui-0.33.0-quick-test.log" 2>&1) \
  || { echo "ComfyUI 0.33.0 quick test failed:"; tail -n 40 "$env_dir/comfyui-0.33.0-quick-test.log"; exit 1; }
echo "$stamp_src" >"$venv_dir/.ready"
echo "ComfyUI 0.33.0: ready"
