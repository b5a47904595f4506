"""The fused LayerNorm + modulation + row-wise fp8 quantization kernel and the block path that uses it (CPU).

On CPU the block takes the plain path (the kernel needs CUDA). The kernel's own logic (which
modulation row each token uses, with and without zero_cond_t's selector; the ragged row; the scale)
runs here under Triton's interpreter in a subprocess, against a reference with the interpreter's
truncating bf16 casts; the GPU check of the rounding itself is in tests/gpu/test_fp8_backends.py.
"""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.fp8.norm_quant import (
    modulate_quantize_rowwise,
    norm_quant_capability,
    reference_modulate_quantize,
    reference_residual_modulate_quantize,
)
from qwen_edit_hopper.fp8.quant import dequantize, quantize_rowwise, relative_error
from qwen_edit_hopper.qwen_edit.fast.block import _mod_params
from qwen_edit_hopper.qwen_edit.fast.block_kernels import NO_FUSED_KERNELS
from qwen_edit_hopper.qwen_edit.fast.prequant import modulated_input
from triton_interpreter import run_probe


def test_kernel_refuses_cpu_tensors_with_the_reason():
    assert "CUDA" in norm_quant_capability(torch.device("cpu"), 64).reason
    with pytest.raises(ValueError, match="CUDA"):
        modulate_quantize_rowwise(torch.zeros(1, 2, 64, dtype=torch.bfloat16), 1e-6,
                                  torch.zeros(1, 6 * 64, dtype=torch.bfloat16), 6, 0, 1)


@pytest.mark.parametrize("with_selector", [False, True])
@pytest.mark.parametrize("mod_rows", [1, 2])
def test_reference_equals_the_block_modulation(with_selector, mod_rows):
    """reference_modulate_quantize picks the same shift / scale per token as the block's _mod_params."""
    torch.manual_seed(0)
    b, s, d = 2, 7, 32
    x = (torch.randn(b, s, d) * 3 + 1).bfloat16()
    selector = torch.tensor([True, True, True, False, False, True, False]).reshape(1, s, 1) if with_selector else None
    mod = torch.randn(mod_rows * (2 if with_selector else 1), 6 * d).bfloat16()
    params = _mod_params(mod, d, selector)
    for first in (0, 3):
        plain = modulated_input(x, 1e-6, mod, first, first + 1, params[first], params[first + 1], selector, False,
                                NO_FUSED_KERNELS)
        assert isinstance(plain, torch.Tensor) and plain.shape == (b, s, d)
        x8, scale = reference_modulate_quantize(x, 1e-6, mod, 6, first, first + 1, selector)
        assert x8.shape == (b * s, d) and scale.shape == (b * s, 1)
        _, want_scale = quantize_rowwise(plain.reshape(-1, d))
        assert relative_error(scale, want_scale) < 1e-2  # bf16 rounding of (1 + scale) in the eager path only
        assert relative_error(dequantize(x8, scale), plain.reshape(-1, d).float()) < 3e-2  # e4m3 rounding


@pytest.mark.parametrize("with_selector", [False, True])
def test_residual_reference_equals_the_block_update(with_selector):
    """The residual variant's update is the block's addcmul(x, gate, y + bias) bit for bit, then the same norm."""
    torch.manual_seed(1)
    b, s, d = 2, 7, 32
    x = torch.randn(b, s, d).bfloat16()
    y = torch.randn(b * s, d).bfloat16()
    bias = torch.randn(d).bfloat16()
    selector = torch.tensor([True, False, True, True, False, True, True]).reshape(1, s, 1) if with_selector else None
    mod = torch.randn(2 if with_selector else 1, 6 * d).bfloat16()
    params = _mod_params(mod, d, selector)
    want = torch.addcmul(x, params[2], (y + bias).reshape(b, s, d))
    new, x8, scale = reference_residual_modulate_quantize(x, y, bias, 1e-6, mod, 6, 2, 3, 4, selector)
    assert torch.equal(new, want)
    r8, rs = reference_modulate_quantize(want, 1e-6, mod, 6, 3, 4, selector)
    assert torch.equal(x8.float(), r8.float()) and torch.equal(scale, rs)


_INTERPRETER_PROBE = """
import json, torch
from qwen_edit_hopper.fp8 import norm_quant as nq
from qwen_edit_hopper.fp8.quant import dequantize, relative_error

def truncate_bf16(x):  # the interpreter's fp32 -> bf16 cast
    return (x.float().view(torch.int32) & -65536).view(torch.float32)

def norms_bound(norms, x8, scale):
    # the multi-row kernel's norms bound the exact ones from above, by at most the rounding bound's slack
    exact = nq.quantized_row_norms(x8, scale).double()
    n, s, d = norms.double(), scale.double().reshape(-1, 1), x8.shape[1]
    slack = 2 * nq.E4M3_SUBNORMAL_ROUNDING * d ** 0.5 * s
    ratio = (1 + nq.E4M3_REL_ROUNDING) / (1 - nq.E4M3_REL_ROUNDING)
    return bool(((n >= exact * (1 - 1e-5)) & (n <= exact * ratio * (1 + 1e-5) + slack)).all())

def truncating_reference(x, eps, mod, first, selector):
    b, s, d = x.shape
    sets = mod.shape[0] // 2 if selector is not None else mod.shape[0]
    rows = nq._modulation_rows(b * s, s, sets, selector, x.device)
    p = mod.unflatten(-1, (6, d))[rows].float()
    xf = x.reshape(-1, d).float()
    mean = xf.mean(-1, keepdim=True)
    var = ((xf - mean) ** 2).mean(-1, keepdim=True)
    ln = truncate_bf16((xf - mean) * torch.rsqrt(var + eps))
    return nq.quantize_rowwise(truncate_bf16(ln * (1 + p[:, first + 1]) + p[:, first]))

g = torch.Generator().manual_seed(0)
rows = []
# widths 3 * 2^k (96, 48) take the multi-row kernel when rows_per_program > 0; others always the one-row kernel
for b, s, d, sets, with_sel, first in ((1, 5, 200, 1, False, 0), (2, 6, 128, 1, False, 3), (2, 6, 128, 2, False, 0),
                                       (2, 9, 96, 2, True, 3), (1, 4, 64, 1, True, 0), (2, 7, 48, 1, False, 0)):
    x = (torch.randn(b, s, d, generator=g) * 4 + 2).bfloat16()
    mod = torch.randn(sets * (2 if with_sel else 1), 6 * d, generator=g).bfloat16()
    sel = (torch.arange(s) % 3 != 1) if with_sel else None
    for per_program in (0, 1, 4):
        x8, scale, norms = nq._modulate_quantize_op(x.reshape(-1, d), s, 1e-6, mod, 6, first, first + 1,
                                                    None if sel is None else sel.to(torch.uint8), 2, per_program, True)
        r8, rs = truncating_reference(x, 1e-6, mod, first, sel)
        rows.append(dict(case=[b, s, d, sets, with_sel, first, per_program],
                         norms_bound=norms_bound(norms, x8, scale),
                         finite=bool(torch.isfinite(x8.float()).all()), scale_err=relative_error(scale, rs),
                         err=relative_error(dequantize(x8, scale), dequantize(r8, rs)),
                         same_codes=float((x8.float() == r8.float()).float().mean())))
for b, s, d, sets, with_sel, with_bias in ((2, 6, 128, 1, False, True), (2, 9, 96, 2, True, False),
                                           (2, 5, 96, 1, False, True), (1, 7, 96, 1, True, False)):
    x = (torch.randn(b, s, d, generator=g) * 2).bfloat16()
    y = torch.randn(b * s, d, generator=g).bfloat16()
    bias = torch.randn(d, generator=g).bfloat16() if with_bias else None
    mod = torch.randn(sets * (2 if with_sel else 1), 6 * d, generator=g).bfloat16()
    sel = (torch.arange(s) % 3 != 1) if with_sel else None
    for per_program in (0, 1, 2):
        new, x8, scale, norms = nq._residual_modulate_quantize_op(x.reshape(-1, d), y, bias, s, 1e-6, mod, 6, 2, 3,
                                                                  4, None if sel is None else sel.to(torch.uint8), 2,
                                                                  per_program, per_program == 1)
        assert norms.shape == ((b * s, 1) if per_program == 1 else (0, 1))
        rows_ = nq._modulation_rows(b * s, s, sets, sel, x.device)
        gate = mod.unflatten(-1, (6, d))[rows_][:, 2].float()
        update = y.float() if bias is None else truncate_bf16(y.float() + bias.float())
        want_new = truncate_bf16(x.reshape(-1, d).float() + gate * update)
        r8, rs = truncating_reference(want_new.reshape(b, s, d), 1e-6, mod, 3, sel)
        rows.append(dict(case=[b, s, d, sets, with_sel, "residual", per_program],
                         norms_bound=per_program != 1 or norms_bound(norms, x8, scale),
                         finite=bool(torch.isfinite(x8.float()).all()), new_err=relative_error(new.float(), want_new),
                         scale_err=relative_error(scale, rs),
                         err=relative_error(dequantize(x8, scale), dequantize(r8, rs)),
                         same_codes=float((x8.float() == r8.float()).float().mean())))
print(json.dumps(rows))
"""


@pytest.mark.slow
def test_kernel_matches_the_reference_under_the_interpreter():
    rows = run_probe(_INTERPRETER_PROBE, ('qwen_edit_hopper.fp8.norm_quant',))
    assert len(rows) == 6 * 3 + 4 * 3
    for row in rows:
        assert row["finite"], row
        assert row.get("new_err", 0.0) == 0.0, row  # the residual update is exact (same roundings)
        # a wrong modulation row (selector, sample) or a wrong scale gives errors of order 1; what remains are
        # exact e4m3 ties (the kernel multiplies by 1 / scale) and sum-order differences in mean / variance
        assert row["scale_err"] < 1e-2, row
        assert row["err"] < 2e-2, row
        assert row["same_codes"] > 0.98, row
        # upper bounds of the norms of the kernel's own codes (multi-row kernel; module docstring, "Row norms"), or
        # those norms themselves (one-row kernel, in torch)
        assert row["norms_bound"], row
