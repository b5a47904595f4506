"""The full-size fp8 DiT built under cudaMallocAsync (ComfyUI's default allocator) leaves the card holding little more
than its tensors once the build's temporaries are given back.

Each build runs in a fresh process (the allocator is chosen at CUDA's start), from a full-size random-weight
fp8_e4m3fn file written by ``bench/full_size_files.py``. The same build with ``dit_build``'s packing switched off in
that process is printed beside it (what the card held before packing).

Run on the device machine through ``bash bench/product_path_device.sh gpu-test tests/gpu/test_dit_build_memory_gpu.py``
(about 2 minutes; 31 GB of disk).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
OVER_TENSORS_GIB = 1.5
"""What the card may hold beyond the process's empty CUDA context and the built DiT's tensors, after
``empty_cache()`` (the fp8 GEMM and attention libraries' own allocations included)."""

BUILD = r"""
import json, sys, time
import torch
sys.path.insert(0, "scripts")
from pack import load_pack
load_pack()
from qwen_edit_hopper.fp8 import Fp8Config
from qwen_edit_hopper.qwen_edit import dit_build
from qwen_edit_hopper.qwen_edit.checkpoints import resolve_single_files

dit, te, vae, packed = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "packed"
if not packed:
    dit_build.pack_tensors = lambda *args, **kwargs: 0
torch.zeros(1, device="cuda")
free, total = torch.cuda.mem_get_info()
context = total - free
config = Fp8Config(backend="scaled_mm_rowwise", preset="attn+mlp+mod compute", storage_layers="fp8",
                   fast_accum=True, gemm_kernel="cublaslt")
started = time.perf_counter()
built = dit_build.build_dit(dit_build.DitSource(resolve_single_files(dit, te, vae)), device="cuda", fp8_config=config)
torch.cuda.synchronize()
seconds = time.perf_counter() - started
torch.cuda.empty_cache()
free, total = torch.cuda.mem_get_info()
print(json.dumps({"packed": packed, "backend": torch.cuda.get_allocator_backend(), "context": context,
                  "card": total - free, "allocated": torch.cuda.memory_allocated(),
                  "reserved": torch.cuda.memory_reserved(), "seconds": seconds}))
"""


def _build(files: dict[str, Path], packed: bool) -> dict:
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    result = subprocess.run([sys.executable, "-c", BUILD, str(files["dit"]), str(files["text_encoder"]),
                             str(files["vae"]), "packed" if packed else "unpacked"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_built_fp8_dit_leaves_no_pool_holes_under_cuda_malloc_async(tmp_path: Path):
    models = tmp_path / "models"
    subprocess.run([sys.executable, "bench/full_size_files.py", str(models), "--dit", "fp8", "--loras", "none",
                    "--json", str(tmp_path / "written.json")], cwd=ROOT, check=True, timeout=300)
    written = json.loads((tmp_path / "written.json").read_text())["files"]
    files = {role: Path(written[role]["path"]) for role in ("dit", "text_encoder", "vae")}
    try:
        rows = {packed: _build(files, packed) for packed in (False, True)}
    finally:
        shutil.rmtree(models)  # 31 GB: the device's disk holds two such sets at most
    print("\nbuild under cudaMallocAsync | s | tensors GiB | card GiB above the context | beyond the tensors GiB")
    for packed, row in rows.items():
        over = (row["card"] - row["context"] - row["allocated"]) / GIB
        print(f"{'packed' if packed else 'unpacked'} | {row['seconds']:.2f} | {row['allocated'] / GIB:.2f} | "
              f"{(row['card'] - row['context']) / GIB:.2f} | {over:.2f}")
    packed = rows[True]
    assert packed["backend"] == "cudaMallocAsync"
    assert packed["allocated"] == pytest.approx(rows[False]["allocated"], rel=0.02)
    assert (packed["card"] - packed["context"] - packed["allocated"]) / GIB <= OVER_TENSORS_GIB, packed
