"""The fused bias + GELU + row-wise fp8 quantization kernel and the MLP path that uses it (CPU).

On CPU the MLP takes the plain path (the kernel needs CUDA; the reason is reported by
``gelu_quant_capability``). The kernel's own logic (indexing, masking of the ragged row, bias, scale)
runs here under Triton's interpreter in a subprocess; the interpreter truncates fp32 -> bf16 casts
(a CPU study of the attention kernels found it), which the reference there mirrors. The GPU check of the rounding
itself is in tests/gpu/test_fp8_backends.py.
"""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.fp8.gelu_quant import gelu_quant_capability, gelu_quantize_rowwise, reference_gelu_quantize
from qwen_edit_hopper.fp8.linear import ScaledMMLinear
from qwen_edit_hopper.fp8.quant import dequantize, quantize_rowwise, relative_error
from qwen_edit_hopper.qwen_edit.fast import mlp as fast_mlp
from qwen_edit_hopper.qwen_edit.fast.block_kernels import BlockKernels
from triton_interpreter import run_probe


def _approximate_gelu_mlp(dim: int, seed: int = 0) -> torch.nn.Module:
    from diffsynth.models.qwen_image_dit import QwenFeedForward

    torch.manual_seed(seed)
    return QwenFeedForward(dim, dim).to(torch.bfloat16)


def test_kernel_refuses_cpu_tensors_with_the_reason():
    capability = gelu_quant_capability(torch.device("cpu"), 128)
    assert not capability.ok and "CUDA" in capability.reason
    with pytest.raises(ValueError, match="CUDA"):
        gelu_quantize_rowwise(torch.zeros(2, 128, dtype=torch.bfloat16))


def test_kernels_refuse_a_gelu_form_they_do_not_compute_naming_it():
    from qwen_edit_hopper.fp8.gelu_gemm import column_bound, gelu_gemm_rowwise

    y = torch.zeros(2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"gelu 'erf' is not one of sigmoid, tanh"):
        gelu_quantize_rowwise(y, gelu="erf")
    x8, xs = quantize_rowwise(y)
    with pytest.raises(ValueError, match=r"gelu_gemm_rowwise: gelu 'erf' is not one of sigmoid, tanh"):
        gelu_gemm_rowwise(x8, xs, xs, x8, xs, None, column_bound(x8, xs, None), "erf")


def test_reference_equals_the_unfused_modules():
    """reference_gelu_quantize(y, bias) is quantize_rowwise(ApproximateGELU output) up to GELU rounding."""
    mlp = _approximate_gelu_mlp(64)
    x = torch.randn(37, 64, dtype=torch.bfloat16)
    proj = mlp.net[0].proj
    y = torch.nn.functional.linear(x, proj.weight)
    h8, hs = reference_gelu_quantize(y, proj.bias)
    want = mlp.net[0](x)
    got = dequantize(h8, hs)
    assert got.shape == want.shape and hs.shape == (37, 1)
    # e4m3 rounding (~2.5% per element at most, ~1.5% rms) dominates; the bf16 GELU rounding is far below it
    assert relative_error(got, want) < 3e-2
    w8, ws = quantize_rowwise(want)
    assert relative_error(got, dequantize(w8, ws)) < 2e-2


def test_mlp_forward_takes_the_plain_path_for_emulated_layers_and_equals_the_module():
    """Even where the plan allows the kernel, an emulated down-projection keeps the plain path (the kernel feeds a
    real fp8 GEMM only)."""
    mlp = _approximate_gelu_mlp(64)
    mlp.net[2] = ScaledMMLinear.from_linear(mlp.net[2], "rowwise", emulate=True)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    for kernels in (BlockKernels(gelu_quant=True, small_m_gemm=True), BlockKernels()):
        assert not fast_mlp.uses_fused_gelu_quant(mlp, kernels)
        torch.testing.assert_close(fast_mlp.mlp_forward(mlp, x, kernels), mlp(x), rtol=0, atol=0)


_INTERPRETER_PROBE = """
import json, torch
from qwen_edit_hopper.fp8 import gelu_quant as gq
from qwen_edit_hopper.fp8.quant import dequantize, relative_error

def truncate_bf16(x):  # the interpreter's fp32 -> bf16 cast
    return (x.float().view(torch.int32) & -65536).view(torch.float32)

def truncating_reference(y, bias, gelu):  # reference_gelu_quantize with the interpreter's bf16 casts
    yf = truncate_bf16(y.float() + bias.float()) if bias is not None else y.float()
    return gq.quantize_rowwise(truncate_bf16(gq.reference_gelu(yf, gelu)))
g = torch.Generator().manual_seed(0)
rows = []
cases = ((3, 200, True, "sigmoid"), (4, 1024, False, "sigmoid"), (2, 3000, True, "sigmoid"), (2, 384, True, "sigmoid"),
         (3, 96, False, "sigmoid"), (3, 200, True, "tanh"), (2, 384, True, "tanh"))
for m, n, with_bias, gelu in cases:
    y = (torch.randn(m, n, generator=g) * 3).bfloat16()
    y[0] *= 50  # rows of very different ranges: each gets its own scale
    bias = (torch.randn(n, generator=g)).bfloat16() if with_bias else None
    h8, hs = gq._gelu_quantize_op(y, bias, gq.DEFAULT_WARPS, gelu == "tanh")
    r8, rs = truncating_reference(y, bias, gelu)
    rows.append(dict(shape=[m, n], gelu=gelu, chunks=gq.row_chunks(n)[0], finite=bool(torch.isfinite(h8.float()).all()),
                     scale_err=relative_error(hs, rs), err=relative_error(dequantize(h8, hs), dequantize(r8, rs)),
                     same_codes=float((h8.float() == r8.float()).float().mean())))  # +0 == -0
print(json.dumps(rows))

"""


@pytest.mark.slow
def test_kernel_matches_the_reference_under_the_interpreter():
    rows = run_probe(_INTERPRETER_PROBE, ('qwen_edit_hopper.fp8.gelu_quant',))
    assert len(rows) == 7
    assert [row["chunks"] for row in rows] == [1, 1, 1, 3, 3, 1, 3]  # masked one-block rows, 3 * 2^k chunked rows
    assert [row["gelu"] for row in rows].count("tanh") == 2  # ComfyUI's form, masked and chunked
    for row in rows:
        assert row["finite"], row
        # against a reference with the interpreter's truncating bf16 casts: the same scales and codes, except
        # where x / scale is an exact e4m3 rounding tie (the kernel multiplies by 1 / scale): 0.2% of the codes
        # of the 3000-column case, one e4m3 step (~9%) each, hence the 2e-2 bound on the whole row
        assert row["scale_err"] < 1e-6, row
        assert row["err"] < 2e-2, row
        assert row["same_codes"] > 0.99, row
