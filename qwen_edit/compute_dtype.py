"""The dtype the pack's models compute in: bf16 on a GPU, float32 on a CPU.

On a GPU every non-FP8 weight and activation is bf16 (Hopper's tensor cores; what the benchmarks measure).

On a CPU the pack computes in float32, as ComfyUI does on a CPU. bf16 is fast on a CPU only where it has bf16
instructions (AVX512-BF16, AMX); elsewhere PyTorch's bf16 convolutions fall back to a generic path. Measured on a
2-core machine, one Conv3d (64 channels, 130x130): float32 43 ms, bf16 9.7 ms with AVX512-BF16; limited to AVX2
(``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``): float32 63 ms, bf16 1568 ms. The main job's tiny edit
(256x256, 8 steps) took 87 s in bf16 and 14 s in float32 under AVX2, 3.7 s and 4.3 s with AVX512-BF16. float32
is the one choice that is fast on every CPU, and it gives the same numbers whatever the CPU's instructions.
"""

from __future__ import annotations

import torch

DTYPE_LABELS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "float32"}


def compute_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on CUDA (and any other accelerator), float32 on a CPU."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def dtype_label(dtype: torch.dtype) -> str:
    """A short name for run summaries: ``bf16``, ``fp16``, ``float32``."""
    return DTYPE_LABELS.get(dtype, str(dtype).removeprefix("torch."))


def compute_note(device: torch.device | str, dtype: torch.dtype) -> str:
    """The run summary's line: ``compute dtype: float32 (cpu; bf16 on a GPU)``, ``compute dtype: bf16 (cuda)``."""
    kind = torch.device(device).type
    return f"compute dtype: {dtype_label(dtype)} ({kind}{'; bf16 on a GPU' if kind == 'cpu' else ''})"
