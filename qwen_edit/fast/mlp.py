"""DiffSynth's ``QwenFeedForward`` for the fast block, with fused fp8 paths.

``net[0]`` is ``ApproximateGELU`` (Linear D -> 4D, then ``y * sigmoid(1.702 y)``), ``net[1]`` a
``Dropout(p=0.0)`` (an identity, skipped so no RNG op enters the graph), ``net[2]`` Linear 4D -> D.

Where the kernel plan allows ``gelu_quant`` and ``net[2]`` is a row-wise :class:`...fp8.ScaledMMLinear` (not
emulated), the hidden state (tokens x 4D, the largest activation of the block) goes through one Triton kernel
(:func:`...fp8.gelu_quant.gelu_quantize_rowwise`): ``net[0]``'s bias, the GELU and the per-token fp8 quantization
in one read of the GEMM output, instead of Inductor's two-pass reduction kernel. Same math as the plain path. The
input may arrive already quantized (:class:`.prequant.Prequantized`, when :func:`mlp_takes_prequantized`).

Where the plan allows ``gelu_gemm`` for the stream, the up-projection is a fast-accumulation row-wise fp8 layer
with a ``column_bound`` and the input arrives quantized with its rows' norms (:func:`uses_gelu_gemm`), one Triton
GEMM does the up-projection, bias, GELU and the e4m3 cast (:func:`...fp8.gelu_gemm.gelu_gemm_rowwise`), with a row
scale from a bound instead of the row's amax; the bf16 hidden state is never written.

ComfyUI's ``FeedForward`` has the same layers, but its ``net[0]`` is ``GELU(approximate="tanh")`` (the released
model's activation). The fused kernels compute both forms (:data:`...fp8.gelu_quant.GELUS`); :func:`kernel_gelu`
names the MLP's, and an MLP with any other activation (the exact erf GELU) runs the plain path with it
(:func:`activation`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from ...fp8.gelu_gemm import gelu_gemm_rowwise
from ...fp8.gelu_quant import SIGMOID, TANH, gelu_quantize_rowwise
from .block_kernels import BlockKernels
from .prequant import Prequantized, linear, takes_prequantized, unbiased_output
from .residual_gemm import gated_residual_gemm

__all__ = ["activation", "gelu_gemm_layer", "kernel_gelu", "mlp_forward", "mlp_residual", "mlp_takes_prequantized",
           "uses_fused_gelu_quant", "uses_gelu_gemm"]


def kernel_gelu(mlp: torch.nn.Module) -> str | None:
    """The fused kernels' name of the MLP's activation: ``"sigmoid"`` for DiffSynth's ``y * sigmoid(1.702 y)`` (an
    up-projection module naming no ``approximate``), ``"tanh"`` for ``GELU(approximate="tanh")`` (ComfyUI's), None
    for any other (the kernels do not compute it)."""
    approximate = getattr(mlp.net[0], "approximate", None)
    if approximate is None:
        return SIGMOID
    return TANH if approximate == "tanh" else None


def activation(mlp: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The MLP's activation of the up-projection output ``h`` (any shape, its dtype)."""
    if kernel_gelu(mlp) == SIGMOID:
        return h * torch.sigmoid(1.702 * h)
    return F.gelu(h, approximate=mlp.net[0].approximate)


def uses_fused_gelu_quant(mlp: torch.nn.Module, kernels: BlockKernels) -> bool:
    """True when :func:`mlp_forward` takes the fused kernel for this MLP: the plan allows it, the kernels compute
    the activation (:func:`kernel_gelu`) and ``net[2]`` is a row-wise fp8 GEMM layer."""
    return kernels.gelu_quant and kernel_gelu(mlp) is not None and takes_prequantized(mlp.net[2])


def mlp_takes_prequantized(mlp: torch.nn.Module, kernels: BlockKernels) -> bool:
    """True when :func:`mlp_forward` can take its input as a :class:`.prequant.Prequantized`."""
    return uses_fused_gelu_quant(mlp, kernels) and takes_prequantized(mlp.net[0].proj)


def gelu_gemm_layer(up: torch.nn.Module) -> bool:
    """True for an up-projection the fused GELU GEMM takes: row-wise fp8 (not emulated), fast accumulation, a
    :attr:`column_bound` (kept for CUDA layers)."""
    return takes_prequantized(up) and up.fast_accum and getattr(up, "column_bound", None) is not None


def uses_gelu_gemm(mlp: torch.nn.Module, stream: str, kernels: BlockKernels) -> bool:
    """True when :func:`mlp_forward` should get its input quantized with row norms, for the fused GELU GEMM: the plan
    allows it for ``stream`` ("image" or "text"), the fused path (:func:`mlp_takes_prequantized`) and
    :func:`gelu_gemm_layer`."""
    return stream in kernels.gelu_gemm and mlp_takes_prequantized(mlp, kernels) and gelu_gemm_layer(mlp.net[0].proj)


def _quantized_hidden(mlp: torch.nn.Module, x: torch.Tensor | Prequantized, kernels: BlockKernels
                      ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The fused path up to the down-projection: (hidden x8 (B * S, 4D) e4m3, scale (B * S, 1) float32, B, S)."""
    up = mlp.net[0].proj
    if isinstance(x, Prequantized) and x.norms is not None:  # one GEMM: up-projection, bias, GELU, e4m3 cast
        h8, h_scale = gelu_gemm_rowwise(x.x8, x.scale, x.norms, up.weight, up.weight_scale, up.bias, up.column_bound,
                                        kernel_gelu(mlp))
        return h8, h_scale, x.batch, x.tokens
    if isinstance(x, Prequantized):
        hidden = up.gemm(x.x8, x.scale, torch.bfloat16, small_m=kernels.small_m_gemm)
        up_bias, batch, tokens = up.bias, x.batch, x.tokens
    else:
        batch, tokens = x.shape[0], x.shape[1]
        hidden, up_bias = unbiased_output(up, x.reshape(-1, x.shape[-1]), kernels)  # the bias goes into the kernel
    x8, scale = gelu_quantize_rowwise(hidden, up_bias, gelu=kernel_gelu(mlp))
    return x8, scale, batch, tokens


def _down_projection(mlp: torch.nn.Module, x8: torch.Tensor, scale: torch.Tensor, batch: int, tokens: int,
                     kernels: BlockKernels) -> torch.Tensor:
    down = mlp.net[2]
    y = down.linear_quantized(x8, scale, torch.bfloat16, small_m=kernels.small_m_gemm)
    return y.reshape(batch, tokens, down.out_features)


def _plain(mlp: torch.nn.Module, x: torch.Tensor, kernels: BlockKernels) -> torch.Tensor:
    """``mlp(x)`` layer by layer (Dropout(p=0) skipped)."""
    if kernels.small_m_gemm:
        return mlp.net[2](mlp.net[0](x))
    h = linear(mlp.net[0].proj, x, kernels)
    return linear(mlp.net[2], activation(mlp, h), kernels)


def mlp_forward(mlp: torch.nn.Module, x: torch.Tensor | Prequantized, kernels: BlockKernels) -> torch.Tensor:
    """x: (B, S, D), or its row-wise fp8 form when :func:`mlp_takes_prequantized`; returns what ``mlp(x)`` does."""
    if not isinstance(x, Prequantized) and not uses_fused_gelu_quant(mlp, kernels):
        return _plain(mlp, x, kernels)
    return _down_projection(mlp, *_quantized_hidden(mlp, x, kernels), kernels)


def mlp_residual(mlp: torch.nn.Module, x: torch.Tensor | Prequantized, residual: torch.Tensor,
                 gate: torch.Tensor, kernels: BlockKernels) -> torch.Tensor:
    """``residual + gate * mlp(x)``: residual (B, S, D) bf16, gate broadcastable to it; returns (B, S, D).

    On the fused path with one gate row, the down-projection's GEMM writes the sum where the plan allows the
    epilogue (:func:`.residual_gemm.gated_residual_gemm`); otherwise one ``addcmul`` after the MLP.
    """
    if not isinstance(x, Prequantized) and not uses_fused_gelu_quant(mlp, kernels):
        return torch.addcmul(residual, gate, _plain(mlp, x, kernels))
    hidden = _quantized_hidden(mlp, x, kernels)
    new = gated_residual_gemm(mlp.net[2], hidden[0], hidden[1], gate, residual, "mlp", kernels)
    if new is None:
        return torch.addcmul(residual, gate, _down_projection(mlp, *hidden, kernels))
    return new
