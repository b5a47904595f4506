"""A block's gated residual update ``x + gate * linear(h)`` inside the fp8 GEMM's epilogue (cuBLASLt, CUDA).

A Qwen-Image block updates each stream's residual twice: after the attention's output projection and after
the MLP's down-projection, ``x + gate * (h8 . w8^T * h_scale * w_scale + bias)`` with ``gate`` one (D,) row of
the block's modulation. Without this module the GEMM writes its (M, D) bf16 output and a second pass reads it
back with ``x`` (Inductor's ``addcmul``, or the LayerNorm kernel's residual variant): at M = 8192 image tokens
that is 50 MB written and read again per update.

Here the gate is folded into the GEMM's per-column scale (``w_scale * gate``) and bias (``gate * bias``, bf16),
and ``x`` is cuBLASLt's C matrix (``beta = 1``), so the GEMM writes the new residual stream directly
(:func:`...fp8.cublaslt_gemm.cublaslt_rowwise_mm_residual`). Numerics: products, scales, bias and residual in
float32 with one rounding to bf16, where the unfused path rounds the GEMM output, then the update.

:func:`gated_residual_gemm` returns None where it does not apply, and the caller runs the unfused path: a layer
that is not a row-wise fp8 ``ScaledMMLinear`` with ``gemm_kernel="cublaslt"``, a GEMM the small-M kernel takes
(the text stream at batch 1), a gate that varies per sample or per token (Qwen-Image-Edit-2511's zero_cond_t,
or two timesteps in one batch), or a site the kernel plan leaves out (``BlockKernels.residual_epilogue``).
"""

from __future__ import annotations

import torch

from ...fp8.cublaslt_gemm import cublaslt_rowwise_mm_residual
from ...fp8.linear import ScaledMMLinear
from ...fp8.small_m_gemm import small_m_config
from .block_kernels import BlockKernels

__all__ = ["epilogue_layer", "gated_residual_gemm", "one_gate_row"]


def epilogue_layer(layer: torch.nn.Module) -> bool:
    """True for a layer whose GEMM can take the residual update: a row-wise fp8 ``ScaledMMLinear`` (not emulated)
    on the pack's cuBLASLt call (``gemm_kernel="cublaslt"``, which implies row-wise scales)."""
    return isinstance(layer, ScaledMMLinear) and not layer.emulate and layer.gemm_kernel == "cublaslt"


def one_gate_row(timestep_rows: int, per_token: bool) -> bool:
    """Whether a stream's gate is one row for every token: one timestep row, and no per-token gates (the image
    stream under zero_cond_t)."""
    return timestep_rows == 1 and not per_token


def gated_residual_gemm(layer: torch.nn.Module, x8: torch.Tensor, x_scale: torch.Tensor, gate: torch.Tensor,
                        residual: torch.Tensor, site: str, kernels: BlockKernels) -> torch.Tensor | None:
    """``residual + gate * layer(x)`` from the layer's fp8 GEMM epilogue, or None where that does not apply.

    x8: (M, K) float8_e4m3fn and x_scale (M, 1) float32, the layer's input already quantized row-wise;
    gate: (1, 1, N) or (N,) bf16, one row for every token; residual: (B, S, N) bf16 with B * S = M; site:
    "attention" or "mlp", taken where ``kernels.residual_epilogue`` names it. Returns (B, S, N) bf16.
    """
    if site not in kernels.residual_epilogue or not epilogue_layer(layer):
        return None
    n = layer.out_features
    if gate.numel() != n or residual.dtype != torch.bfloat16 or not residual.is_contiguous():
        return None
    if residual.numel() != x8.shape[0] * n:
        return None
    if kernels.small_m_gemm and small_m_config(x8, layer.weight, x_scale, torch.bfloat16, layer.fast_accum) is not None:
        return None  # the small-M kernel runs this GEMM
    gate_row = gate.reshape(n).float()
    col_scale = layer.weight_scale.reshape(n) * gate_row
    bias = None if layer.bias is None else (layer.bias.float() * gate_row).to(torch.bfloat16)
    out = cublaslt_rowwise_mm_residual(x8, x_scale, layer.weight, col_scale, bias, residual.reshape(-1, n),
                                       layer.fast_accum)
    return out.reshape(residual.shape)
