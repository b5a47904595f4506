"""fp8 quantization math and the scaled-mm / weight-only modules, on CPU."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from qwen_edit_hopper.fp8.capability import Capability
from qwen_edit_hopper.fp8.linear import ScaledMMLinear, WeightOnlyLinear, scaled_mm_shape_capability
from qwen_edit_hopper.fp8.quant import (
    E4M3_MAX,
    EPS,
    FP8_DTYPE,
    dequantize,
    pad_rows,
    quantize_rowwise,
    quantize_tensorwise,
    reference_scaled_mm,
    relative_error,
    scaled_mm,
)
from torch import nn


def _rows_with_extremes(dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g, dtype=torch.float64)
    x *= torch.logspace(-6, 4, 64, dtype=torch.float64)[:, None]  # rows spanning 10 decades
    x[3] = 0.0  # an all-zero row
    x[7, :] = 0.0
    x[7, 5] = -3.0  # a row with one non-zero value
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rowwise_quantization_matches_float64_reference(dtype):
    x = _rows_with_extremes(dtype)
    x8, scale = quantize_rowwise(x)
    assert x8.dtype == FP8_DTYPE and x8.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (64, 1)

    x64 = x.to(torch.float64)
    amax64 = x64.abs().amax(dim=-1, keepdim=True)
    scale64 = amax64.clamp(min=EPS) / 448.0
    torch.testing.assert_close(scale.double(), scale64, rtol=1e-6, atol=0)
    ref8 = (x64 / scale64).clamp(-448.0, 448.0).float().to(FP8_DTYPE)
    same = x8.float() == ref8.float()
    assert same.float().mean() > 0.999  # fp32 vs fp64 division may round a rare tie the other way
    diff = (x8.float() - ref8.float()).abs()[~same]
    assert (diff <= ref8.float().abs()[~same] / 8 + 2**-9).all()  # at most one e4m3 step apart

    assert torch.isfinite(x8.float()).all() and torch.isfinite(scale).all()
    assert (x8[3].float() == 0).all()  # zero row -> zeros, no NaN
    nonzero = amax64.squeeze(1) > 0
    assert (x8.float().abs().amax(dim=1)[nonzero] == E4M3_MAX).all()  # each row's amax lands on 448
    assert x8[7, 5].float() == -E4M3_MAX

    deq = dequantize(x8, scale, torch.float64)
    bound = x64.abs() * 2**-4 + scale.double() * 2**-10  # half an e4m3 step (normal / subnormal range)
    assert ((deq - x64).abs() <= bound * (1 + 1e-6)).all()


def test_per_channel_weight_and_tensorwise_scales():
    w = torch.randn(48, 64) * torch.linspace(0.1, 10, 48)[:, None]
    w8, ws = quantize_rowwise(w)
    assert ws.shape == (48, 1)
    torch.testing.assert_close(ws, w.abs().amax(dim=1, keepdim=True) / 448.0)
    x8, xs = quantize_tensorwise(w)
    assert xs.dim() == 0 and xs.dtype == torch.float32
    torch.testing.assert_close(xs, w.abs().amax() / 448.0)
    assert x8.float().abs().max() == E4M3_MAX
    assert relative_error(dequantize(w8, ws), w) < relative_error(dequantize(x8, xs), w) + 1e-3
    zero8, zero_scale = quantize_tensorwise(torch.zeros(4, 16))
    assert (zero8.float() == 0).all() and torch.isfinite(zero_scale)


def test_tensorwise_real_scaled_mm_on_cpu_matches_reference():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    w = (torch.randn(48, 64, generator=g) / 8).to(torch.bfloat16)
    x8, xs = quantize_tensorwise(x)
    w8, ws = quantize_tensorwise(w)
    y = scaled_mm(x8, xs, w8, ws, torch.bfloat16)  # the real torch._scaled_mm (CPU: per-tensor scales only)
    ref = reference_scaled_mm(x8, xs, w8, ws, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == (32, 48)
    torch.testing.assert_close(y, ref)
    assert relative_error(y, x.float() @ w.float().t()) < 0.06


def test_rowwise_reference_matches_dequantize_and_fp32_matmul_and_bf16():
    g = torch.Generator().manual_seed(3)
    lin = nn.Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(2, 9, 64, generator=g).to(torch.bfloat16)
    fp8 = ScaledMMLinear.from_linear(lin, "rowwise", emulate=True, layer_name="blk.lin")
    y = fp8(x)
    x8, xs = quantize_rowwise(x.reshape(-1, 64))
    expect = (dequantize(x8, xs) @ dequantize(fp8.weight, fp8.weight_scale).t()).to(torch.bfloat16) + lin.bias
    assert y.shape == (2, 9, 48) and y.dtype == torch.bfloat16
    assert torch.equal(y.reshape(-1, 48), expect)
    with torch.no_grad():
        assert relative_error(y, lin(x)) < 0.06


def test_rowwise_module_through_torch_scaled_mm_is_refused_by_torch_on_cpu():
    fp8 = ScaledMMLinear.from_linear(nn.Linear(64, 48).to(torch.bfloat16), "rowwise", emulate=False, layer_name="q")
    with pytest.raises(RuntimeError, match="per-tensor"):
        fp8(torch.randn(4, 64).to(torch.bfloat16))
    with pytest.raises(TypeError, match=r"^q: row-wise torch\._scaled_mm takes bf16 activations"):
        fp8(torch.randn(4, 64))


def test_tensorwise_module_real_kernel_equals_emulated():
    lin = nn.Linear(64, 32).to(torch.bfloat16)
    x = torch.randn(5, 64).to(torch.bfloat16)
    real = ScaledMMLinear.from_linear(lin, "tensorwise", emulate=False)
    emulated = ScaledMMLinear.from_linear(lin, "tensorwise", emulate=True)
    torch.testing.assert_close(real(x), emulated(x))


def test_weight_only_equals_dequantize_then_matmul():
    lin = nn.Linear(40, 24).to(torch.bfloat16)  # any shape: weight-only has no /16 constraint
    x = torch.randn(3, 40).to(torch.bfloat16)
    wo = WeightOnlyLinear.from_linear(lin, "mod")
    assert wo.weight.dtype == FP8_DTYPE and wo.weight_scale.shape == (24, 1)
    expect = F.linear(x, dequantize(wo.weight, wo.weight_scale, torch.bfloat16), lin.bias)
    assert torch.equal(wo(x), expect)
    assert relative_error(wo.dequantize_weight(torch.float32), lin.weight.float()) < 0.05


@pytest.mark.parametrize("tokens", [1, 7, 16, 300])
def test_odd_token_counts_are_padded_and_unpadded(tokens):
    assert pad_rows(torch.ones(tokens, 8), 16).shape[0] == -(-tokens // 16) * 16
    lin = nn.Linear(64, 32).to(torch.bfloat16)
    x = torch.randn(1, tokens, 64).to(torch.bfloat16)
    plain = ScaledMMLinear.from_linear(lin, "rowwise", emulate=True)
    padded = ScaledMMLinear.from_linear(lin, "rowwise", emulate=True)
    padded.token_multiple = 16  # what TE needs; zero pad rows must not disturb (or NaN) real rows
    y = padded(x)
    assert y.shape == (1, tokens, 32) and torch.isfinite(y.float()).all()
    torch.testing.assert_close(y, plain(x))


def test_k_or_n_not_divisible_by_16_is_refused_with_the_layer_name():
    assert scaled_mm_shape_capability(64, 48).ok
    assert scaled_mm_shape_capability(24, 48) == Capability(
        False, "K=24 not divisible by 16 (torch._scaled_mm needs K and N divisible by 16)")
    assert "K=24 and N=40" in scaled_mm_shape_capability(24, 40).reason
    with pytest.raises(ValueError, match=r"blocks\.3\.odd: N=40 not divisible by 16"):
        ScaledMMLinear.from_linear(nn.Linear(64, 40), "rowwise", emulate=True, layer_name="blocks.3.odd")


def test_state_dict_holds_fp8_weights_and_round_trips():
    lin = nn.Linear(64, 32).to(torch.bfloat16)
    fp8 = ScaledMMLinear.from_linear(lin, "rowwise", emulate=True)
    sd = fp8.state_dict()
    assert set(sd) == {"weight", "weight_scale", "bias"}
    assert sd["weight"].dtype == FP8_DTYPE and sd["weight_scale"].dtype == torch.float32
    other = ScaledMMLinear.from_linear(nn.Linear(64, 32).to(torch.bfloat16), "rowwise", emulate=True)
    other.load_state_dict(sd)
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(other(x), fp8(x))
    with pytest.raises(RuntimeError, match=r"expected torch\.float8_e4m3fn"):
        other.load_state_dict({"weight": lin.weight.detach(), "weight_scale": sd["weight_scale"], "bias": lin.bias})
    assert fp8.in_features == 64 and fp8.out_features == 32


@pytest.mark.parametrize("cast", [lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float()])
def test_model_wide_dtype_casts_keep_fp8_weights_and_fp32_scales(cast):
    fp8 = WeightOnlyLinear.from_linear(nn.Linear(64, 32))
    w, s = fp8.weight.clone(), fp8.weight_scale.clone()
    cast(fp8)
    assert fp8.weight.dtype == FP8_DTYPE and torch.equal(fp8.weight.float(), w.float())
    assert fp8.weight_scale.dtype == torch.float32 and torch.equal(fp8.weight_scale, s)


def test_no_graph_break_inside_the_rowwise_linear():
    torch._dynamo.reset()
    # Real torch._scaled_mm row-wise path, traced on meta tensors (CPU cannot run row-wise scales).
    w8 = torch.empty(48, 64, device="meta", dtype=FP8_DTYPE)
    meta = ScaledMMLinear(w8, torch.empty(48, 1, device="meta"), torch.empty(48, device="meta"), "rowwise")
    explained = torch._dynamo.explain(meta)(torch.empty(2, 7, 64, device="meta", dtype=torch.bfloat16))
    assert explained.graph_break_count == 0 and explained.graph_count == 1

    torch._dynamo.reset()
    lin = nn.Linear(64, 48).to(torch.bfloat16)
    emulated = ScaledMMLinear.from_linear(lin, "rowwise", emulate=True)
    norm = nn.LayerNorm(64, elementwise_affine=False).to(torch.bfloat16)
    shift, scale = torch.randn(64).to(torch.bfloat16), torch.randn(64).to(torch.bfloat16)

    def block(x):  # norm -> modulate -> fp8 linear, as in a Qwen block
        return emulated(norm(x) * (1 + scale) + shift)

    x = torch.randn(1, 9, 64).to(torch.bfloat16)
    compiled = torch.compile(block, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), block(x))
    torch._dynamo.reset()


@pytest.mark.slow
def test_inductor_fuses_rowwise_quantize_into_the_producer():
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    norm = nn.LayerNorm(64, elementwise_affine=False)
    shift, scale = torch.randn(64), torch.randn(64)

    def producer_then_quantize(x):
        return quantize_rowwise(norm(x) * (1 + scale) + shift)

    x = torch.randn(32, 64)
    (x8, xs), codes = run_and_get_code(torch.compile(producer_then_quantize, fullgraph=True), x)
    ref8, refs = producer_then_quantize(x)
    torch.testing.assert_close(xs, refs)
    assert (x8.float() != ref8.float()).float().mean() < 0.01  # same fp8 codes but for rare rounding ties
    kernels = sorted(set(re.findall(r"\b(cpp_fused\w+|triton_\w+)", "\n".join(codes))))
    fused = [k for k in kernels if "amax" in k and ("layer_norm" in k or "var_mean" in k)]
    assert fused, f"quantize not fused into the layer norm; kernels: {kernels}"
    torch._dynamo.reset()
