"""A block's gated residual update ``x + gate * linear(h)`` inside the fp8 GEMM's epilogue (cuBLASLt, CUDA).

A Qwen-Image block updates each stream's residual twice: after the attention's output projection and after
the MLP's down-projection, ``x + gate * (h8 . w8^T * h_scale * w_scale + bias)`` with ``gate`` a (D,) row of
the block's modulation. Without this module the GEMM writes its (M, D) bf16 output and a second pass reads it
back with ``x`` (Inductor's ``addcmul``, or the LayerNorm kernel's residual variant): at M = 8192 image tokens
that is 50 MB written and read again per update.

Here the gate is folded into the GEMM's per-column scale (``w_scale * gate``) and bias (``gate * bias``, bf16),
and ``x`` is cuBLASLt's C matrix (``beta = 1``), so the GEMM writes the new residual stream directly
(:func:`...fp8.cublaslt_gemm.cublaslt_rowwise_mm_residual`). Numerics: products, scales, bias and residual in
float32 with one rounding to bf16, where the unfused path rounds the GEMM output, then the update.

Which gate row a token takes (:func:`gate_rows`): one row for all tokens in the common case (one timestep for
the batch, as the sampler's batched CFG passes it); one per sample for per-sample timesteps; with
Qwen-Image-Edit-2511's zero_cond_t the image stream's target tokens take the timestep's row and the reference
tokens the row of timestep 0. Each run of rows with one gate is one cuBLASLt call.

:func:`gated_residual_gemm` returns None where it does not apply, and the caller runs the unfused path: a layer
that is not a row-wise fp8 ``ScaledMMLinear`` with ``gemm_kernel="cublaslt"``, a GEMM the small-M kernel takes
(the text stream's output projection at batch 1), or a site switched off in :data:`SITES`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...fp8.cublaslt_gemm import cublaslt_rowwise_mm_residual
from ...fp8.linear import ScaledMMLinear
from ...fp8.small_m_gemm import small_m_config

__all__ = ["SITES", "GateRows", "gate_rows", "gated_residual_gemm"]

SITES = ("attention", "mlp")
"""Residual updates that go through the GEMM epilogue: after the attention's output projection (``attention``)
and after the MLP (``mlp``). A switch for A/B benches; Dynamo guards on it."""


class GateRows(NamedTuple):
    """The gate rows of one residual update and which rows of the flattened (B * S) stream take which.

    rows: (G, D) bf16 (views of the modulation output); starts: the first row of each run, rising from 0;
    ids: the gate row of each run.
    """

    rows: torch.Tensor
    starts: tuple[int, ...]
    ids: tuple[int, ...]


def gate_rows(mod: torch.Tensor, index: int, dim: int, batch: int, tokens: int,
              target: torch.Tensor | None = None) -> GateRows | None:
    """The :class:`GateRows` of modulation vector ``index`` for a (batch, tokens, dim) stream, or None.

    mod: (R, 6 * dim), R = Bt timestep rows, or 2 Bt with zero_cond_t (rows ``[Bt:]`` for timestep 0);
    target: with zero_cond_t, a (T, 0) tensor whose size is the number of target tokens at the start of
    each sample's stream (the rest are reference tokens). Returns None when Bt is neither 1 nor ``batch``.
    """
    per_timestep = mod.shape[0] // (2 if target is not None else 1)
    if per_timestep not in (1, batch):
        return None
    starts, ids = [], []
    for b in range(batch):
        own = b if per_timestep == batch else 0
        runs = [(b * tokens, own)] + ([(b * tokens + target.shape[0], per_timestep + own)] if target is not None
                                      else [])  # fmt: skip
        for start, g in runs:
            if not ids or ids[-1] != g:
                starts.append(start)
                ids.append(g)
    return GateRows(mod.unflatten(-1, (6, dim))[:, index], tuple(starts), tuple(ids))


def gated_residual_gemm(layer: torch.nn.Module, x8: torch.Tensor, x_scale: torch.Tensor, gates: GateRows | None,
                        residual: torch.Tensor, site: str) -> torch.Tensor | None:
    """``residual + gate * layer(x)`` from the layer's fp8 GEMM epilogue, or None where that does not apply.

    x8: (M, K) float8_e4m3fn and x_scale (M, 1) float32, the layer's input already quantized row-wise;
    gates: from :func:`gate_rows`; residual: (B, S, N) bf16 with B * S = M. Returns (B, S, N) bf16.
    """
    if gates is None or site not in SITES or not isinstance(layer, ScaledMMLinear) or layer.emulate \
            or layer.gemm_kernel != "cublaslt":
        return None  # (gemm_kernel "cublaslt" implies row-wise scales)
    n = layer.out_features
    if gates.rows.shape[-1] != n or residual.dtype != torch.bfloat16 or not residual.is_contiguous():
        return None
    if residual.numel() != x8.shape[0] * n:
        return None
    if small_m_config(x8, layer.weight, x_scale, torch.bfloat16, layer.fast_accum) is not None:
        return None
    rows = gates.rows.float()
    col_scales = layer.weight_scale.reshape(1, n) * rows
    biases = None if layer.bias is None else (layer.bias.float().reshape(1, n) * rows).to(torch.bfloat16)
    out = cublaslt_rowwise_mm_residual(x8, x_scale, layer.weight, col_scales, biases, residual.reshape(-1, n),
                                       gates.starts, gates.ids, layer.fast_accum)
    return out.reshape(residual.shape)
