"""DiffSynth's ``QwenFeedForward`` for the fast block, with a fused fp8 path.

``net[0]`` is ``ApproximateGELU`` (Linear D -> 4D, then ``y * sigmoid(1.702 y)``), ``net[1]`` a
``Dropout(p=0.0)`` (an identity, skipped so no RNG op enters the graph), ``net[2]`` Linear 4D -> D.

When ``net[2]`` is a row-wise :class:`...fp8.ScaledMMLinear` on a CUDA GPU, the hidden state
(tokens x 4D, the largest activation of the block) goes through one Triton kernel
(:func:`...fp8.gelu_quant.gelu_quantize_rowwise`): ``net[0]``'s bias, the GELU and the per-token
fp8 quantization in one read of the GEMM output, instead of Inductor's two-pass reduction kernel.
Same math as the plain path (docs/experiments/forward.md has the measurement). Elsewhere (CPU,
emulated fp8, other backends) the plain path runs; it computes the same thing. The input may arrive
already quantized (:class:`.prequant.Prequantized`, when :func:`mlp_takes_prequantized`).

``FUSED_GELU_QUANT`` (environment ``QWEN_EDIT_FUSED_GELU_QUANT=0`` turns it off) exists so the
benchmark can time both paths in one run.

Where the up-projection is a fast-accumulation row-wise fp8 layer on Hopper and the input arrives quantized with
its rows' norms (:func:`uses_gelu_gemm`; both streams, the text stream since the sixteenth session), one Triton
GEMM does the up-projection, bias, GELU and the e4m3 cast (:func:`...fp8.gelu_gemm.gelu_gemm_rowwise`), with a row
scale from a bound instead of the row's amax; the bf16 hidden state is never written. ``FUSED_GELU_GEMM``
(environment ``QWEN_EDIT_FUSED_GELU_GEMM=0``) is its switch.
"""

from __future__ import annotations

import os

import torch

from ...fp8.gelu_gemm import gelu_gemm_rowwise
from ...fp8.gelu_quant import gelu_quant_problem, gelu_quantize_rowwise
from .prequant import Prequantized, takes_prequantized, unbiased_output
from .residual_gemm import gated_residual_gemm

__all__ = ["FUSED_GELU_GEMM", "FUSED_GELU_QUANT", "mlp_forward", "mlp_residual", "mlp_takes_prequantized",
           "uses_fused_gelu_quant", "uses_gelu_gemm"]

FUSED_GELU_QUANT = os.environ.get("QWEN_EDIT_FUSED_GELU_QUANT", "1") != "0"

FUSED_GELU_GEMM = os.environ.get("QWEN_EDIT_FUSED_GELU_GEMM", "1") != "0"
"""Switch for :func:`uses_gelu_gemm` (A/B benches; Dynamo guards on it)."""


def uses_fused_gelu_quant(mlp: torch.nn.Module, x: torch.Tensor) -> bool:
    """True when :func:`mlp_forward` takes the fused kernel for this MLP and input (B, S, D)."""
    down = mlp.net[2]
    return (FUSED_GELU_QUANT and takes_prequantized(down) and x.dtype == torch.bfloat16
            and gelu_quant_problem(x.device, down.in_features) is None)


def mlp_takes_prequantized(mlp: torch.nn.Module, x: torch.Tensor) -> bool:
    """True when :func:`mlp_forward` can take its input (like ``x``, (B, S, D)) as a :class:`.prequant.Prequantized`."""
    return uses_fused_gelu_quant(mlp, x) and takes_prequantized(mlp.net[0].proj)


def uses_gelu_gemm(mlp: torch.nn.Module, x: torch.Tensor) -> bool:
    """True when :func:`mlp_forward` should get its input (like ``x``, (B, S, D) bf16) quantized with row norms, for
    the fused GELU GEMM: :data:`FUSED_GELU_GEMM`, the fused path (:func:`mlp_takes_prequantized`), an up-projection
    with fast accumulation and a :attr:`column_bound`, and a Hopper GPU (both streams, any number of rows)."""
    up = mlp.net[0].proj
    return (FUSED_GELU_GEMM and x.is_cuda and mlp_takes_prequantized(mlp, x) and up.fast_accum
            and getattr(up, "column_bound", None) is not None
            and tuple(torch.cuda.get_device_capability(x.device)) == (9, 0))


def _quantized_hidden(mlp: torch.nn.Module, x: torch.Tensor | Prequantized
                      ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The fused path up to the down-projection: (hidden x8 (B * S, 4D) e4m3, scale (B * S, 1) float32, B, S)."""
    up = mlp.net[0].proj
    if isinstance(x, Prequantized) and x.norms is not None:  # one GEMM: up-projection, bias, GELU, e4m3 cast
        h8, h_scale = gelu_gemm_rowwise(x.x8, x.scale, x.norms, up.weight, up.weight_scale, up.bias, up.column_bound)
        return h8, h_scale, x.batch, x.tokens
    if isinstance(x, Prequantized):
        hidden, up_bias, batch, tokens = up.gemm(x.x8, x.scale, torch.bfloat16), up.bias, x.batch, x.tokens
    else:
        batch, tokens = x.shape[0], x.shape[1]
        hidden, up_bias = unbiased_output(up, x.reshape(-1, x.shape[-1]))  # the bias goes into the fused kernel
    x8, scale = gelu_quantize_rowwise(hidden, up_bias)
    return x8, scale, batch, tokens


def _down_projection(mlp: torch.nn.Module, x8: torch.Tensor, scale: torch.Tensor, batch: int, tokens: int
                     ) -> torch.Tensor:
    down = mlp.net[2]
    return down.linear_quantized(x8, scale, torch.bfloat16).reshape(batch, tokens, down.out_features)


def mlp_forward(mlp: torch.nn.Module, x: torch.Tensor | Prequantized) -> torch.Tensor:
    """x: (B, S, D), or its row-wise fp8 form when :func:`mlp_takes_prequantized`; returns what ``mlp(x)`` does."""
    if not isinstance(x, Prequantized) and not uses_fused_gelu_quant(mlp, x):
        return mlp.net[2](mlp.net[0](x))
    return _down_projection(mlp, *_quantized_hidden(mlp, x))


def mlp_residual(mlp: torch.nn.Module, x: torch.Tensor | Prequantized, residual: torch.Tensor,
                 gate: torch.Tensor) -> torch.Tensor:
    """``residual + gate * mlp(x)``: residual (B, S, D) bf16, gate broadcastable to it; returns (B, S, D).

    On the fused path with one gate row, the down-projection's GEMM writes the sum
    (:func:`.residual_gemm.gated_residual_gemm`); otherwise one ``addcmul`` after the MLP.
    """
    if not isinstance(x, Prequantized) and not uses_fused_gelu_quant(mlp, x):
        return torch.addcmul(residual, gate, mlp.net[2](mlp.net[0](x)))
    hidden = _quantized_hidden(mlp, x)
    new = gated_residual_gemm(mlp.net[2], hidden[0], hidden[1], gate, residual, "mlp")
    return torch.addcmul(residual, gate, _down_projection(mlp, *hidden)) if new is None else new
