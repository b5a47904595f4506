"""What the first cuDNN FP8 attention call of a process costs with an empty and with a warm CUDA driver JIT cache.

An empty-cache start (server start to the first image, fresh Inductor and Triton caches) took 27.6 s for its first
step on a fresh H200 and 16.8 s on one that had run the same workflow shortly before. Caches outside Inductor's and
Triton's folders may explain part of it: the CUDA driver's JIT cache (``CUDA_CACHE_PATH``, by default
``~/.nv/ComputeCache``, machine-wide), where code compiled at run time from PTX is kept, and PyTorch's own
run-time kernel cache (``PYTORCH_KERNEL_CACHE_PATH``). This test runs the same child process twice on one pair of
such folders, empty at the first run: each child makes full-size joint-attention inputs (batch 2, 24 heads, 8492
tokens: a 1024x1024 edit with one reference and a 300-token text, head dim 128) and times its first and second
``cudnn_fp8`` attention call. It prints both children's times and what the folders hold after each, and checks each
output against PyTorch's bf16 attention. The times are printed, not asserted.

Run on the device machine::

    python3 -m pytest tests/gpu/test_first_call_driver_cache_gpu.py -m gpu -q -s
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from fp8.attention import attention

started = time.perf_counter()
generator = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(2, 24, 8492, 128, device="cuda", generator=generator, dtype=torch.bfloat16)
           for _ in range(3))
torch.cuda.synchronize()
times = []
for _ in range(2):
    t0 = time.perf_counter()
    out = attention(q, k, v, "cudnn_fp8")
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
reference = attention(q, k, v, "sdpa")
error = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
print(json.dumps({"first_s": times[0], "second_s": times[1], "error": error, "finite": bool(out.isfinite().all()),
                  "process_s": time.perf_counter() - started}))
"""


def _folder(path: Path) -> str:
    files = [p for p in path.rglob("*") if p.is_file()]
    return f"{len(files)} files, {sum(p.stat().st_size for p in files) / 2**20:.1f} MiB"


def test_first_cudnn_fp8_attention_call_with_an_empty_and_a_warm_driver_cache(tmp_path):
    driver, kernels = tmp_path / "cuda-jit", tmp_path / "torch-kernels"
    driver.mkdir()
    kernels.mkdir()
    runs = []
    for label in ("empty", "warm"):
        env = {**os.environ, "CUDA_CACHE_PATH": str(driver), "PYTORCH_KERNEL_CACHE_PATH": str(kernels),
               "TRITON_CACHE_DIR": str(tmp_path / f"triton-{label}"),
               "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{label}")}
        done = subprocess.run([sys.executable, "-c", CHILD, str(ROOT)], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result.update(label=label, driver_cache=_folder(driver), kernel_cache=_folder(kernels))
        runs.append(result)
    print()
    for run in runs:
        print(f"{run['label']} caches: first cudnn_fp8 call {run['first_s']:.2f} s, second {run['second_s'] * 1e3:.1f} "
              f"ms, child process {run['process_s']:.1f} s; afterwards the driver JIT cache holds "
              f"{run['driver_cache']}, PyTorch's kernel cache {run['kernel_cache']}; error against bf16 "
              f"{run['error']:.2e}")
    for run in runs:
        assert run["finite"], f"{run['label']}: cudnn_fp8 attention gave non-finite values"
        assert run["error"] < 0.1, f"{run['label']}: cudnn_fp8 attention is {run['error']:.2e} from bf16 attention"
