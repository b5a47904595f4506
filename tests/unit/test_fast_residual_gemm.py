"""The gated residual update in the GEMM epilogue: gate folding, where it applies, and the operand checks (CPU).

cuBLASLt does not run on a CPU, so these tests put :func:`fp8.cublaslt_gemm.reference_rowwise_residual` (the
float32 statement of what the cuBLASLt call computes) in its place. The GPU test
(tests/gpu/test_fp8_backends.py) checks the cuBLASLt call against that reference.
"""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.fp8 import cublaslt_gemm
from qwen_edit_hopper.fp8.linear import ScaledMMLinear
from qwen_edit_hopper.fp8.quant import FP8_DTYPE
from qwen_edit_hopper.qwen_edit.fast import mlp as fast_mlp
from qwen_edit_hopper.qwen_edit.fast import residual_gemm
from qwen_edit_hopper.qwen_edit.fast.block_kernels import BlockKernels
from torch import nn

N, K, TOKENS = 32, 64, 6
BOTH_SITES = BlockKernels(residual_epilogue=("attention", "mlp"))


@pytest.fixture
def reference_op(monkeypatch):
    calls = []

    def op(x8, x_scale, w8, col_scale, bias, residual, fast_accum):
        calls.append((col_scale.clone(), None if bias is None else bias.clone()))
        return cublaslt_gemm.reference_rowwise_residual(x8, x_scale, w8, col_scale, bias, residual)

    monkeypatch.setattr(residual_gemm, "cublaslt_rowwise_mm_residual", op)
    return calls


def _layer(bias: bool = True, kernel: str = "cublaslt") -> ScaledMMLinear:
    torch.manual_seed(0)
    linear = nn.Linear(K, N, bias=bias)
    if bias:
        nn.init.normal_(linear.bias)
    return ScaledMMLinear.from_linear(linear.to(torch.bfloat16), gemm_kernel=kernel, fast_accum=True)


def _inputs(batch: int = 1):
    torch.manual_seed(1)
    x = torch.randn(batch * TOKENS, K, dtype=torch.bfloat16)
    residual = torch.randn(batch, TOKENS, N, dtype=torch.bfloat16)
    gate = torch.randn(1, 1, N, dtype=torch.bfloat16)
    return x, residual, gate


@pytest.mark.parametrize("bias", [True, False])
def test_gate_folds_into_column_scale_and_bias(reference_op, bias):
    layer = _layer(bias)
    x, residual, gate = _inputs(batch=2)
    x8, x_scale = layer.quantize_input(x)
    out = residual_gemm.gated_residual_gemm(layer, x8, x_scale, gate, residual, "mlp", BOTH_SITES)
    gemm = (x8.float() @ layer.weight.float().t()) * x_scale * layer.weight_scale.reshape(1, N)
    expected = residual.float() + gate.float() * (gemm.reshape(2, TOKENS, N) + (layer.bias.float() if bias else 0.0))
    assert out.shape == residual.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    col_scale, folded_bias = reference_op[0]
    torch.testing.assert_close(col_scale, layer.weight_scale.reshape(-1) * gate.reshape(-1).float())
    assert (folded_bias is None) == (not bias)


def test_it_declines_where_the_update_is_not_one_gemm_epilogue(reference_op):
    x, residual, gate = _inputs()
    layer = _layer()
    x8, x_scale = layer.quantize_input(x)
    per_token_gate = gate.expand(1, TOKENS, N).contiguous()  # zero_cond_t: the gate varies per token
    assert residual_gemm.gated_residual_gemm(layer, x8, x_scale, per_token_gate, residual, "mlp", BOTH_SITES) is None
    torch_kernel = _layer(kernel="torch")
    assert residual_gemm.gated_residual_gemm(torch_kernel, x8, x_scale, gate, residual, "mlp", BOTH_SITES) is None
    assert residual_gemm.gated_residual_gemm(layer, x8, x_scale, gate, residual.float(), "mlp", BOTH_SITES) is None
    assert residual_gemm.gated_residual_gemm(layer, x8, x_scale, gate, residual.transpose(1, 2).contiguous()
                                             .transpose(1, 2), "mlp", BOTH_SITES) is None
    attention_only = BlockKernels(residual_epilogue=("attention",))
    assert residual_gemm.gated_residual_gemm(layer, x8, x_scale, gate, residual, "mlp", attention_only) is None
    out = residual_gemm.gated_residual_gemm(layer, x8, x_scale, gate, residual, "attention", attention_only)
    assert out is not None
    emulated = ScaledMMLinear.from_linear(nn.Linear(K, N), emulate=True, gemm_kernel="cublaslt")
    assert residual_gemm.gated_residual_gemm(emulated, x8, x_scale, gate, residual, "attention", BOTH_SITES) is None
    assert len(reference_op) == 1


def test_mlp_residual_equals_addcmul_of_the_module_on_the_plain_path():
    torch.manual_seed(2)
    from diffsynth.models.qwen_image_dit import QwenFeedForward

    mlp = QwenFeedForward(dim=K, dim_out=K)
    x, residual, gate = torch.randn(1, TOKENS, K), torch.randn(1, TOKENS, K), torch.randn(1, 1, K)
    with torch.no_grad():
        out = fast_mlp.mlp_residual(mlp, x, residual, gate, BOTH_SITES)
        torch.testing.assert_close(out, torch.addcmul(residual, gate, mlp(x)), rtol=0, atol=0)


def test_residual_operand_checks_name_the_operand():
    x8 = torch.zeros(8, K).to(FP8_DTYPE)
    w8 = torch.zeros(N, K).to(FP8_DTYPE)
    with pytest.raises(ValueError, match=r"residual must be a contiguous CUDA bf16 \[8, 32\] tensor"):
        cublaslt_gemm._check_residual_operands(x8, w8, None, torch.zeros(8, N, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="every operand must be a CUDA tensor"):
        cublaslt_gemm.cublaslt_rowwise_mm_residual(x8, torch.ones(8, 1), w8, torch.ones(N), None,
                                                   torch.zeros(8, N, dtype=torch.bfloat16))
