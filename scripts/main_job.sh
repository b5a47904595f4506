#!/usr/bin/env bash
# The README's main-job command: build or reuse .testenv, start a headless ComfyUI with this pack,
# queue the default preset workflow through the HTTP API, print the output image path and timings.
#   bash scripts/main_job.sh                     # tiny model created on the fly (runs anywhere)
#   bash scripts/main_job.sh --models /path/to/ComfyUI/models [--gpu] [--preset fastest]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup_test_env.sh"
exec "$root/.testenv/bin/python" "$root/scripts/main_job.py" "$@"
