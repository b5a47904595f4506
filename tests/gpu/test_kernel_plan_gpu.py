"""The shipped options on a Hopper GPU choose the kernels the fast forward has always run for the fastest preset.

Full-width DiT (dim 3072, 24 heads x 128, text dim 3584), 2 blocks (the choice is per block kind and shape, not per
block count), random weights, the fastest preset (row-wise fp8, "attn+mlp+mod compute", fast accumulation, the
cuBLASLt call, the text stream's Q/K/V fused), ``cudnn_fp8`` attention, a 1024x1024 edit with one reference (8192
image tokens), prompts of 300 / 287 text tokens, at batch 1 and batch 2 (true CFG). For each: the kernel plan's
``used`` list is :data:`EXPECTED`, and the pack's custom ops that ran (a profiler over one eager forward) are
exactly those the plan names. Run on the device machine::

    python3 -m pytest tests/gpu/test_kernel_plan_gpu.py -m gpu -q -rs
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from qwen_edit_hopper.fp8 import Fp8Config
from qwen_edit_hopper.fp8.attention import attention_capability
from qwen_edit_hopper.qwen_edit import fast_forward
from qwen_edit_hopper.qwen_edit.checkpoints.dit import DiTConfig
from qwen_edit_hopper.qwen_edit.fast.options import SHIPPED
from qwen_edit_hopper.qwen_edit.fast_forward import PreparedDit, batch_prompts, fast_model_fn
from qwen_edit_hopper.qwen_edit.fp8_dit import build_fp8_dit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_dit import build_random_dit, make_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WIDE = DiTConfig(dim=3072, num_layers=2, num_heads=24, head_dim=128, text_dim=3584)
FASTEST = Fp8Config(backend="scaled_mm_rowwise", preset="attn+mlp+mod compute", fast_accum=True,
                    gemm_kernel="cublaslt")

EXPECTED = {
    1: ("trim_last_block", "shared_modulation", "norm_quant", "gelu_gemm:image", "gelu_gemm:text",
        "qk_norm_rope_quant", "joint_v_gemm", "residual_epilogue:attention", "residual_epilogue:mlp", "small_m_gemm"),
    # batch 2: the text rows (600) are too many for the small-M kernel; everything else as at batch 1
    2: ("trim_last_block", "shared_modulation", "norm_quant", "gelu_gemm:image", "gelu_gemm:text",
        "qk_norm_rope_quant", "joint_v_gemm", "residual_epilogue:attention", "residual_epilogue:mlp"),
}
"""What the forward ran before the options existed (every switch at its default) on Hopper, fastest preset."""

LEFT_OUT = {
    1: {"gelu_quant": "the fused GELU GEMM computes every MLP's hidden state",
        "joint_v_quant": "the joint v GEMM writes v"},
    2: {"gelu_quant": "the fused GELU GEMM computes every MLP's hidden state",
        "joint_v_quant": "the joint v GEMM writes v"},
}

OPS = {  # kernel -> the custom ops it runs
    "norm_quant": ("qwen_edit_hopper::modulate_quantize_rowwise",),
    "gelu_gemm:image": ("qwen_edit_hopper::gelu_gemm_rowwise",),
    "gelu_gemm:text": ("qwen_edit_hopper::gelu_gemm_rowwise",),
    "gelu_quant": ("qwen_edit_hopper::gelu_quantize_rowwise",),
    "qk_norm_rope_quant": ("qwen_edit_hopper::qk_norm_rope_quantize",),
    "joint_v_gemm": ("qwen_edit_hopper::joint_v_gemm",),
    "joint_v_quant": ("qwen_edit_hopper::joint_v_quantize",),
    "residual_epilogue:attention": ("qwen_edit_hopper::cublaslt_rowwise_mm_residual",),
    "residual_epilogue:mlp": ("qwen_edit_hopper::cublaslt_rowwise_mm_residual",),
    "small_m_gemm": ("qwen_edit_hopper::fp8_gemm_small_m",),
}


@pytest.fixture(scope="module")
def fastest():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused kernels are written for Hopper (compute capability 9.0)")
    capability = attention_capability("cudnn_fp8", "cuda", head_dim=WIDE.head_dim, dtype=torch.bfloat16)
    if not capability.ok:
        pytest.skip(capability.reason)
    return build_fp8_dit(build_random_dit(WIDE), FASTEST)


def _inputs(batch: int) -> dict:
    x = make_inputs(WIDE, size=1024)
    prompts = x.pop("prompts")
    if batch == 1:
        return {**x, **prompts[0]}
    return {**x, **batch_prompts(prompts), "latents": x["latents"].expand(2, -1, -1, -1)}


def _pack_ops(fn) -> set[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages() if e.key.startswith("qwen_edit_hopper::")}


@pytest.mark.parametrize("batch", [1, 2])
def test_shipped_options_choose_the_kernels_the_defaults_did(fastest, batch, monkeypatch):
    prepared = PreparedDit(fastest)
    x = _inputs(batch)
    modulations = []
    real = fast_forward.block_modulations
    monkeypatch.setattr(fast_forward, "block_modulations", lambda *a: modulations.append(1) or real(*a))
    with torch.no_grad():
        ran = _pack_ops(lambda: fast_model_fn(prepared, **x, attention_backend="cudnn_fp8", options=SHIPPED))
    plan = prepared.last_plan
    print("\n" + plan.describe())
    assert plan.used == EXPECTED[batch], plan.describe()
    for name, reason in LEFT_OUT[batch].items():
        assert {c.name: c.reason for c in plan.left_out}[name] == reason
    expected_ops = {op for name in plan.used for op in OPS.get(name, ())}
    expected_ops |= {"qwen_edit_hopper::cudnn_fp8_attention", "qwen_edit_hopper::cublaslt_rowwise_mm"}
    if "norm_quant" in plan.used and not {"residual_epilogue:attention", "residual_epilogue:mlp"} <= set(plan.used):
        # the residual update's own kernel runs only at a site whose GEMM does not write the residual stream
        expected_ops.add("qwen_edit_hopper::residual_modulate_quantize_rowwise")
    assert ran == expected_ops, (sorted(ran - expected_ops), sorted(expected_ops - ran))
    assert modulations == [1]  # the shared-input launches ran, once per forward
