"""The fused GELU GEMM (``fp8/gelu_gemm.py``), the joint v GEMM (``qwen_edit/kernels/joint_v_gemm.py``) and the
LayerNorm kernel's row norms on a Hopper GPU.

Run on the device machine::

    python3 -m pytest tests/gpu/test_gelu_gemm_gpu.py -m gpu -q -rs
"""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.fp8 import gelu_gemm as gg
from qwen_edit_hopper.fp8 import norm_quant as nq
from qwen_edit_hopper.fp8.quant import quantize_rowwise

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs a Hopper GPU (compute capability 9.0)"),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _operands(m: int, k: int, n: int, with_bias: bool, aligned: bool = False, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    x = torch.randn(m, k, device="cuda", generator=g)
    x[:, :8] *= 20  # a few large channels, as LayerNorm outputs have
    if aligned:  # the worst case for the bound: each row along one weight row (|y| near ||x|| ||W_j||)
        x = w[torch.arange(m, device="cuda") % n] * 50
    x8, xs = quantize_rowwise(x.bfloat16())
    w8, ws = quantize_rowwise(w.bfloat16())
    bias = (torch.randn(n, device="cuda", generator=g) * 0.5).bfloat16() if with_bias else None
    return x8, xs, nq.quantized_row_norms(x8, xs), w8, ws, bias, gg.column_bound(w8, ws, bias)


def _exact(x8, xs, w8, ws, bias, gelu="sigmoid"):
    y = (x8.double() * xs.double()) @ (w8.double() * ws.double()).t()
    if bias is not None:
        y = y + bias.double()
    return gg.reference_gelu(y, gelu)


@pytest.mark.parametrize(("m", "k", "n", "with_bias"), [(8192, 3072, 12288, True), (1500, 3072, 272, False),
                                                        (2048, 1024, 4096, True), (300, 3072, 12288, True),
                                                        (37, 3072, 4096, True), (600, 1024, 4096, False)])
@pytest.mark.parametrize("gelu", ["sigmoid", "tanh"])
def test_kernel_matches_its_reference(m, k, n, with_bias, gelu):
    x8, xs, xn, w8, ws, bias, cb = _operands(m, k, n, with_bias)
    h8, hs = gg.gelu_gemm_rowwise(x8, xs, xn, w8, ws, bias, cb, gelu)
    r8, rs = gg.reference_gelu_gemm(x8, xs, xn, w8, ws, bias, cb, gelu)
    assert h8.dtype == torch.float8_e4m3fn and h8.shape == (m, n) and hs.shape == (m, 1)
    torch.testing.assert_close(hs, rs, rtol=1e-6, atol=0)
    same = (h8.view(torch.uint8) == r8.view(torch.uint8)).float().mean().item()
    exact = _exact(x8, xs, w8, ws, bias, gelu)
    err_kernel, err_reference = _rel(h8.double() * hs.double(), exact), _rel(r8.double() * rs.double(), exact)
    print(f"\n{gelu} {m}x{k}->{n}: codes equal {same:.4f}, error vs float64 kernel {err_kernel:.3e} reference "
          f"{err_reference:.3e}")
    assert same > 0.95  # accumulation order and tanh.approx move a few codes by one step (0.969-0.983 seen)
    assert err_kernel < 1.02 * err_reference + 1e-4


def test_bound_holds_for_rows_along_the_weight():
    """Rows parallel to a weight row make |y| approach the Cauchy-Schwarz bound (427 of 448 on an H200): nothing
    saturates. Two losses add up here, neither a saturation: the bound scale rounds each row's dominant element
    (the float64 reference's 2.5e-2; the shipped amax scale puts it exactly on 448), and 3072 same-sign products
    summed without promotion (fast accumulation; the shipped pair of cuBLASLt and the GELU-quantize kernel: 3.4e-2).
    The kernel measured 4.4e-2, their sum in quadrature (4.3e-2)."""
    from qwen_edit_hopper.fp8.cublaslt_gemm import cublaslt_capability, cublaslt_rowwise_mm
    from qwen_edit_hopper.fp8.gelu_quant import gelu_quantize_rowwise

    if not cublaslt_capability().ok:
        pytest.skip(cublaslt_capability().reason)
    x8, xs, xn, w8, ws, bias, cb = _operands(2048, 3072, 4096, True, aligned=True)
    h8, hs = gg.gelu_gemm_rowwise(x8, xs, xn, w8, ws, bias, cb)
    r8, rs = gg.reference_gelu_gemm(x8, xs, xn, w8, ws, bias, cb)
    p8, ps = gelu_quantize_rowwise(cublaslt_rowwise_mm(x8, xs, w8, ws, True), bias)
    exact = _exact(x8, xs, w8, ws, bias)
    ratio = (exact.abs() / hs.double()).max().item()
    errs = [_rel(a.double() * s.double(), exact) for a, s in ((h8, hs), (r8, rs), (p8, ps))]
    print(f"\naligned rows: largest |h| / row scale {ratio:.1f} (448 = a tight bound); error vs float64 kernel "
          f"{errs[0]:.3e} reference {errs[1]:.3e} cuBLASLt + gelu_quant {errs[2]:.3e}")
    assert ratio < 448  # the bound is a bound
    assert (h8.float().abs() == 448).sum().item() == 0
    assert errs[0] < 1.05 * (errs[1] ** 2 + errs[2] ** 2) ** 0.5 + 1e-3


@pytest.mark.parametrize("rows_per_program", [0, 1])
def test_layernorm_kernels_bound_the_norms_of_their_codes(rows_per_program):
    x = (torch.randn(2, 1000, 3072, device="cuda") * 3 + 1).bfloat16()
    y = torch.randn(2000, 3072, device="cuda").bfloat16()
    mod = torch.randn(2, 6 * 3072, device="cuda").bfloat16()
    x8, scale, norms = nq.modulate_quantize_rowwise(x, 1e-6, mod, 6, 0, 1, None, with_norms=True,
                                                    rows_per_program=rows_per_program)
    _assert_norm_bounds(norms, x8, scale, rows_per_program)
    assert len(nq.modulate_quantize_rowwise(x, 1e-6, mod, 6, 0, 1, None, rows_per_program=rows_per_program)) == 2
    _, x8, scale, norms = nq.residual_modulate_quantize_rowwise(x, y, None, 1e-6, mod, 6, 2, 3, 4, None,
                                                                with_norms=True, rows_per_program=rows_per_program)
    _assert_norm_bounds(norms, x8, scale, rows_per_program)


def _assert_norm_bounds(norms, x8, scale, rows_per_program):
    """The multi-row kernel returns upper bounds of its codes' norms (norm_quant docstring, "Row norms"): above the
    exact norms, by at most the rounding bound's slack; on Gaussian rows about 1 + 2^-4 times them. The one-row
    kernel returns the exact norms."""
    exact = nq.quantized_row_norms(x8, scale)
    if rows_per_program == 0:
        torch.testing.assert_close(norms, exact, rtol=1e-5, atol=0)
        return
    ratio = (norms.double() / exact.double()).reshape(-1)
    assert ratio.min().item() >= 1 - 1e-5, ratio.min().item()
    limit = (1 + nq.E4M3_REL_ROUNDING) / (1 - nq.E4M3_REL_ROUNDING)
    assert ratio.max().item() <= limit * (1 + 1e-5), ratio.max().item()


def test_refuses_what_it_cannot_run():
    x8, xs, xn, w8, ws, bias, cb = _operands(512, 1024, 4096, True)
    with pytest.raises(ValueError, match="K and N must be equal multiples of 16"):
        gg.gelu_gemm_rowwise(x8, xs, xn, w8[:, :512], ws, bias, cb)
    assert "fast accumulation" in gg.gelu_gemm_capability(x8, w8, False).reason
    assert gg.config_for_rows(300) == gg.SMALL_M_CONFIG and gg.config_for_rows(8192) == gg.CONFIG


@pytest.mark.parametrize(("batch", "s_img", "length"), [(1, 8192, 300), (2, 2048, 287), (2, 1024, 0)])
def test_joint_v_gemm_matches_its_reference(batch, s_img, length):
    """Image rows from the GEMM, text rows from the cast kernel, one bound scale; the text v is a strided view into a
    fused Q/K/V output, as in the block."""
    from qwen_edit_hopper.qwen_edit.kernels import joint_v_gemm as vg

    heads, head_dim, k = 24, 128, 3072
    n = heads * head_dim
    x8, xs, xn, w8, ws, bias, cb = _operands(batch * s_img, k, n, True)
    g = torch.Generator(device="cuda").manual_seed(1)
    t8, ts = quantize_rowwise(torch.randn(batch * max(length, 1), k, device="cuda", generator=g).bfloat16())
    t8, ts = t8[:batch * length], ts[:batch * length]
    tw8, tws = quantize_rowwise((torch.randn(3 * n, k, device="cuda", generator=g) * 0.02).bfloat16())
    tb = (torch.randn(3 * n, device="cuda", generator=g) * 0.5).bfloat16()
    fused = ((t8.float() * ts) @ (tw8.float() * tws).t()).bfloat16().reshape(batch, length, 3, heads, head_dim)
    args = (x8, xs, xn, w8, ws, bias, cb, fused[:, :, 2], tb[2 * n:].reshape(heads, head_dim),
            nq.quantized_row_norms(t8, ts), gg.column_bound(tw8, tws, tb))
    got, want = vg.joint_v_gemm(*args), vg.reference_joint_v_gemm(*args)
    assert got.v8.shape == want.v8.shape == (batch, s_img + length, heads, head_dim)
    for name in ("descale", "scale_o", "image_rows", "text_rows"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name).expand_as(getattr(got, name)),
                                   rtol=1e-6, atol=0)
    same = (got.v8.view(torch.uint8) == want.v8.view(torch.uint8)).float().mean().item()
    diff = _rel(got.v8.double(), want.v8.double())
    print(f"\nbatch {batch}, {s_img} + {length} tokens: codes equal {same:.4f}, relative difference {diff:.2e}")
    assert same > 0.95 and diff < 1e-2  # the image rows' accumulation order; the text rows are the same math
    if length:  # the same math; a contracted multiply-add in the bound may move a rounding tie
        assert (got.v8[:, s_img:].view(torch.uint8) == want.v8[:, s_img:].view(torch.uint8)).float().mean() > 0.999
