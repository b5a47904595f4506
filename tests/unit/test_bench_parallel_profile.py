"""bench/parallel_bench.py --profile-degree on the CPU: two gloo ranks profile the tiny DiT's sharded forward."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_two_ranks_profile_the_sharded_forward_and_name_the_exchange(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "parallel_bench.py"), str(tmp_path), "--tiny",
                          "--profile-degree", "2", "--size", "128", "--warmup", "1", "--repeats", "2"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert ("128x128 edit, 1 reference(s), prompt branch (batch 1), Ulysses 2, CUDA graphs off, forward options "
            "shipped, CPU") in out
    assert "ms per forward over 2 calls" in out
    host_ops = out.split("top host-side ops (self time):")[1]
    assert "alltoall" in host_ops  # the (functional) all-to-all around the attention ran and was profiled
    assert "wait_tensor" in host_ops  # the shipped exchange is the traced one: functional collectives


def test_more_ranks_than_gpus_are_refused_before_any_file_is_written(tmp_path):
    if torch.cuda.device_count() >= 8:
        pytest.skip("8 GPUs visible")
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "parallel_bench.py"), str(tmp_path),
                          "--profile-degree", "8"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert f"--profile-degree 8: {torch.cuda.device_count()} GPUs visible" in run.stderr
    assert not any(tmp_path.iterdir())  # no DiT file written
