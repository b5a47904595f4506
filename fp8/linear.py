"""Linear modules that keep their weight in fp8 (float8_e4m3fn) with float32 scales.

State dict of every module here: ``weight`` (float8_e4m3fn [out, in]),
``weight_scale`` (float32, [out, 1] per channel or 0-dim per tensor) and
``bias`` (compute dtype, [out]) when the source linear had one. ``weight`` is the
stored fp8 tensor (inspect shape/dtype/device); :meth:`Fp8Linear.dequantize_weight`
gives the high-precision view. Loading a non-fp8 ``weight`` is refused: quantize
a bf16 checkpoint by loading it into the bf16 model and converting again.

A model-wide ``.to(dtype)`` (or ``.half()``) moves these modules but keeps the
fp8 payload and float32 scales (e4m3 -> bf16/fp16 -> e4m3 is lossless; scales
are restored from their float32 values), so a pipeline's dtype cast cannot
silently corrupt them.

Inputs: [..., in_features] in bf16 / fp16 / fp32; outputs have the input dtype.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from .capability import Capability
from .config import GEMM_KERNELS
from .cublaslt_gemm import cublaslt_rowwise_mm
from .gelu_gemm import column_bound
from .quant import (
    FP8_DTYPE,
    dequantize,
    pad_rows,
    quantize_rowwise,
    quantize_tensorwise,
    reference_scaled_mm,
    scaled_mm,
)
from .small_m_gemm import fp8_gemm_small_m, small_m_config

__all__ = ["GEMM_KERNELS", "GRANULARITIES", "Fp8Linear", "ScaledMMLinear", "WeightOnlyLinear",
           "scaled_mm_shape_capability"]

logger = logging.getLogger(__name__)

GRANULARITIES = ("rowwise", "tensorwise")
SCALED_MM_ALIGN = 16


def scaled_mm_shape_capability(in_features: int, out_features: int, what: str = "torch._scaled_mm") -> Capability:
    """Whether a [out, in] weight can go through an fp8 GEMM (K, N % 16 == 0)."""
    bad = [f"{n}={v}" for n, v in (("K", in_features), ("N", out_features)) if v % SCALED_MM_ALIGN]
    if not bad:
        return Capability.yes(f"K={in_features} and N={out_features} are divisible by {SCALED_MM_ALIGN}")
    return Capability.no(f"{' and '.join(bad)} not divisible by {SCALED_MM_ALIGN} ({what} needs K and N divisible by "
                         "16)")


class Fp8Linear(nn.Module):
    """Base class: fp8 weight + float32 scale + optional bias, shape handling in :meth:`forward`.

    Subclasses implement ``_matmul(x2d) -> y2d`` on [M, K] -> [M, N]. Rows are
    zero-padded to ``token_multiple`` (1 here: ``torch._scaled_mm`` has no
    constraint on M) and the padding is sliced off again.
    """

    token_multiple: int = 1

    def __init__(
        self,
        weight_fp8: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        layer_name: str = "",
    ) -> None:
        super().__init__()
        if weight_fp8.dtype != FP8_DTYPE or weight_fp8.dim() != 2:
            raise TypeError(f"{layer_name or 'layer'}: weight must be a 2-D {FP8_DTYPE} tensor, got {weight_fp8.dtype}")
        self.out_features, self.in_features = (int(s) for s in weight_fp8.shape)
        self.layer_name = layer_name
        self.register_buffer("weight", weight_fp8)
        self.register_buffer("weight_scale", weight_scale.to(torch.float32))
        if bias is not None:
            self.register_buffer("bias", bias.detach())
        else:
            self.register_buffer("bias", None)

    # ----- inspection -------------------------------------------------------------------------
    def dequantize_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The weight as ``dtype`` [out, in] (weight * scale, computed in float32)."""
        return dequantize(self.weight, self.weight_scale, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    # ----- forward ----------------------------------------------------------------------------
    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features], same dtype as x."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.layer_name or type(self).__name__}: input has {x.shape[-1]} features, "
                             f"expected {self.in_features}")
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)
        rows = x2d.shape[0]
        y = self._matmul(pad_rows(x2d, self.token_multiple))
        if y.shape[0] != rows:
            y = y[:rows]
        return y.reshape(*lead, self.out_features)

    # ----- dtype / state-dict safety -------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        kept = {name: getattr(self, name) for name in ("weight_scale", "column_bound")
                if getattr(self, name, None) is not None}
        super()._apply(fn, recurse)
        if self.weight.dtype != FP8_DTYPE:  # e.g. model.to(torch.bfloat16): e4m3 -> bf16 -> e4m3 is exact
            self.weight = self.weight.to(FP8_DTYPE)
        for name, value in kept.items():  # float32 scales and bounds stay float32
            if getattr(self, name).dtype != torch.float32:
                setattr(self, name, value.to(device=getattr(self, name).device))
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        w = state_dict.get(prefix + "weight")
        if w is not None and w.dtype != FP8_DTYPE:
            error_msgs.append(
                f"{prefix}weight: expected {FP8_DTYPE} (an fp8 state dict from this module), got {w.dtype}; "
                "load bf16 weights into the bf16 model, then convert with quantize_linears"
            )
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


class ScaledMMLinear(Fp8Linear):
    """fp8 x fp8 GEMM through ``torch._scaled_mm`` (or its fp32 reference when ``emulate``).

    granularity ``rowwise``: per-token activation scales [M, 1] and per-channel
    weight scales [N, 1]; ``tensorwise``: one scale each. Activations are
    quantized dynamically in :func:`.quant.quantize_rowwise` /
    :func:`.quant.quantize_tensorwise`; the bias is added after the GEMM in the
    output dtype (inductor fuses it).

    .. note:: K and N must be divisible by 16. Needs CUDA compute capability
       >= 8.9 (row-wise: a torch whose row-wise kernel runs on the GPU; Hopper
       sm_90 is the target). Row-wise takes bf16 activations only (torch's
       row-wise kernel writes bf16); tensor-wise takes bf16 / fp16 / fp32.
       ``emulate=True`` runs anywhere, any of those dtypes, in fp32, slowly.
    """

    def __init__(self, weight_fp8, weight_scale, bias, granularity: str, emulate: bool = False, layer_name: str = "",
                 fast_accum: bool = False, gemm_kernel: str = "torch"):
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity={granularity!r} is not allowed; allowed values: {', '.join(GRANULARITIES)}")
        if gemm_kernel not in GEMM_KERNELS:
            raise ValueError(f"gemm_kernel={gemm_kernel!r} is not allowed; allowed values: {', '.join(GEMM_KERNELS)}")
        if gemm_kernel == "cublaslt" and granularity != "rowwise":
            raise ValueError(f"{layer_name or 'layer'}: gemm_kernel='cublaslt' takes row-wise scales only; "
                             f"use gemm_kernel='torch' with granularity={granularity!r}")
        super().__init__(weight_fp8, weight_scale, bias, layer_name)
        shape = scaled_mm_shape_capability(self.in_features, self.out_features)
        if not shape.ok:
            raise ValueError(f"{layer_name or 'layer'}: {shape.reason}")
        self.granularity = granularity
        self.emulate = bool(emulate)
        self.fast_accum = bool(fast_accum)
        self.gemm_kernel = gemm_kernel
        self.register_buffer("column_bound", None, persistent=False)
        self.refresh_column_bound()

    @torch.no_grad()
    def refresh_column_bound(self) -> None:
        """Recompute :attr:`column_bound` ((2,) float32: max row norm of the dequantized weight, max |bias|; see
        :func:`.gelu_gemm.column_bound`) from the current weight, in place when it exists (a captured CUDA graph
        reads the same memory). Kept for row-wise CUDA layers only (``None`` otherwise): the fused GELU GEMM
        bounds its output with it. Called on construction, after loading a state dict, after a move to CUDA and
        by whatever rewrites the weight in place (``qwen_edit.fp8_dit.write_weights``)."""
        if self.granularity != "rowwise" or not self.weight.is_cuda:
            self.column_bound = None
            return
        value = column_bound(self.weight, self.weight_scale, self.bias)
        if self.column_bound is not None and self.column_bound.device == value.device:
            self.column_bound.copy_(value)
        else:
            self.column_bound = value

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.column_bound is None and self.weight.is_cuda:  # moved to the GPU after quantizing elsewhere
            self.refresh_column_bound()
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self.refresh_column_bound()

    @classmethod
    def from_linear(cls, linear: nn.Linear, granularity: str = "rowwise", emulate: bool = False,
                    layer_name: str = "", fast_accum: bool = False, gemm_kernel: str = "torch") -> ScaledMMLinear:
        """Quantize ``linear.weight`` (per channel for rowwise, per tensor for tensorwise)."""
        w = linear.weight.detach()
        w8, ws = quantize_rowwise(w) if granularity == "rowwise" else quantize_tensorwise(w)
        return cls(w8, ws, linear.bias, granularity, emulate, layer_name, fast_accum, gemm_kernel)

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        return self.linear_quantized(*self.quantize_input(x2d), x2d.dtype)

    def linear_quantized(self, x8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype, *,
                         small_m: bool = True) -> torch.Tensor:
        """:meth:`gemm` plus the bias (added in ``out_dtype``; Inductor fuses it): the layer on a quantized input."""
        y = self.gemm(x8, x_scale, out_dtype, small_m=small_m)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def quantize_input(self, x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x2d [M, K] -> (x8 [M, K] float8_e4m3fn, scale [M, 1] or 0-dim float32) at this layer's granularity."""
        if self.granularity == "rowwise" and not self.emulate and x2d.dtype != torch.bfloat16:
            raise TypeError(f"{self.layer_name or 'ScaledMMLinear'}: row-wise torch._scaled_mm takes bf16 activations "
                            f"(its kernel writes bf16 only), got {x2d.dtype}")
        return quantize_rowwise(x2d) if self.granularity == "rowwise" else quantize_tensorwise(x2d)

    def gemm(self, x8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype, *,
             small_m: bool = True) -> torch.Tensor:
        """The fp8 GEMM alone, on an already quantized input, without the bias.

        x8: [M, K] float8_e4m3fn, x_scale: [M, 1] (row-wise) or 0-dim (tensor-wise) float32.
        Returns [M, N] ``out_dtype``. For callers that quantize the input themselves (a fused kernel)
        or add the bias elsewhere. ``small_m``: few-row GEMMs at the tuned shapes may take
        :mod:`.small_m_gemm`'s Triton kernel (:func:`.small_m_gemm.small_m_config`); False keeps cuBLASLt.
        """
        if self.emulate:
            return reference_scaled_mm(x8, x_scale, self.weight, self.weight_scale, out_dtype)
        config = small_m_config(x8, self.weight, x_scale, out_dtype, self.fast_accum) if small_m else None
        if config is not None:  # few rows (the text stream): a Triton kernel beats cuBLASLt's pick
            return fp8_gemm_small_m(x8, x_scale, self.weight, self.weight_scale, config)
        if self.gemm_kernel == "cublaslt":  # workspace-free, per-shape timed algorithm (no memset per call)
            if out_dtype != torch.bfloat16:
                raise TypeError(f"{self.layer_name or 'ScaledMMLinear'}: gemm_kernel='cublaslt' writes bf16 only, "
                                f"got out_dtype={out_dtype}")
            return cublaslt_rowwise_mm(x8, x_scale, self.weight, self.weight_scale, self.fast_accum)
        return scaled_mm(x8, x_scale, self.weight, self.weight_scale, out_dtype, self.fast_accum)

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", granularity={self.granularity}" + (", emulate=True" if self.emulate else "")
                + (f", gemm_kernel={self.gemm_kernel}" if self.gemm_kernel != "torch" else ""))


class WeightOnlyLinear(Fp8Linear):
    """fp8 weight storage with per-channel scales; compute in the input dtype.

    Each call dequantizes the weight (float32 multiply, cast to the input
    dtype) and runs ``F.linear``: saves memory, not time. Any device, any shape.
    """

    @classmethod
    def from_linear(cls, linear: nn.Linear, layer_name: str = "") -> WeightOnlyLinear:
        """Quantize ``linear.weight`` per output channel."""
        w8, ws = quantize_rowwise(linear.weight.detach())
        return cls(w8, ws, linear.bias, layer_name)

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x2d.dtype)
        return F.linear(x2d, self.dequantize_weight(x2d.dtype), bias)
