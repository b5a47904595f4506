"""One fp8 quantization for all the linears that read one modulated activation (fused kernel path).

In a block, ``LayerNorm(x) * (1 + scale) + shift`` feeds Q/K/V (or the fused QKV linear) and, after
the attention, the MLP's first linear. When each of those consumers is a row-wise
:class:`...fp8.ScaledMMLinear` on a CUDA GPU, :func:`modulated_input` returns the activation already
quantized by one Triton kernel (:func:`...fp8.norm_quant.modulate_quantize_rowwise`: LayerNorm,
modulation and quantization in one read of ``x``) as a :class:`Prequantized`, and :func:`apply_linear`
runs each consumer's fp8 GEMM on it. Otherwise the plain bf16 activation is returned and the layers
quantize it themselves (Inductor fuses that into the LayerNorm kernel). Same math either way.

``FUSED_NORM_QUANT`` (environment ``QWEN_EDIT_FUSED_NORM_QUANT=0`` turns it off) exists so the
benchmark can time both paths in one run.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812

from ...fp8.linear import ScaledMMLinear
from ...fp8.norm_quant import modulate_quantize_rowwise, norm_quant_problem, residual_modulate_quantize_rowwise
from .residual_gemm import gated_residual_gemm

__all__ = [
    "FUSED_NORM_QUANT",
    "Prequantized",
    "apply_linear",
    "modulated_input",
    "residual_then_modulated",
    "takes_prequantized",
    "unbiased_output",
]

FUSED_NORM_QUANT = os.environ.get("QWEN_EDIT_FUSED_NORM_QUANT", "1") != "0"


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


def _fusable(consumers_take_fp8: bool, x: torch.Tensor) -> bool:
    return (consumers_take_fp8 and FUSED_NORM_QUANT and x.dtype == torch.bfloat16
            and norm_quant_problem(x.device, x.shape[-1]) is None)


def modulated_input(x: torch.Tensor, eps: float, mod: torch.Tensor, shift_index: int, scale_index: int,
                    shift: torch.Tensor, scale: torch.Tensor, selector: torch.Tensor | None,
                    consumers_take_fp8: bool, with_norms: bool = False) -> torch.Tensor | Prequantized:
    """``LayerNorm(x) * (1 + scale) + shift``, quantized once when ``consumers_take_fp8`` and the kernel can run.

    x: (B, S, D); mod: the modulation GEMM output (R, 6 * D) that ``shift`` / ``scale`` (views of it,
    or per-token selections with ``selector``, see ``block._mod_params``) come from, at vector indices
    ``shift_index`` / ``scale_index``. ``consumers_take_fp8``: every layer that reads the result runs
    through :func:`apply_linear` / ``mlp.mlp_forward`` and can take a :class:`Prequantized` input.
    ``with_norms``: the :class:`Prequantized` also carries its rows' norms (the fused GELU GEMM needs them).
    """
    if _fusable(consumers_take_fp8, x):
        x8, x_scale, *norms = modulate_quantize_rowwise(x, eps, mod, 6, shift_index, scale_index, selector,
                                                        with_norms)
        return Prequantized(x8, x_scale, x.shape[0], x.shape[1], norms[0] if norms else None)
    return torch.addcmul(shift, F.layer_norm(x, (x.shape[-1],), eps=eps), 1 + scale)


def residual_then_modulated(x: torch.Tensor, gate: torch.Tensor, layer: torch.nn.Module, layer_input: torch.Tensor,
                            eps: float, mod: torch.Tensor, indices: tuple[int, int, int], shift: torch.Tensor,
                            scale: torch.Tensor, selector: torch.Tensor | None, consumers_take_fp8: bool,
                            with_norms: bool = False) -> tuple[torch.Tensor, torch.Tensor | Prequantized]:
    """``x + gate * layer(layer_input)`` and :func:`modulated_input` of it.

    Where :func:`.residual_gemm.gated_residual_gemm` applies (a :class:`Prequantized` input), the layer's GEMM
    writes the new residual stream and one LayerNorm kernel quantizes it; else, where it can run, one kernel
    applies the update and the LayerNorm.

    x: (B, S, D) residual stream; layer_input: (B, S, K), or a :class:`Prequantized` one when ``layer`` is a
    row-wise fp8 GEMM (the cuDNN FP8 attention's output); indices: (gate, shift, scale) vector indices in
    ``mod``. ``with_norms``: as :func:`modulated_input`'s. Returns (the new residual stream, the modulated input of
    the next consumers).
    """
    new = None
    if isinstance(layer_input, Prequantized):  # the GEMM writes the new residual stream (cuBLASLt epilogue)
        new = gated_residual_gemm(layer, layer_input.x8, layer_input.scale, gate, x, "attention")
    if new is None and _fusable(consumers_take_fp8, x):
        flat = layer_input if isinstance(layer_input, Prequantized) else layer_input.reshape(-1, layer_input.shape[-1])
        update, bias = unbiased_output(layer, flat)
        new, x8, x_scale, *norms = residual_modulate_quantize_rowwise(x, update, bias, eps, mod, 6, *indices,
                                                                      selector, with_norms)
        return new, Prequantized(x8, x_scale, x.shape[0], x.shape[1], norms[0] if norms else None)
    if new is None:
        new = torch.addcmul(x, gate, apply_linear(layer, layer_input))
    return new, modulated_input(new, eps, mod, indices[1], indices[2], shift, scale, selector, consumers_take_fp8,
                                with_norms)


def unbiased_output(layer: torch.nn.Module, x2d: torch.Tensor | Prequantized
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(layer(x2d) - bias, bias)`` computed without the bias pass where the layer is a row-wise fp8 GEMM
    (a fused kernel adds the bias); ``(layer(x2d), None)`` otherwise. x2d: (M, K) -> (M, N), or a
    :class:`Prequantized` (M rows) for a row-wise fp8 layer."""
    if isinstance(x2d, Prequantized):
        return layer.gemm(x2d.x8, x2d.scale, torch.bfloat16), layer.bias
    if takes_prequantized(layer):
        return layer.gemm(*layer.quantize_input(x2d), x2d.dtype), layer.bias
    return layer(x2d), None


def apply_linear(layer: torch.nn.Module, x: torch.Tensor | Prequantized) -> torch.Tensor:
    """``layer(x)`` for a bf16 activation or a :class:`Prequantized` one; returns (B, S, N) bf16."""
    if not isinstance(x, Prequantized):
        return layer(x)
    return layer.linear_quantized(x.x8, x.scale, torch.bfloat16).reshape(x.batch, x.tokens, layer.out_features)
