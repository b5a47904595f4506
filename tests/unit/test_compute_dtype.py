"""The compute dtype: bf16 on a GPU, float32 on a CPU, and the summary line that says which ran."""

from __future__ import annotations

import torch
from qwen_edit_hopper.qwen_edit.compute_dtype import compute_dtype, compute_note, dtype_label
from qwen_edit_hopper.qwen_edit.plan import PipePlan, Variant


def test_cpu_computes_in_float32_and_gpus_in_bf16():
    assert compute_dtype("cpu") is torch.float32
    assert compute_dtype(torch.device("cpu")) is torch.float32
    assert compute_dtype("cuda") is torch.bfloat16
    assert compute_dtype(torch.device("cuda", 1)) is torch.bfloat16


def test_the_summary_line_names_the_dtype_and_device():
    assert compute_note("cpu", torch.float32) == "compute dtype: float32 (cpu; bf16 on a GPU)"
    assert compute_note("cuda", torch.bfloat16) == "compute dtype: bf16 (cuda)"
    assert dtype_label(torch.float16) == "fp16"
    assert dtype_label(torch.float64) == "float64"


def test_plan_labels_carry_the_compute_dtype():
    plan = PipePlan(files=None, variant=Variant.EDIT_2509, variant_reason="test")
    assert plan.short_label() == "bf16"
    assert plan.short_label("float32") == "float32"
    assert "fp8: off (float32)" in plan.describe("float32")


def test_the_label_names_cuda_graphs_only_where_they_ran():
    from qwen_edit_hopper.qwen_edit.compile import CompileChoice

    plan = PipePlan(files=None, variant=Variant.EDIT_2509, variant_reason="test",
                    compile=CompileChoice(cuda_graphs=True))
    assert plan.short_label() == "bf16 + compiled + CUDA graphs"  # the request
    assert plan.short_label(cuda_graphs_ran=False) == "bf16 + compiled"
    assert plan.short_label(cuda_graphs_ran=True) == "bf16 + compiled + CUDA graphs"
