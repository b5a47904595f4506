#!/usr/bin/env bash
# The README's test command: build or reuse .testenv, then lint and run the whole suite.
# Extra arguments go to pytest (e.g. -k sampler). GPU tests are deselected here (no GPU in CI);
# on the device machine run: python3 -m pytest -m gpu tests/gpu
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup_test_env.sh"
cd "$root"
.testenv/bin/ruff check .
set +e
.testenv/bin/python -m pytest -m "not gpu" -p no:cacheprovider "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing (exit 5 counts as failure)"
  exit 1
fi
exit "$status"
