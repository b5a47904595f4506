"""Bias + sigmoid-GELU + row-wise fp8 quantization in one pass over the MLP hidden state (Triton, CUDA).

Qwen-Image's MLP applies ``h = y * sigmoid(1.702 * y)`` to the first linear's output ``y`` (M x 12288
bf16 at full size) and the second linear, when it is a row-wise :class:`.linear.ScaledMMLinear`,
quantizes ``h`` per token. Inductor fuses bias, GELU and quantization into one looped-reduction kernel
that reads each row twice; on an H200 it took 16.2 ms of a 245 ms forward, ~3.6x its memory-bandwidth
floor (docs/benchmarks.md, kernel profile). This kernel keeps one row in registers: it reads ``y`` and
the bias once and writes the e4m3 row and its float32 scale.

Numerics: bias add rounded to bf16 (as ``y + bias`` in bf16), GELU in float32 rounded once to bf16
(as Inductor computes the bf16 expression), then :func:`.quant.quantize_rowwise`'s scale
(``max(amax, EPS) / 448``), a multiply by its reciprocal instead of the division (differs only where
the quotient is an exact e4m3 rounding tie), clamp to +-448, round to nearest even. On an H200 all
codes of an 8192 x 12288 Gaussian test equalled the reference's (bench/gelu_quant_bench.py).

Limits: CUDA tensors only (Triton), ``y`` bf16 [M, N] with N <= :data:`MAX_COLUMNS`. Callers check
:func:`gelu_quant_problem` and use the plain-torch path when it returns a reason.
Registered as the custom op ``qwen_edit_hopper::gelu_quantize_rowwise`` through
``torch.library.triton_op``, so ``torch.compile`` keeps it in the graph (no graph break).
"""

from __future__ import annotations

import logging

import torch

from .quant import E4M3_MAX, EPS, FP8_DTYPE, quantize_rowwise

__all__ = ["MAX_COLUMNS", "OP_NAME", "gelu_quant_problem", "gelu_quantize_rowwise", "reference_gelu_quantize"]

logger = logging.getLogger(__name__)

MAX_COLUMNS = 32768
"""Widest row one program holds in registers (12288 at full size)."""

OP_NAME = "qwen_edit_hopper::gelu_quantize_rowwise"

DEFAULT_WARPS = 8
"""Warps per row: fastest of 8 / 16 / 32 at 8192 x 12288 on an H200 (bench/gelu_quant_bench.py)."""

try:  # Triton ships with CUDA builds of torch; its absence only disables the fused path (reported by callers).
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError as exc:  # pragma: no cover - depends on the torch build
    triton = None
    _TRITON_MISSING = f"Triton is not importable ({exc})"
else:
    _TRITON_MISSING = None


def gelu_quant_problem(y_device: torch.device, n_columns: int) -> str | None:
    """Why the fused kernel cannot run for a [M, n_columns] bf16 input on ``y_device``, or None when it can."""
    if _TRITON_MISSING is not None:
        return _TRITON_MISSING
    if y_device.type != "cuda":
        return f"the fused GELU + quantize kernel needs a CUDA tensor, got {y_device.type}"
    if n_columns > MAX_COLUMNS:
        return f"rows of {n_columns} columns exceed the kernel's {MAX_COLUMNS}"
    return None


def reference_gelu_quantize(y: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, in plain torch (any device): y [M, N] bf16, bias [N] or None."""
    if bias is not None:
        y = (y.float() + bias.float()).to(y.dtype)
    yf = y.float()
    h = (yf * torch.sigmoid(1.702 * yf)).to(y.dtype)
    return quantize_rowwise(h)


if triton is not None:
    from .attention.triton_fp8 import _to_e4m3, interpreter_active

    _EPS = tl.constexpr(EPS)  # Triton reads only constexpr globals
    _E4M3_MAX = tl.constexpr(E4M3_MAX)

    @triton.jit
    def _gelu_quant_kernel(y_ptr, bias_ptr, out_ptr, scale_ptr, n_cols, stride_y, stride_out,
                           HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):  # noqa: N803
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0)
        if HAS_BIAS:
            b = tl.load(bias_ptr + cols, mask=mask, other=0.0)
            y = (y.to(tl.float32) + b.to(tl.float32)).to(tl.bfloat16)
        yf = y.to(tl.float32)
        # y * sigmoid(1.702 y) with approximate division (div.full.f32, 2 ulp): far below the bf16 rounding next
        h = tl.fdiv(yf, 1.0 + tl.exp2(yf * -2.4554669595930156), ieee_rounding=False)  # 1.702 * log2(e)
        h = h.to(tl.bfloat16).to(tl.float32)
        amax = tl.max(tl.abs(h), axis=0)
        scale = tl.maximum(amax, _EPS) / _E4M3_MAX
        q = tl.clamp(h * (1.0 / scale), -_E4M3_MAX, _E4M3_MAX)
        tl.store(out_ptr + row * stride_out + cols, _to_e4m3(q, INTERPRET), mask=mask)
        tl.store(scale_ptr + row, scale)

    @triton_op(OP_NAME, mutates_args={})
    def _gelu_quantize_op(y: torch.Tensor, bias: torch.Tensor | None,
                          num_warps: int = DEFAULT_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = y.shape
        out = torch.empty((rows, cols), dtype=FP8_DTYPE, device=y.device)
        scale = torch.empty((rows, 1), dtype=torch.float32, device=y.device)
        wrap_triton(_gelu_quant_kernel)[(rows,)](
            y, bias if bias is not None else y, out, scale, cols, y.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK=triton.next_power_of_2(cols), INTERPRET=interpreter_active(),
            num_warps=num_warps,
        )
        return out, scale


def gelu_quantize_rowwise(y: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``quantize_rowwise(gelu(y + bias))``.

    y: [M, N] bf16 CUDA, last dim contiguous; bias: [N] (any float dtype) or None.
    Returns (h8 [M, N] float8_e4m3fn, scale [M, 1] float32). Raises ValueError with the reason
    (:func:`gelu_quant_problem`) where the kernel cannot run.
    """
    problem = gelu_quant_problem(y.device, y.shape[-1])
    if problem is not None:
        raise ValueError(problem)
    if y.dtype != torch.bfloat16 or y.dim() != 2 or y.stride(-1) != 1:
        raise ValueError(f"gelu_quantize_rowwise takes a 2-D bf16 tensor with contiguous rows, got {y.dtype} "
                         f"{tuple(y.shape)} strides {y.stride()}")
    return _gelu_quantize_op(y, bias.to(y.dtype).contiguous() if bias is not None else None)
