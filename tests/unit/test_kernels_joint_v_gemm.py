"""The joint v GEMM's math on CPU (``qwen_edit/kernels/joint_v_gemm.py``): its bound holds for both streams, its
reference, where it declines. The kernels: tests/gpu/test_gelu_gemm_gpu.py."""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.fp8.gelu_gemm import column_bound
from qwen_edit_hopper.fp8.norm_quant import quantized_row_norms
from qwen_edit_hopper.fp8.quant import quantize_rowwise
from qwen_edit_hopper.qwen_edit.kernels import joint_v_gemm as vg


def _streams(b=2, s_img=64, length=5, heads=2, head_dim=16, k=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = heads * head_dim
    x8, xs = quantize_rowwise((torch.randn(b * s_img, k, generator=g) * 3).bfloat16())
    w8, ws = quantize_rowwise((torch.randn(n, k, generator=g) * 0.05).bfloat16())
    bias = torch.randn(n, generator=g).bfloat16()
    t8, ts = quantize_rowwise(torch.randn(b * length, k, generator=g).bfloat16())
    tw8, tws = quantize_rowwise((torch.randn(3 * n, k, generator=g) * 0.05).bfloat16())  # a fused text Q/K/V layer
    tb = torch.randn(3 * n, generator=g).bfloat16()
    txt = ((t8.float() * ts) @ (tw8.float() * tws).t()).bfloat16().reshape(b, length, 3, heads, head_dim)
    return (x8, xs, quantized_row_norms(x8, xs), w8, ws, bias, column_bound(w8, ws, bias), txt[:, :, 2],
            tb[2 * n:].reshape(heads, head_dim), quantized_row_norms(t8, ts), column_bound(tw8, tws, tb))


def test_reference_scales_both_streams_by_one_bound_that_holds():
    args = _streams()
    x8, xs, _, w8, ws, bias, _, v_txt, b_txt, _, _ = args
    out = vg.reference_joint_v_gemm(*args)
    b, length, heads, head_dim = v_txt.shape
    img = ((x8.double() * xs.double()) @ (w8.double() * ws.double()).t() + bias.double()).reshape(b, -1, heads,
                                                                                                   head_dim)
    txt = v_txt.double() + b_txt.double()
    exact = torch.cat([img, txt], dim=1)
    assert out.v8.shape == exact.shape and out.v8.dtype == torch.float8_e4m3fn
    descale = out.descale.double().reshape(())
    assert (exact.abs() / descale).max().item() < 448  # no value needs the clamp
    got = out.v8.double() * descale
    assert ((got - exact).abs() <= exact.abs() * 2.0 ** -4 + descale * 2.0 ** -10 + 1e-12).all()
    assert out.scale_o.item() == pytest.approx(1 / out.descale.item(), rel=1e-6)
    assert out.image_rows.shape == (x8.shape[0], 1) and out.text_rows.shape == (b * length, 1)
    assert torch.equal(out.text_rows, out.descale.reshape(1, 1).expand(b * length, 1))


def test_it_declines_with_reasons_and_refuses_on_cpu():
    args = _streams()
    x8, w8, v_txt = args[0], args[3], args[7]
    assert "fast accumulation" in vg.joint_v_gemm_capability(x8, w8, False, 64, v_txt).reason
    capability = vg.joint_v_gemm_capability(x8, w8, True, 64, v_txt)
    assert not capability.ok and ("Hopper" in capability.reason or "Triton" in capability.reason)
    with pytest.raises(ValueError, match="joint_v_gemm: "):
        vg.joint_v_gemm(*args)


def test_the_block_keeps_the_v_kernels_for_layers_without_a_bound():
    from qwen_edit_hopper.fp8 import ScaledMMLinear
    from qwen_edit_hopper.qwen_edit.fast.fp8_attention import joint_v_layers

    layer = ScaledMMLinear.from_linear(torch.nn.Linear(64, 64).bfloat16(), fast_accum=True, gemm_kernel="cublaslt")
    assert layer.column_bound is None  # kept for CUDA layers only
    assert joint_v_layers((layer, layer, layer), (layer,)) is None
