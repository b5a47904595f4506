"""One fp8 quantization for all the linears that read one modulated activation (fused kernel path).

In a block, ``LayerNorm(x) * (1 + scale) + shift`` feeds Q/K/V (or the fused QKV linear) and, after
the attention, the MLP's first linear. When each of those consumers is a row-wise
:class:`...fp8.ScaledMMLinear` on a CUDA GPU, :func:`modulated_input` returns the activation already
quantized by one Triton kernel (:func:`...fp8.norm_quant.modulate_quantize_rowwise`: LayerNorm,
modulation and quantization in one read of ``x``) as a :class:`Prequantized`, and :func:`apply_linear`
runs each consumer's fp8 GEMM on it, where the block's kernel plan allows the kernel (``BlockKernels.norm_quant``).
Otherwise the plain bf16 activation is returned and the layers quantize it themselves (Inductor fuses that into
the LayerNorm kernel). Same math either way.

Every row-wise fp8 GEMM here runs with the plan's ``small_m_gemm`` choice (:func:`linear`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812

from ...fp8.linear import ScaledMMLinear
from ...fp8.norm_quant import modulate_quantize_rowwise, residual_modulate_quantize_rowwise
from .block_kernels import BlockKernels
from .residual_gemm import gated_residual_gemm

__all__ = [
    "Prequantized",
    "apply_linear",
    "linear",
    "modulated_input",
    "residual_then_modulated",
    "takes_prequantized",
    "unbiased_output",
]


class Prequantized(NamedTuple):
    """A (B, S, K) bf16 activation in row-wise fp8: x8 (B * S, K) float8_e4m3fn, scale (B * S, 1) float32; norms
    (B * S, 1) float32, the dequantized rows' L2 norms, when the quantizing kernel was asked for them (the fused
    GELU GEMM's bound, :mod:`...fp8.gelu_gemm`), else None."""

    x8: torch.Tensor
    scale: torch.Tensor
    batch: int
    tokens: int
    norms: torch.Tensor | None = None


def takes_prequantized(layer: torch.nn.Module) -> bool:
    """True for a row-wise fp8 GEMM layer (not emulated): it can run on a :class:`Prequantized` input."""
    return isinstance(layer, ScaledMMLinear) and layer.granularity == "rowwise" and not layer.emulate


def linear(layer: torch.nn.Module, x: torch.Tensor, kernels: BlockKernels) -> torch.Tensor:
    """``layer(x)`` for x (..., K) -> (..., N); a row-wise :class:`ScaledMMLinear` runs its GEMM with the plan's
    ``small_m_gemm`` choice (``layer(x)`` itself allows the small-M kernel)."""
    if kernels.small_m_gemm or not isinstance(layer, ScaledMMLinear):
        return layer(x)
    x2d = x.reshape(-1, layer.in_features)
    y = layer.linear_quantized(*layer.quantize_input(x2d), x2d.dtype, small_m=False)
    return y.reshape(*x.shape[:-1], layer.out_features)


def modulated_input(x: torch.Tensor, eps: float, mod: torch.Tensor, shift_index: int, scale_index: int,
                    shift: torch.Tensor, scale: torch.Tensor, selector: torch.Tensor | None,
                    consumers_take_fp8: bool, kernels: BlockKernels, with_norms: bool = False
                    ) -> torch.Tensor | Prequantized:
    """``LayerNorm(x) * (1 + scale) + shift``, quantized once when ``consumers_take_fp8`` and the plan has the kernel.

    x: (B, S, D); mod: the modulation GEMM output (R, 6 * D) that ``shift`` / ``scale`` (views of it,
    or per-token selections with ``selector``, see ``block._mod_params``) come from, at vector indices
    ``shift_index`` / ``scale_index``. ``consumers_take_fp8``: every layer that reads the result runs
    through :func:`apply_linear` / ``mlp.mlp_forward`` and can take a :class:`Prequantized` input.
    ``with_norms``: the :class:`Prequantized` also carries its rows' norms (the fused GELU GEMM needs them).
    x bf16 when the kernel runs (the plan checks the dtype).
    """
    if consumers_take_fp8 and kernels.norm_quant:
        x8, x_scale, *norms = modulate_quantize_rowwise(x, eps, mod, 6, shift_index, scale_index, selector,
                                                        with_norms)
        return Prequantized(x8, x_scale, x.shape[0], x.shape[1], norms[0] if norms else None)
    return torch.addcmul(shift, F.layer_norm(x, (x.shape[-1],), eps=eps), 1 + scale)


def residual_then_modulated(x: torch.Tensor, gate: torch.Tensor, layer: torch.nn.Module, layer_input: torch.Tensor,
                            eps: float, mod: torch.Tensor, indices: tuple[int, int, int], shift: torch.Tensor,
                            scale: torch.Tensor, selector: torch.Tensor | None, consumers_take_fp8: bool,
                            kernels: BlockKernels, with_norms: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor | Prequantized]:
    """``x + gate * layer(layer_input)`` and :func:`modulated_input` of it.

    Where :func:`.residual_gemm.gated_residual_gemm` applies (a :class:`Prequantized` input), the layer's GEMM
    writes the new residual stream and one LayerNorm kernel quantizes it; else, where the plan has it, one kernel
    applies the update and the LayerNorm.

    x: (B, S, D) residual stream; layer_input: (B, S, K), or a :class:`Prequantized` one when ``layer`` is a
    row-wise fp8 GEMM (the cuDNN FP8 attention's output); indices: (gate, shift, scale) vector indices in
    ``mod``. ``with_norms``: as :func:`modulated_input`'s. Returns (the new residual stream, the modulated input of
    the next consumers).
    """
    new = None
    if isinstance(layer_input, Prequantized):  # the GEMM writes the new residual stream (cuBLASLt epilogue)
        new = gated_residual_gemm(layer, layer_input.x8, layer_input.scale, gate, x, "attention", kernels)
    if new is None and consumers_take_fp8 and kernels.norm_quant:
        flat = layer_input if isinstance(layer_input, Prequantized) else layer_input.reshape(-1, layer_input.shape[-1])
        update, bias = unbiased_output(layer, flat, kernels)
        new, x8, x_scale, *norms = residual_modulate_quantize_rowwise(x, update, bias, eps, mod, 6, *indices,
                                                                      selector, with_norms)
        return new, Prequantized(x8, x_scale, x.shape[0], x.shape[1], norms[0] if norms else None)
    if new is None:
        new = torch.addcmul(x, gate, apply_linear(layer, layer_input, kernels))
    return new, modulated_input(new, eps, mod, indices[1], indices[2], shift, scale, selector, consumers_take_fp8,
                                kernels, with_norms)


def unbiased_output(layer: torch.nn.Module, x2d: torch.Tensor | Prequantized, kernels: BlockKernels
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(layer(x2d) - bias, bias)`` computed without the bias pass where the layer is a row-wise fp8 GEMM
    (a fused kernel adds the bias); ``(layer(x2d), None)`` otherwise. x2d: (M, K) -> (M, N), or a
    :class:`Prequantized` (M rows) for a row-wise fp8 layer."""
    small_m = kernels.small_m_gemm
    if isinstance(x2d, Prequantized):
        return layer.gemm(x2d.x8, x2d.scale, torch.bfloat16, small_m=small_m), layer.bias
    if takes_prequantized(layer):
        return layer.gemm(*layer.quantize_input(x2d), x2d.dtype, small_m=small_m), layer.bias
    return linear(layer, x2d, kernels), None


def apply_linear(layer: torch.nn.Module, x: torch.Tensor | Prequantized, kernels: BlockKernels) -> torch.Tensor:
    """``layer(x)`` for a bf16 activation or a :class:`Prequantized` one; returns (B, S, N) bf16."""
    if not isinstance(x, Prequantized):
        return linear(layer, x, kernels)
    y = layer.linear_quantized(x.x8, x.scale, torch.bfloat16, small_m=kernels.small_m_gemm)
    return y.reshape(x.batch, x.tokens, layer.out_features)
