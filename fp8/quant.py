"""FP8 (float8_e4m3fn) quantization math in plain torch ops.

Everything here is written as ordinary elementwise/reduction ops (abs, amax,
clamp, divide, cast) so that under ``torch.compile`` inductor fuses the
activation quantization into the kernel that produces the activation (norm,
modulate, GELU), with no graph break.

Conventions (``x ~= dequantize(x8, scale)``):

* row-wise: ``x`` [..., K] -> ``x8`` [..., K] float8_e4m3fn, ``scale`` [..., 1]
  float32 with ``scale = max(amax(|x|, dim=-1), EPS) / 448``. Used per token
  for activations and per output channel for weights ([N, K] -> scale [N, 1]).
* tensor-wise: one float32 0-dim scale for the whole tensor.

All-zero rows get the tiny scale ``EPS / 448`` and quantize to exact zeros (no
NaN). Values are clamped to +-448 before the cast, because torch's float8_e4m3fn
cast does not saturate (out-of-range values become NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

__all__ = [
    "E4M3_MAX",
    "EPS",
    "FP8_DTYPE",
    "dequantize",
    "pad_rows",
    "quantize_rowwise",
    "quantize_tensorwise",
    "reference_scaled_mm",
    "relative_error",
    "scaled_mm",
]

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0
EPS = 1e-12


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.to(torch.float32) / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row (last dim) with its own scale.

    x: [..., K] floating. Returns (x8 [..., K] float8_e4m3fn, scale [..., 1] float32).
    """
    amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    scale = amax.clamp(min=EPS) / E4M3_MAX
    return _cast(x, scale), scale


def quantize_tensorwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize with one scale. x: any shape, floating. Returns (x8 float8_e4m3fn, scale 0-dim float32)."""
    amax = x.abs().amax().to(torch.float32)
    scale = amax.clamp(min=EPS) / E4M3_MAX
    return _cast(x, scale), scale


def dequantize(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x8 * scale`` computed in float32, returned as ``dtype``; scale broadcasts ([..., 1] or 0-dim)."""
    return (x8.to(torch.float32) * scale).to(dtype)


def reference_scaled_mm(
    x8: torch.Tensor,
    x_scale: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """What ``torch._scaled_mm`` computes, on any device: dequantize both operands, fp32 matmul, cast.

    x8: [M, K] fp8, x_scale: [M, 1] or 0-dim; w8: [N, K] fp8 (row-major weight),
    w_scale: [N, 1] or 0-dim. Returns [M, N] ``out_dtype``.
    """
    w_deq = dequantize(w8, w_scale)
    return (dequantize(x8, x_scale) @ w_deq.t()).to(out_dtype)


def scaled_mm(
    x8: torch.Tensor,
    x_scale: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``torch._scaled_mm`` with the conventions above (``fast_accum``: cuBLASLt fp8 fast accumulation).

    x8: [M, K] fp8 row-major; w8: [N, K] fp8 row-major (passed transposed, i.e.
    column-major [K, N] as cuBLASLt wants); scales [M, 1] and [N, 1] (row-wise)
    or 0-dim (tensor-wise). K and N must be divisible by 16. Row-wise scales
    need a CUDA GPU (torch 2.11 on CPU accepts per-tensor scales only).
    """
    scale_b = w_scale.t() if w_scale.dim() == 2 else w_scale
    return torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=scale_b, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def pad_rows(x2d: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad a [M, K] tensor to M rounded up to ``multiple`` rows (no copy when already aligned)."""
    pad = (-x2d.shape[0]) % multiple
    return F.pad(x2d, (0, 0, 0, pad)) if pad else x2d


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius, accumulated in float64); 0.0 when both are zero, inf when only ref is."""
    out64, ref64 = out.detach().to(torch.float64), ref.detach().to(torch.float64)
    num = torch.linalg.vector_norm(out64 - ref64).item()
    den = torch.linalg.vector_norm(ref64).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den
