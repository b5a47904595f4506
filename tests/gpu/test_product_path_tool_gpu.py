"""The product-path tool through a ComfyUI server on the GPU, at the tiny sizes: the card's memory is sampled, the
Sampler's GPU memory line is read, the server runs on CUDA with ComfyUI's own allocator choice and survives.

Run on the device machine through ``bash bench/product_path_device.sh gpu-test`` (it puts the ComfyUI server's
packages on PYTHONPATH and ComfyUI 0.3.75's source in QWEN_EDIT_COMFYUI_DIR)::

    python3 -m pytest -m gpu tests/gpu/test_product_path_tool_gpu.py -q -rs
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from comfy_server import COMFYUI_DIR

SERVER_PACKAGES = ("torchsde", "av", "alembic")
"""Imported by a ComfyUI server, absent from the GPU image unless bench/product_path_device.sh set them up."""

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(any(importlib.util.find_spec(name) is None for name in SERVER_PACKAGES),
                       reason="a ComfyUI server's packages are missing: use bench/product_path_device.sh gpu-test"),
]

ROOT = Path(__file__).resolve().parents[2]
COMFYUI = Path(os.environ.get("QWEN_EDIT_COMFYUI_DIR", COMFYUI_DIR))
"""The ComfyUI source the server runs (bench/product_path_device.sh gpu-test points this at 0.3.75's)."""


def test_tiny_run_on_a_gpu_server_samples_the_card(tmp_path: Path):
    models, out = tmp_path / "models", tmp_path / "out"
    subprocess.run([sys.executable, "bench/full_size_files.py", str(models), "--tiny", "--device", "cuda",
                    "--loras", "4", "--json", str(tmp_path / "w.json")], cwd=ROOT, check=True, timeout=300)
    result = subprocess.run([sys.executable, "bench/product_path.py", "run", "--comfyui", str(COMFYUI),
                             "--models", str(models), "--out", str(out), "--work", str(tmp_path / "work"),
                             "--jobs", "low_vram,low_vram:vary,free,lightning", "--tiny", "--deadline", "500"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    assert results["card"]["name"] and results["device"] == "gpu"
    (server,) = results["servers"]
    assert "--cpu" not in server["command"]
    assert server["system_stats"]["devices"][0]["name"].startswith("cuda")
    assert server["idle"]["gpu_MiB"] > 0
    first, second, free, lightning = server["jobs"]
    for job in (first, second, lightning):
        assert job["ok"] and job["survived"], job
        assert job["gpu"]["peak_MiB"] >= job["gpu"]["held_MiB"] > 0
        assert job["stages"]["torch_peak_GiB"] >= job["stages"]["torch_held_GiB"] >= 0
    assert lightning["stages"]["graphs_compiled"] >= 1 and "first_step_s" in lightning["stages"]
    assert free["ok"] and free["gpu"]["held_MiB"] > 0
