"""The load-time NaN/Inf check on a CUDA device: no host sync per tensor, every format caught, and its cost.

Run on the device machine::

    python3 -m pytest -m gpu tests/gpu/test_integrity_gpu.py -q -rs -s

``-s`` shows the cost record of ``test_check_cost_against_the_load`` (the check's share of loading a
4 GB full-width DiT file onto the GPU; the target is under 2%). For the real model, run
``python3 bench/product_path.py integrity --device cuda --file <the DiT .safetensors>``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_adding_tensors_never_synchronizes_and_one_sync_tells():
    from qwen_edit_hopper.qwen_edit.checkpoints.integrity import FiniteCheck

    device = torch.device("cuda")
    tensors = {f"w{i}": torch.randn(256, 512, device=device, dtype=torch.bfloat16) for i in range(200)}
    tensors["fp8"] = torch.randn(64, 64, device=device).to(torch.float8_e4m3fn)
    tensors["scale"] = torch.ones((), device=device)
    tensors["w150"].view(-1)[12345] = float("nan")
    check = FiniteCheck()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for name, tensor in tensors.items():
            check.add(name, tensor)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert check.nonfinite() == ["w150"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
def test_every_format_is_checked_on_the_device(dtype):
    from qwen_edit_hopper.qwen_edit.checkpoints.integrity import FiniteCheck

    good = torch.randn(1024, 3072, device="cuda").to(dtype)
    bad = good.clone()
    if bad.element_size() == 1:
        bad.view(torch.uint8)[1000, 3000] = 0x7F if dtype == torch.float8_e4m3fn else 0x7C
    else:
        bad[1000, 3000] = float("inf")
    check = FiniteCheck()
    check.add("good", good)
    check.add("bad", bad)
    assert check.nonfinite() == ["bad"]


@pytest.mark.slow
def test_check_cost_against_the_load(tmp_path):
    """Six full-width blocks (about 4 GB): the figures are printed, not asserted (speed is not a test)."""
    from productpath import integrity

    path = integrity.write_synthetic_dit(tmp_path / "dit.safetensors", blocks=6)
    record = integrity.measure_integrity([path], "cuda", repeats=3)
    print("\n" + integrity.integrity_report(record))
    assert record["tensors"] > 6 * 30 and record["gbytes"] > 3
    assert record["plain_read_s"] > 0 and record["checked_read_s"] > 0 and record["check_alone_s"] > 0
