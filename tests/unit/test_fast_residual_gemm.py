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
from torch import nn

N, K, TOKENS = 32, 64, 6


@pytest.fixture
def reference_op(monkeypatch):
    calls = []

    def op(x8, x_scale, w8, col_scales, biases, residual, starts, ids, fast_accum):
        calls.append((col_scales.clone(), None if biases is None else biases.clone(), starts, ids))
        return cublaslt_gemm.reference_rowwise_residual(x8, x_scale, w8, col_scales, biases, residual, starts, ids)

    monkeypatch.setattr(residual_gemm, "cublaslt_rowwise_mm_residual", op)
    return calls


def _layer(bias: bool = True, kernel: str = "cublaslt") -> ScaledMMLinear:
    torch.manual_seed(0)
    linear = nn.Linear(K, N, bias=bias)
    if bias:
        nn.init.normal_(linear.bias)
    return ScaledMMLinear.from_linear(linear.to(torch.bfloat16), gemm_kernel=kernel, fast_accum=True)


def _mod(rows: int) -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randn(rows, 6 * N, dtype=torch.bfloat16)


def _inputs(batch: int = 1):
    torch.manual_seed(1)
    x = torch.randn(batch * TOKENS, K, dtype=torch.bfloat16)
    residual = torch.randn(batch, TOKENS, N, dtype=torch.bfloat16)
    return x, residual


@pytest.mark.parametrize("mod_rows, batch, target, starts, ids", [
    (1, 2, None, (0,), (0,)),  # one timestep for the batch (batched CFG): one run
    (2, 2, None, (0, TOKENS), (0, 1)),  # a timestep per sample
    (2, 1, 4, (0, 4), (0, 1)),  # zero_cond_t: target tokens, then references (timestep 0)
    (2, 2, 4, (0, 4, TOKENS, TOKENS + 4), (0, 1, 0, 1)),  # zero_cond_t, one timestep for the batch
    (4, 2, 4, (0, 4, TOKENS, TOKENS + 4), (0, 2, 1, 3)),  # zero_cond_t, a timestep per sample
], ids=["one", "per-sample", "zero-cond", "zero-cond-batch2", "zero-cond-per-sample"])
def test_gate_rows_split_the_stream_where_the_gate_changes(mod_rows, batch, target, starts, ids):
    mod = _mod(mod_rows)
    gates = residual_gemm.gate_rows(mod, 5, N, batch, TOKENS, None if target is None else torch.empty(target, 0))
    assert (gates.starts, gates.ids) == (starts, ids)
    torch.testing.assert_close(gates.rows, mod[:, 5 * N:6 * N], rtol=0, atol=0)
    assert residual_gemm.gate_rows(_mod(3), 5, N, 2, TOKENS) is None  # 3 timesteps for 2 samples


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_gate_folds_into_column_scales_and_biases(reference_op, bias, zero_cond_t):
    layer = _layer(bias)
    x, residual = _inputs(batch=2)
    x8, x_scale = layer.quantize_input(x)
    mod = _mod(2 if zero_cond_t else 1)
    target = torch.empty(4, 0) if zero_cond_t else None
    gates = residual_gemm.gate_rows(mod, 2, N, 2, TOKENS, target)
    out = residual_gemm.gated_residual_gemm(layer, x8, x_scale, gates, residual, "mlp")
    gate = mod[:, 2 * N:3 * N].float()
    per_token = gate[0].expand(TOKENS, N).clone()
    if zero_cond_t:
        per_token[4:] = gate[1]
    gemm = (x8.float() @ layer.weight.float().t()) * x_scale * layer.weight_scale.reshape(1, N)
    expected = residual.float() + per_token * (gemm.reshape(2, TOKENS, N) + (layer.bias.float() if bias else 0.0))
    assert out.shape == residual.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    col_scales, folded_bias, starts, ids = reference_op[0]
    torch.testing.assert_close(col_scales, layer.weight_scale.reshape(1, N) * gate)
    assert (folded_bias is None) == (not bias)
    assert (starts, ids) == ((0, 4, TOKENS, TOKENS + 4), (0, 1, 0, 1)) if zero_cond_t else ((0,), (0,))


def test_it_declines_where_the_update_is_not_one_gemm_epilogue(reference_op, monkeypatch):
    x, residual = _inputs()
    layer = _layer()
    x8, x_scale = layer.quantize_input(x)
    gates = residual_gemm.gate_rows(_mod(1), 5, N, 1, TOKENS)
    assert residual_gemm.gated_residual_gemm(layer, x8, x_scale, None, residual, "mlp") is None
    assert residual_gemm.gated_residual_gemm(_layer(kernel="torch"), x8, x_scale, gates, residual, "mlp") is None
    assert residual_gemm.gated_residual_gemm(layer, x8, x_scale, gates, residual.float(), "mlp") is None
    assert residual_gemm.gated_residual_gemm(layer, x8, x_scale, gates, residual.transpose(1, 2).contiguous()
                                             .transpose(1, 2), "mlp") is None
    monkeypatch.setattr(residual_gemm, "SITES", ("attention",))
    assert residual_gemm.gated_residual_gemm(layer, x8, x_scale, gates, residual, "mlp") is None
    assert residual_gemm.gated_residual_gemm(layer, x8, x_scale, gates, residual, "attention") is not None
    emulated = ScaledMMLinear.from_linear(nn.Linear(K, N), emulate=True, gemm_kernel="cublaslt")
    assert residual_gemm.gated_residual_gemm(emulated, x8, x_scale, gates, residual, "attention") is None
    assert len(reference_op) == 1


def test_mlp_residual_equals_addcmul_of_the_module_on_the_plain_path():
    torch.manual_seed(2)
    from diffsynth.models.qwen_image_dit import QwenFeedForward

    mlp = QwenFeedForward(dim=K, dim_out=K)
    x, residual, gate = torch.randn(1, TOKENS, K), torch.randn(1, TOKENS, K), torch.randn(1, 1, K)
    with torch.no_grad():
        out = fast_mlp.mlp_residual(mlp, x, residual, gate)
        torch.testing.assert_close(out, torch.addcmul(residual, gate, mlp(x)), rtol=0, atol=0)


def test_residual_operand_checks_name_the_operand():
    x8 = torch.zeros(8, K).to(FP8_DTYPE)
    w8 = torch.zeros(N, K).to(FP8_DTYPE)
    scales = torch.ones(2, N)
    with pytest.raises(ValueError, match=r"residual must be a contiguous CUDA bf16 \[8, 32\] tensor"):
        cublaslt_gemm._check_residual_operands(x8, w8, scales, None, torch.zeros(8, N, dtype=torch.bfloat16),
                                               (0,), (0,))
    with pytest.raises(ValueError, match="every operand must be a CUDA tensor"):
        cublaslt_gemm.cublaslt_rowwise_mm_residual(x8, torch.ones(8, 1), w8, scales, None,
                                                   torch.zeros(8, N, dtype=torch.bfloat16))
    for starts, ids in (((0, 8), (0, 1)), ((0, 4, 2), (0, 1, 0)), ((2,), (0,)), ((0,), (2,)), ((0, 4), (0,))):
        with pytest.raises(ValueError, match=r"starts must rise from 0 below M=8 and ids index the 2 rows of "
                                             r"col_scales, got starts="):
            cublaslt_gemm._check_segments(8, 2, starts, ids)
    cublaslt_gemm._check_segments(8, 2, (0, 4), (1, 0))
