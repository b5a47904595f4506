"""The fast forward's options and kernel choice (qwen_edit/fast/options.py, kernel_plan.py), on CPU.

On this CPU every fused kernel is left out, each with its reason. With the device described as a Hopper GPU
(``DeviceFacts``) and a tiny model whose layers are the kinds the kernels are written for (row-wise fp8, fast
accumulation, the cuBLASLt call, a column bound), the shipped options choose the fused kernels and options variants
flip the plan. The plan is made once per signature by the model's ``PreparedDit``. Which kernels actually run on a
Hopper GPU at full size: tests/gpu/test_kernel_plan_gpu.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from qwen_edit_hopper.fp8 import Fp8Config
from qwen_edit_hopper.fp8.linear import ScaledMMLinear
from qwen_edit_hopper.qwen_edit.fast.block_kernels import BlockKernels
from qwen_edit_hopper.qwen_edit.fast.kernel_plan import DeviceFacts, ForwardShape, select_kernels
from qwen_edit_hopper.qwen_edit.fast.options import SHIPPED, UNFUSED, ForwardOptions
from qwen_edit_hopper.qwen_edit.fast.prepared import PreparedDit
from qwen_edit_hopper.qwen_edit.fast_forward import fast_model_fn, kernel_plan
from qwen_edit_hopper.qwen_edit.fp8_dit import build_fp8_dit
from test_fast_forward import build_dit, make_inputs

KERNELS = ("trim_last_block", "shared_modulation", "norm_quant", "gelu_gemm:image", "gelu_gemm:text", "gelu_quant",
           "qk_norm_rope_quant", "joint_v_gemm", "joint_v_quant", "residual_epilogue:attention",
           "residual_epilogue:mlp", "small_m_gemm")
HOPPER = DeviceFacts(torch.device("cuda"), (9, 0))
SHAPE = ForwardShape(batch=1, image_tokens=8192, target_tokens=4096, text_tokens=300, timestep_rows=1,
                     zero_cond_t=False, text_mask=False, dtype=torch.bfloat16)
FASTEST = Fp8Config(backend="scaled_mm_rowwise", preset="attn+mlp+mod compute", emulate=True, fast_accum=True,
                    gemm_kernel="cublaslt")


def _as_on_a_gpu(dit: torch.nn.Module) -> torch.nn.Module:
    """The emulated fp8 layers described as real ones (not emulated, with the column bound CUDA layers keep): their
    kind is all the kernel choice reads; nothing runs here."""
    for layer in dit.modules():
        if isinstance(layer, ScaledMMLinear):
            layer.emulate = False
            layer.column_bound = torch.ones(2)
    return dit


@pytest.fixture(scope="module")
def fastest():
    return _as_on_a_gpu(build_fp8_dit(build_dit(torch.bfloat16), FASTEST))


def test_options_are_validated_hashable_values():
    assert ForwardOptions() == SHIPPED and hash(ForwardOptions()) == hash(SHIPPED)
    assert ForwardOptions(gelu_gemm=["text", "image"]).gelu_gemm == ("image", "text")  # one order, a tuple
    assert dataclasses.replace(SHIPPED, joint_v_gemm=False).describe() == "shipped except joint_v_gemm=False"
    assert SHIPPED.describe() == "shipped"
    with pytest.raises(ValueError, match="gelu_gemm must be a tuple"):
        ForwardOptions(gelu_gemm="image")
    with pytest.raises(ValueError, match="'video' not allowed"):
        ForwardOptions(gelu_gemm=("video",))
    with pytest.raises(ValueError, match="residual_epilogue names a value twice"):
        ForwardOptions(residual_epilogue=("mlp", "mlp"))
    with pytest.raises(ValueError, match="trim_last_block must be True or False"):
        ForwardOptions(trim_last_block=1)
    with pytest.raises(ValueError, match="ulysses_traced_exchange must be True or False"):
        ForwardOptions(ulysses_traced_exchange="yes")
    with pytest.raises(ValueError, match="ulysses_fp8_exchange must be True or False"):
        ForwardOptions(ulysses_fp8_exchange="on")
    with pytest.raises(dataclasses.FrozenInstanceError):
        SHIPPED.small_m_gemm = False


def test_the_plan_carries_the_options():
    from qwen_edit_hopper.qwen_edit.plan import PipePlan, Variant

    plan = PipePlan(files=None, variant=Variant.EDIT_2509, variant_reason="test")
    assert plan.forward == SHIPPED and "fast forward options: shipped" in plan.describe()
    variant = plan.with_forward(UNFUSED)
    assert plan.forward == SHIPPED and variant.forward == UNFUSED and hash(variant) != hash(plan)
    assert "options: " in variant.short_label() and "options" not in plan.short_label()


@pytest.mark.parametrize("emulated", [True, False], ids=["emulated-fp8", "fp8-layers"])
def test_shipped_options_on_cpu_leave_every_fused_kernel_out_with_a_reason(emulated):
    dit = build_fp8_dit(build_dit(torch.bfloat16), FASTEST)
    if not emulated:
        _as_on_a_gpu(dit)
    plan = select_kernels(dit, SHIPPED, torch.device("cpu"), "cudnn_fp8", SHAPE)
    assert tuple(c.name for c in plan.choices) == KERNELS
    assert plan.used == ("trim_last_block",)
    reasons = {c.name: c.reason for c in plan.left_out}
    for name in ("norm_quant", "qk_norm_rope_quant", "joint_v_quant", "residual_epilogue:attention"):
        assert "needs a CUDA GPU" in reasons[name], (name, reasons[name])
    for name in ("gelu_gemm:image", "gelu_gemm:text", "joint_v_gemm", "small_m_gemm"):
        assert "written for Hopper" in reasons[name], (name, reasons[name])
    assert reasons["shared_modulation"]  # the layers' reason (CPU tensors, or emulated layers)
    assert plan.block == BlockKernels() and not plan.shared_modulation and plan.trim_last_block
    text = plan.describe()
    assert "used: trim_last_block" in text and "left out: shared_modulation: " in text
    assert plan.summary().startswith("kernels: trim_last_block; left out: shared_modulation (")


def test_a_bf16_model_says_its_layers_are_not_fp8():
    plan = select_kernels(build_dit(torch.bfloat16), SHIPPED, HOPPER, "cudnn_fp8", SHAPE)
    reasons = {c.name: c.reason for c in plan.left_out}
    assert "no block's Q/K/V or MLP up-projection is a row-wise fp8 GEMM layer" in reasons["norm_quant"]
    assert reasons["gelu_gemm:image"] == "it needs the LayerNorm kernel's row norms (norm_quant is left out)"
    assert "qk_norm_rope_quant" in plan.used  # it reads the projections' outputs, whatever the layers
    assert not plan.block.norm_quant and plan.block.qk_quant


def test_shipped_options_on_hopper_choose_the_fused_kernels(fastest):
    plan = select_kernels(fastest, SHIPPED, HOPPER, "cudnn_fp8", SHAPE)
    blocks = f"{len(fastest.transformer_blocks)} of {len(fastest.transformer_blocks)} blocks"
    used = {c.name: c.reason for c in plan.choices if c.used}
    for name in ("norm_quant", "gelu_gemm:image", "gelu_gemm:text", "joint_v_gemm", "qk_norm_rope_quant",
                 "residual_epilogue:attention", "residual_epilogue:mlp"):
        assert used.get(name) == blocks, (name, plan.describe())
    left = {c.name: c.reason for c in plan.left_out}
    assert left["gelu_quant"] == "the fused GELU GEMM computes every MLP's hidden state"
    assert left["joint_v_quant"] == "the joint v GEMM writes v"
    assert "small_m_gemm" in left  # the tiny model's shapes are not the tuned ones
    assert "shared_modulation" in left  # its weights are on the CPU
    assert plan.block == BlockKernels(norm_quant=True, gelu_quant=True, gelu_gemm=("image", "text"), qk_quant=True,
                                      v_quant=True, joint_v_gemm=True, residual_epilogue=("attention", "mlp"),
                                      small_m_gemm=True)


def test_options_variants_flip_the_plan(fastest):
    def plan(options=SHIPPED, backend="cudnn_fp8", shape=SHAPE):
        return select_kernels(fastest, options, HOPPER, backend, shape)

    no_v_gemm = plan(dataclasses.replace(SHIPPED, joint_v_gemm=False))
    assert "joint_v_quant" in no_v_gemm.used and not no_v_gemm.block.joint_v_gemm
    assert {c.name: c.reason for c in no_v_gemm.left_out}["joint_v_gemm"] == "off in the options (joint_v_gemm)"
    text_only = plan(dataclasses.replace(SHIPPED, gelu_gemm=("text",)))
    assert text_only.block.gelu_gemm == ("text",) and "gelu_quant" in text_only.used
    no_norm = plan(dataclasses.replace(SHIPPED, fused_norm_quant=False))
    assert not {"norm_quant", "gelu_gemm:image", "joint_v_gemm"} & set(no_norm.used)
    unfused = plan(UNFUSED)
    assert unfused.used == () and unfused.block == BlockKernels()
    sdpa = plan(backend="sdpa")
    assert not {"qk_norm_rope_quant", "joint_v_gemm", "joint_v_quant", "residual_epilogue:attention"} & set(sdpa.used)
    odd = plan(shape=dataclasses.replace(SHAPE, image_tokens=8100))
    assert "not whole 128-row tiles" in {c.name: c.reason for c in odd.left_out}["joint_v_gemm"]
    per_sample = plan(shape=dataclasses.replace(SHAPE, batch=2, timestep_rows=2))
    assert "residual_epilogue:mlp" not in per_sample.used  # two gate rows: the epilogue takes one


def test_the_plan_is_made_once_per_signature():
    dit = build_dit(torch.bfloat16, layers=2)
    prepared = PreparedDit(dit)
    x = make_inputs(torch.bfloat16)
    first = kernel_plan(prepared, **x)
    assert kernel_plan(prepared, **x) is first
    assert kernel_plan(prepared, **x, options=dataclasses.replace(SHIPPED)) is first  # an equal value
    other = kernel_plan(prepared, **x, options=UNFUSED)
    assert other is not first and other.options == UNFUSED
    fast_model_fn(prepared, **x)
    assert prepared.last_plan is first
    assert kernel_plan(PreparedDit(dit), **x) is not first  # another PreparedDit decides for itself
