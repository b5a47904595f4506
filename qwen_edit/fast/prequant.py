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
from ...fp8.norm_quant import modulate_quantize_rowwise, norm_quant_problem

__all__ = ["FUSED_NORM_QUANT", "Prequantized", "apply_linear", "modulated_input", "takes_prequantized"]

FUSED_NORM_QUANT = os.environ.get("QWEN_EDIT_FUSED_NORM_QUANT", "1") != "0"


class Prequantized(NamedTuple):
    """A (B, S, K) bf16 activation in row-wise fp8: x8 (B * S, K) float8_e4m3fn, scale (B * S, 1) float32."""

    x8: torch.Tensor
    scale: torch.Tensor
    batch: int
    tokens: int


def takes_prequantized(layer: torch.nn.Module) -> bool:
    """True for a row-wise fp8 GEMM layer (not emulated): it can run on a :class:`Prequantized` input."""
    return isinstance(layer, ScaledMMLinear) and layer.granularity == "rowwise" and not layer.emulate


def modulated_input(x: torch.Tensor, eps: float, mod: torch.Tensor, shift_index: int, scale_index: int,
                    shift: torch.Tensor, scale: torch.Tensor, selector: torch.Tensor | None,
                    consumers_take_fp8: bool) -> torch.Tensor | Prequantized:
    """``LayerNorm(x) * (1 + scale) + shift``, quantized once when ``consumers_take_fp8`` and the kernel can run.

    x: (B, S, D); mod: the modulation GEMM output (R, 6 * D) that ``shift`` / ``scale`` (views of it,
    or per-token selections with ``selector``, see ``block._mod_params``) come from, at vector indices
    ``shift_index`` / ``scale_index``. ``consumers_take_fp8``: every layer that reads the result runs
    through :func:`apply_linear` / ``mlp.mlp_forward`` and can take a :class:`Prequantized` input.
    """
    if (consumers_take_fp8 and FUSED_NORM_QUANT and x.dtype == torch.bfloat16
            and norm_quant_problem(x.device, x.shape[-1]) is None):
        x8, x_scale = modulate_quantize_rowwise(x, eps, mod, 6, shift_index, scale_index, selector)
        return Prequantized(x8, x_scale, x.shape[0], x.shape[1])
    return torch.addcmul(shift, F.layer_norm(x, (x.shape[-1],), eps=eps), 1 + scale)


def apply_linear(layer: torch.nn.Module, x: torch.Tensor | Prequantized) -> torch.Tensor:
    """``layer(x)`` for a bf16 activation or a :class:`Prequantized` one; returns (B, S, N) bf16."""
    if not isinstance(x, Prequantized):
        return layer(x)
    y = layer.gemm(x.x8, x.scale, torch.bfloat16)
    if layer.bias is not None:
        y = y + layer.bias.to(y.dtype)
    return y.reshape(x.batch, x.tokens, layer.out_features)
