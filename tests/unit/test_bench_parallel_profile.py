"""bench/parallel_bench.py on the CPU: two gloo ranks profile the tiny DiT's sharded forward; an A/B of forward options
within one run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

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
    collectives = out.split("collectives (host ops):")[1]  # every one, however short on a loaded CPU
    assert "alltoall" in collectives  # the (functional) all-to-all around the attention ran and was profiled
    assert "wait_tensor" in collectives  # the shipped exchange is the traced one: functional collectives


def test_more_ranks_than_gpus_are_refused_before_any_file_is_written(tmp_path):
    if torch.cuda.device_count() >= 8:
        pytest.skip("8 GPUs visible")
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "parallel_bench.py"), str(tmp_path),
                          "--profile-degree", "8"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert f"--profile-degree 8: {torch.cuda.device_count()} GPUs visible" in run.stderr
    assert not any(tmp_path.iterdir())  # no DiT file written


def test_a_second_options_set_reruns_the_multi_gpu_layouts_only_against_the_first_row(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "parallel_bench.py"), str(tmp_path), "--tiny",
                          "--layouts", "1,u2", "--size", "128", "--steps", "2", "--options", "shipped",
                          "--options", "shipped-without:ulysses_traced_exchange"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith(("| 1:", "| u2:"))]
    assert [row.split(" | ")[:2] for row in rows] == [
        ["| 1: one GPU (batched CFG)", "shipped"],
        ["| u2: Ulysses sequence parallel 2 on 2 devices (0, 1)", "shipped"],
        ["| u2: Ulysses sequence parallel 2 on 2 devices (0, 1)", "shipped except ulysses_traced_exchange=False"]]
    diffs = [float(row.rstrip(" |").rsplit("| ", 1)[1]) for row in rows]
    assert diffs[0] == 0.0 and all(d < 1e-4 for d in diffs)  # against the one-device latents; fp32 on the CPU


def test_a_profile_takes_one_options_set(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "parallel_bench.py"), str(tmp_path), "--tiny",
                          "--profile-degree", "2", "--options", "shipped", "--options", "unfused"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert "--profile-degree: one --options at a time" in run.stderr
    assert not any(tmp_path.iterdir())


def test_the_summary_counts_each_kernel_once_not_again_under_the_host_op_that_launched_it():
    sys.path.insert(0, str(ROOT / "bench"))
    from parallel_bench import profile_summary
    from torch.autograd import DeviceType

    def event(key, device_us, kind, cpu_us=0.0):
        return SimpleNamespace(key=key, self_device_time_total=device_us, device_type=kind, count=60,
                               self_cpu_time_total=cpu_us)

    averages = [event("qwen_edit_hopper::cudnn_fp8_attention", 31_800.0, DeviceType.CPU, 12_000.0),
                event("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f8", 31_800.0, DeviceType.CUDA),
                event("nccl:all_to_all", 37_200.0, DeviceType.CPU, 900.0),
                event("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 37_200.0, DeviceType.CUDA)]
    out = profile_summary(SimpleNamespace(key_averages=lambda: averages), wall_ms=100.0)
    assert "kernels outside NCCL 31.8 ms (32% of the wall)" in out
    assert "by category: NCCL 37.2 ms, attention 31.8 ms" in out
    kernels = out.split("top kernels:")[1].split("top host-side ops")[0]
    assert "qwen_edit_hopper::cudnn_fp8_attention" not in kernels and "nccl:all_to_all" not in kernels
    assert "qwen_edit_hopper::cudnn_fp8_attention" in out.split("top host-side ops")[1]
    assert out.split("collectives (host ops): ")[1] == "nccl:all_to_all x60"
