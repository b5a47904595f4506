"""The fused GELU GEMM's math on CPU (``fp8/gelu_gemm.py``): its bound, its reference, where it declines, and that
the layers keep the bound current. The kernel itself: tests/gpu/test_gelu_gemm_gpu.py."""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.fp8 import gelu_gemm as gg
from qwen_edit_hopper.fp8.linear import ScaledMMLinear
from qwen_edit_hopper.fp8.norm_quant import quantized_row_norms
from qwen_edit_hopper.fp8.quant import quantize_rowwise


def _operands(m=64, k=256, n=96, with_bias=True, aligned=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    x = torch.randn(m, k, generator=g)
    x[:, :4] *= 20
    if aligned:  # rows along weight rows: |y| close to the Cauchy-Schwarz bound
        x = w[torch.arange(m) % n] * 50
    x8, xs = quantize_rowwise(x.bfloat16())
    w8, ws = quantize_rowwise(w.bfloat16())
    bias = (torch.randn(n, generator=g) * 0.5).bfloat16() if with_bias else None
    return x8, xs, quantized_row_norms(x8, xs), w8, ws, bias


def _exact(x8, xs, w8, ws, bias):
    y = (x8.double() * xs.double()) @ (w8.double() * ws.double()).t()
    if bias is not None:
        y = y + bias.double()
    return y * torch.sigmoid(1.702 * y)


def test_column_bound_is_the_largest_row_norm_and_bias():
    _, _, _, w8, ws, bias = _operands()
    cb = gg.column_bound(w8, ws, bias)
    assert cb.dtype == torch.float32 and cb.shape == (2,)
    want = (w8.double() * ws.double()).norm(dim=1).max().item()
    assert cb[0].item() == pytest.approx(want, rel=1e-6)
    assert cb[1].item() == bias.float().abs().max().item()
    assert gg.column_bound(w8, ws, None)[1].item() == 0.0


@pytest.mark.parametrize("aligned", [False, True], ids=["gaussian", "rows along the weight"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_reference_never_saturates_and_rounds_once(aligned, with_bias):
    x8, xs, xn, w8, ws, bias = _operands(with_bias=with_bias, aligned=aligned)
    h8, hs = gg.reference_gelu_gemm(x8, xs, xn, w8, ws, bias, gg.column_bound(w8, ws, bias))
    exact = _exact(x8, xs, w8, ws, bias)
    assert (exact.abs() / hs.double()).max().item() < 448  # the bound holds: no value needs a clamp
    got = h8.double() * hs.double()
    slack = exact.abs() * 2.0 ** -4 + hs.double() * 2.0 ** -10  # half an e4m3 step, normal or subnormal
    assert ((got - exact).abs() <= slack * (1 + 1e-6)).all()
    # a loose scale costs binades, not precision: the codes' error stays at e4m3's (about 2.7e-2 on Gaussian data)
    assert ((got - exact).norm() / exact.norm()).item() < 4.5e-2


def test_an_all_zero_row_gets_a_finite_scale_and_zero_codes():
    x8, xs, xn, w8, ws, _ = _operands(with_bias=False)
    x8[3] = 0
    xn = quantized_row_norms(x8, xs)
    h8, hs = gg.reference_gelu_gemm(x8, xs, xn, w8, ws, None, gg.column_bound(w8, ws, None))
    assert torch.isfinite(hs).all() and (hs > 0).all()
    assert (h8[3].float() == 0).all()


def test_it_declines_with_reasons_and_refuses_on_cpu():
    x8, xs, xn, w8, ws, bias = _operands()
    assert "fast accumulation" in gg.gelu_gemm_capability(x8, w8, False).reason
    capability = gg.gelu_gemm_capability(x8, w8, True)
    assert not capability.ok and ("Hopper" in capability.reason or "Triton" in capability.reason)
    with pytest.raises(ValueError, match="gelu_gemm_rowwise: "):
        gg.gelu_gemm_rowwise(x8, xs, xn, w8, ws, bias, gg.column_bound(w8, ws, bias))


def test_cpu_layers_keep_no_bound_and_the_mlp_does_not_ask_for_norms():
    from qwen_edit_hopper.qwen_edit.fast.block_kernels import BlockKernels
    from qwen_edit_hopper.qwen_edit.fast.mlp import uses_gelu_gemm

    linear = torch.nn.Linear(64, 128).bfloat16()
    layer = ScaledMMLinear.from_linear(linear, fast_accum=True, gemm_kernel="cublaslt")
    assert layer.column_bound is None  # kept for CUDA layers only
    assert "column_bound" not in layer.state_dict()  # not part of the checkpoint format
    mlp = torch.nn.Module()
    mlp.net = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Identity(), layer])
    mlp.net[0].proj = layer
    allowed = BlockKernels(norm_quant=True, gelu_quant=True, gelu_gemm=("image", "text"))
    assert not uses_gelu_gemm(mlp, "image", allowed)


def test_requantizing_a_layer_refreshes_its_bound(monkeypatch):
    """A LoRA update rewrites fp8 weights in place (``write_weights``): every touched row-wise layer then
    recomputes its bound, which a captured CUDA graph reads from the same memory."""
    from qwen_edit_hopper.qwen_edit.fp8_dit import build_fp8_dit, write_weights
    from test_fast_qkv_fp8 import ROWWISE, build_dit

    base = build_dit(torch.bfloat16)
    variant = build_fp8_dit(base, ROWWISE)
    refreshed = []
    monkeypatch.setattr(ScaledMMLinear, "refresh_column_bound", lambda self: refreshed.append(self))
    changed = {"transformer_blocks.0.img_mlp.net.0.proj.weight", "transformer_blocks.0.img_mlp.net.0.proj.bias",
               "transformer_blocks.1.attn.add_k_proj.weight"}
    params = dict(base.named_parameters())
    write_weights(variant, {name: params[name] for name in changed})
    blocks = variant.transformer_blocks
    assert sorted(map(id, refreshed)) == sorted({id(blocks[0].img_mlp.net[0].proj), id(blocks[1].attn.add_qkv_proj)})
