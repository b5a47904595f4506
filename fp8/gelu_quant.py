"""Bias + GELU + row-wise fp8 quantization in one pass over the MLP hidden state (Triton, CUDA).

Qwen-Image's MLP applies GELU to the first linear's output ``y`` (M x 12288 bf16 at full size): DiffSynth's
``h = y * sigmoid(1.702 * y)`` (:data:`SIGMOID`), or ComfyUI's ``GELU(approximate="tanh")``,
``0.5 y (1 + tanh(sqrt(2 / pi) (y + 0.044715 y^3)))`` = ``y * sigmoid(2 sqrt(2 / pi) (y + 0.044715 y^3))``
(:data:`TANH`). The second linear, when it is a row-wise :class:`.linear.ScaledMMLinear`,
quantizes ``h`` per token. Inductor fuses bias, GELU and quantization into one looped-reduction kernel
that reads each row twice; on an H200 it took 16.2 ms of a 245 ms forward, ~3.6x its memory-bandwidth
floor (docs/decisions/0008-fused-quantization-kernels.md). This kernel keeps one row in registers: it reads ``y`` and
the bias once and writes the e4m3 row and its float32 scale.

Numerics: bias add rounded to bf16 (as ``y + bias`` in bf16), GELU in float32 rounded once to bf16
(as Inductor computes the bf16 expression), then :func:`.quant.quantize_rowwise`'s scale
(``max(amax, EPS) / 448``), a multiply by its reciprocal instead of the division (differs only where
the quotient is an exact e4m3 rounding tie), clamp to +-448, round to nearest even. On an H200 all
codes of an 8192 x 12288 Gaussian test equalled the reference's.

Limits: CUDA tensors only (Triton), ``y`` bf16 [M, N] with N <= :data:`MAX_COLUMNS`. Callers check
:func:`gelu_quant_capability` and use the plain-torch path when it says no.
Registered as the custom op ``qwen_edit_hopper::gelu_quantize_rowwise`` through
``torch.library.triton_op``, so ``torch.compile`` keeps it in the graph (no graph break).
"""

from __future__ import annotations

import logging

import torch

from .capability import Capability
from .quant import E4M3_MAX, EPS, FP8_DTYPE, quantize_rowwise

__all__ = [
    "GELUS",
    "MAX_COLUMNS",
    "OP_NAME",
    "SIGMOID",
    "TANH",
    "gelu_quant_capability",
    "gelu_quantize_rowwise",
    "reference_gelu",
    "reference_gelu_quantize",
    "row_chunks",
]

logger = logging.getLogger(__name__)

MAX_COLUMNS = 32768
"""Widest row one program holds in registers (12288 at full size)."""

OP_NAME = "qwen_edit_hopper::gelu_quantize_rowwise"

SIGMOID, TANH = "sigmoid", "tanh"
"""The GELU forms the kernel computes: ``y * sigmoid(1.702 y)`` (DiffSynth's ``ApproximateGELU``) and the tanh
approximation (``torch.nn.GELU(approximate="tanh")``, ComfyUI's Qwen-Image MLP)."""
GELUS = (SIGMOID, TANH)

DEFAULT_WARPS = 8
"""Warps per row: fastest of 8 / 16 / 32 at 8192 x 12288 on an H200
(docs/decisions/0008-fused-quantization-kernels.md)."""

try:  # Triton ships with CUDA builds of torch; its absence only disables the fused path (reported by callers).
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError as exc:  # pragma: no cover - depends on the torch build
    triton = None
    _TRITON_MISSING = f"Triton is not importable ({exc})"
else:
    _TRITON_MISSING = None


def row_chunks(n_columns: int) -> tuple[int, int]:
    """(chunks, block) for a row of ``n_columns``: (3, n / 3) where that is a power of two, else (1, next power of
    two). Three unmasked chunks leave no lanes idle where one masked block of 2^(k+2) would idle a quarter of them
    (H200: GELU + quantize of 8192 x 12288 0.170 -> 0.132 ms)."""
    third = n_columns // 3
    if n_columns == 3 * third and third >= 16 and third & (third - 1) == 0:
        return 3, third
    return 1, 1 << max(n_columns - 1, 0).bit_length()


def gelu_quant_capability(y_device: torch.device, n_columns: int) -> Capability:
    """Whether the fused kernel can run for a [M, n_columns] bf16 input on ``y_device``."""
    if _TRITON_MISSING is not None:
        return Capability.no(_TRITON_MISSING)
    if y_device.type != "cuda":
        return Capability.no(f"the Triton kernels need a CUDA tensor, got {y_device.type}")
    if n_columns > MAX_COLUMNS:
        return Capability.no(f"rows of {n_columns} columns exceed the kernel's {MAX_COLUMNS}")
    return Capability.yes(f"Triton GELU + quantize kernel on {y_device}")


def reference_gelu(y: torch.Tensor, gelu: str = SIGMOID) -> torch.Tensor:
    """GELU of ``y`` in its dtype's math (float32 for a float32 tensor) in the form ``gelu`` (:data:`GELUS`)."""
    if gelu == TANH:
        return torch.nn.functional.gelu(y, approximate="tanh")
    return y * torch.sigmoid(1.702 * y)


def reference_gelu_quantize(y: torch.Tensor, bias: torch.Tensor | None, gelu: str = SIGMOID
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, in plain torch (any device): y [M, N] bf16, bias [N] or None."""
    if bias is not None:
        y = (y.float() + bias.float()).to(y.dtype)
    h = reference_gelu(y.float(), gelu).to(y.dtype)
    return quantize_rowwise(h)


if triton is not None:
    from .attention.triton_fp8 import _to_e4m3, interpreter_active

    _EPS = tl.constexpr(EPS)  # Triton reads only constexpr globals
    _E4M3_MAX = tl.constexpr(E4M3_MAX)

    @triton.jit
    def _gelu_chunk(y_ptr, bias_ptr, cols, mask, HAS_BIAS: tl.constexpr, MASKED: tl.constexpr,  # noqa: N803
                    TANH: tl.constexpr):  # noqa: N803
        """GELU(y + bias) of one chunk of a row, rounded to bf16, as float32 (masked lanes: 0)."""
        y = tl.load(y_ptr + cols, mask=mask, other=0.0) if MASKED else tl.load(y_ptr + cols)
        if HAS_BIAS:
            b = tl.load(bias_ptr + cols, mask=mask, other=0.0) if MASKED else tl.load(bias_ptr + cols)
            y = (y.to(tl.float32) + b.to(tl.float32)).to(tl.bfloat16)
        yf = y.to(tl.float32)
        # y * sigmoid(a) with approximate division (div.full.f32, 2 ulp): far below the bf16 rounding next;
        # a = 1.702 y, or for the tanh form 2 sqrt(2 / pi) (y + 0.044715 y^3); the constants carry log2(e)
        if TANH:
            h = tl.fdiv(yf, 1.0 + tl.exp2(yf * (1.0 + 0.044715 * yf * yf) * -2.302208198144325), ieee_rounding=False)
        else:
            h = tl.fdiv(yf, 1.0 + tl.exp2(yf * -2.4554669595930156), ieee_rounding=False)
        return h.to(tl.bfloat16).to(tl.float32)

    @triton.jit
    def _quantize_store_row(out_row, scale_ptr, h0, h1, h2, cols, mask, BLOCK: tl.constexpr,  # noqa: N803
                            CHUNKS: tl.constexpr, INTERPRET: tl.constexpr):  # noqa: N803
        """Row-wise e4m3 of a float32 row held as one masked chunk ``h0`` (masked lanes 0; h1, h2 ignored) or as
        three chunks: scale ``max(amax, EPS) / 448`` stored at ``scale_ptr``, the codes at ``out_row``."""
        amax = tl.max(tl.abs(h0), axis=0)
        if CHUNKS == 3:
            amax = tl.maximum(amax, tl.maximum(tl.max(tl.abs(h1), axis=0), tl.max(tl.abs(h2), axis=0)))
        scale = tl.maximum(amax, _EPS) / _E4M3_MAX
        inv = 1.0 / scale
        if CHUNKS == 3:
            tl.store(out_row + cols, _to_e4m3(tl.clamp(h0 * inv, -_E4M3_MAX, _E4M3_MAX), INTERPRET))
            tl.store(out_row + BLOCK + cols, _to_e4m3(tl.clamp(h1 * inv, -_E4M3_MAX, _E4M3_MAX), INTERPRET))
            tl.store(out_row + 2 * BLOCK + cols, _to_e4m3(tl.clamp(h2 * inv, -_E4M3_MAX, _E4M3_MAX), INTERPRET))
        else:
            tl.store(out_row + cols, _to_e4m3(tl.clamp(h0 * inv, -_E4M3_MAX, _E4M3_MAX), INTERPRET), mask=mask)
        tl.store(scale_ptr, scale)

    @triton.jit
    def _gelu_quant_kernel(y_ptr, bias_ptr, out_ptr, scale_ptr, n_cols, stride_y, stride_out,
                           HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,  # noqa: N803
                           INTERPRET: tl.constexpr, TANH: tl.constexpr):  # noqa: N803
        """One row per program. CHUNKS 1: the row in one BLOCK >= n_cols, masked. CHUNKS 3: n_cols == 3 * BLOCK,
        three unmasked chunks (no idle lanes where the width is 3 * 2^k, e.g. 12288)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        y_row, out_row = y_ptr + row * stride_y, out_ptr + row * stride_out
        if CHUNKS == 3:
            h0 = _gelu_chunk(y_row, bias_ptr, cols, mask, HAS_BIAS, False, TANH)
            h1 = _gelu_chunk(y_row + BLOCK, bias_ptr + BLOCK, cols, mask, HAS_BIAS, False, TANH)
            h2 = _gelu_chunk(y_row + 2 * BLOCK, bias_ptr + 2 * BLOCK, cols, mask, HAS_BIAS, False, TANH)
        else:
            h0 = _gelu_chunk(y_row, bias_ptr, cols, mask, HAS_BIAS, True, TANH)
            h1, h2 = h0, h0
        _quantize_store_row(out_row, scale_ptr + row, h0, h1, h2, cols, mask, BLOCK, CHUNKS, INTERPRET)

    @triton_op(OP_NAME, mutates_args={})
    def _gelu_quantize_op(y: torch.Tensor, bias: torch.Tensor | None, num_warps: int = DEFAULT_WARPS,
                          tanh: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = y.shape
        out = torch.empty((rows, cols), dtype=FP8_DTYPE, device=y.device)
        scale = torch.empty((rows, 1), dtype=torch.float32, device=y.device)
        chunks, block = row_chunks(cols)
        wrap_triton(_gelu_quant_kernel)[(rows,)](
            y, bias if bias is not None else y, out, scale, cols, y.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK=block, CHUNKS=chunks, INTERPRET=interpreter_active(), TANH=tanh,
            num_warps=num_warps,
        )
        return out, scale


def gelu_quantize_rowwise(y: torch.Tensor, bias: torch.Tensor | None = None, *, num_warps: int = DEFAULT_WARPS,
                          gelu: str = SIGMOID) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``quantize_rowwise(gelu(y + bias))``.

    y: [M, N] bf16 CUDA, last dim contiguous; bias: [N] (any float dtype) or None; ``num_warps`` per row; ``gelu``:
    the GELU form (:data:`GELUS`).
    Returns (h8 [M, N] float8_e4m3fn, scale [M, 1] float32). Raises ValueError with the reason
    (:func:`gelu_quant_capability`) where the kernel cannot run.
    """
    if gelu not in GELUS:
        raise ValueError(f"gelu {gelu!r} is not one of {', '.join(GELUS)}")
    capability = gelu_quant_capability(y.device, y.shape[-1])
    if not capability.ok:
        raise ValueError(capability.reason)
    if y.dtype != torch.bfloat16 or y.dim() != 2 or y.stride(-1) != 1:
        raise ValueError(f"gelu_quantize_rowwise takes a 2-D bf16 tensor with contiguous rows, got {y.dtype} "
                         f"{tuple(y.shape)} strides {y.stride()}")
    return _gelu_quantize_op(y, bias.to(y.dtype).contiguous() if bias is not None else None, num_warps,
                             gelu == TANH)
