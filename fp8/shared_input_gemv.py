"""Many fp8 linears that take the same few input rows, in one Triton launch (CUDA).

In a DiT, every block's timestep-modulation linear (Qwen-Image: ``img_mod.1`` / ``txt_mod.1``, 3072 ->
18432, 60 blocks each) is applied to the same ``silu(timestep embedding)``: one row per timestep, so
M = 1 (2 for Qwen-Image-Edit-2511's zero_cond_t). Each such call is a matrix-vector product that reads
the whole weight: 120 calls read 6.8 GB of e4m3 per forward. One ``torch._scaled_mm`` call per layer
moves it at about 2.3 TB/s on an H200 (3.0 ms per forward, docs/decisions/0010-modulation-launches.md), because each
launch is too short to reach full bandwidth. :class:`SharedInputLinears` runs a whole group in one
launch, over a table of the layers' weight, scale and bias addresses: 1.51 ms at one row, 1.60 ms at two
(4.5 / 4.2 TB/s, H200), with the hint to Triton that those addresses are 16-byte aligned.

Numerics: those of the layers it replaces, up to float32 summation order:

* :class:`~.linear.ScaledMMLinear` (row-wise): the input is quantized row-wise by the layer's own
  :meth:`~.linear.ScaledMMLinear.quantize_input`; ``y = (x8 . w8) * x_scale * w_scale + bias``;
* :class:`~.linear.WeightOnlyLinear`: ``y = (x . w8) * w_scale + bias`` with the bf16 input as is
  (the layer rounds the dequantized weight to bf16 first; this does not).

Products and sums in float32, bias added in float32, one rounding to bf16 at the end (the layers round
the GEMM output to bf16 before adding the bias).

Limits: CUDA, bf16 input of at most :data:`MAX_ROWS` rows, e4m3 weights with per-output-channel scales,
bf16 biases (all layers or none), equal (N, K) in a group, K divisible by :data:`BLOCK_K`. Callers check
:func:`shared_input_capability`. The weights are read through raw addresses, so a group re-reads them (and
rebuilds its table) whenever a layer's weight, scale or bias storage changed. An address that is not a multiple of
16 bytes (a view at an odd offset) runs without the alignment hint: correct, and about half the speed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from .attention.triton_fp8 import interpreter_active
from .capability import Capability
from .linear import Fp8Linear, ScaledMMLinear, WeightOnlyLinear
from .quant import FP8_DTYPE

__all__ = ["BLOCK_K", "FMA_CONFIG", "MAX_ROWS", "ONE_ROW_CONFIG", "SharedInputLinears",
           "default_config", "reference_shared_input", "shared_input_capability"]

logger = logging.getLogger(__name__)

MAX_ROWS = 4
"""Input rows one launch takes (the tensor-core kernel pads them to 16)."""

BLOCK_K = 256
"""K must be a multiple of this (the kernels step through K 128 or 256 at a time, unmasked)."""
DOT_CONFIG = (64, 128, 4, 4)
"""(BN, BK, num_warps, num_stages) of the tensor-core kernel, the choice for two to four rows: 1.60 ms for the 120
modulation linears at two rows (4.24 TB/s; 3.57 ms before the alignment hint), H200
(docs/decisions/0010-modulation-launches.md)."""
ONE_ROW_CONFIG = (4, 1024, 2, 2, "rowsum")
"""For one input row: the kernel without tensor cores that reduces each K step into a (BN,) accumulator, 4 weight
rows x 1024 columns per step, 2 warps, 2 stages: 1.51 ms (4.51 TB/s) for the 120 modulation linears (2.75 ms before
the alignment hint), against 1.61 ms for :data:`FMA_CONFIG` and 1.53 ms for a persistent kernel over the weights
stacked in one buffer (H200, docs/decisions/0010-modulation-launches.md). Needs K % 1024 == 0; other K
take :data:`FMA_CONFIG`."""
FMA_CONFIG = (16, 256, 4, 1, "fma")
"""The kernel without tensor cores with (BN, BK) float32 partials: 1.61 ms (4.21 TB/s) for one row with the alignment
hint (H200); the one-row choice where K is not a multiple of 1024."""


def default_config(rows: int, in_features: int) -> tuple:
    """The launch configuration :class:`SharedInputLinears` uses for ``rows`` input rows of ``in_features``."""
    if rows > 1:
        return DOT_CONFIG
    return ONE_ROW_CONFIG if in_features % ONE_ROW_CONFIG[1] == 0 else FMA_CONFIG


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build; shared_input_capability reports it
    triton = None


def _kind(layer: torch.nn.Module) -> str | None:
    if isinstance(layer, ScaledMMLinear):
        return "scaled_mm" if layer.granularity == "rowwise" and not layer.emulate else None
    if isinstance(layer, WeightOnlyLinear):
        return "weight_only"
    return None


def shared_input_capability(layers: Sequence[torch.nn.Module]) -> Capability:
    """Whether ``layers`` can run as one :class:`SharedInputLinears` launch."""
    if triton is None:
        return Capability.no("Triton is not installed")
    if not layers:
        return Capability.no("no layers")
    kinds = {_kind(layer) for layer in layers}
    if None in kinds or len(kinds) != 1:
        return Capability.no("the layers must all be row-wise ScaledMMLinear (not emulated) or all WeightOnlyLinear")
    first = layers[0]
    if any(layer.weight.shape != first.weight.shape for layer in layers):
        return Capability.no("the layers' weights differ in shape")
    if first.in_features % BLOCK_K:
        return Capability.no(f"in_features={first.in_features} is not divisible by {BLOCK_K}")
    if any(layer.weight.dtype != FP8_DTYPE or tuple(layer.weight_scale.shape) != (layer.out_features, 1)
           for layer in layers):  # fmt: skip
        return Capability.no("every weight must be e4m3 with one float32 scale per output channel")
    with_bias = {layer.bias is not None for layer in layers}
    if len(with_bias) != 1 or (True in with_bias and any(layer.bias.dtype != torch.bfloat16 for layer in layers)):
        return Capability.no("the layers must all have bf16 biases, or none")
    device = first.weight.device
    if device.type != "cuda" and not interpreter_active():
        return Capability.no(f"the kernel needs CUDA tensors (the weights are on {device})")
    if any(layer.weight.device != device for layer in layers):
        return Capability.no("the layers are on different devices")
    return Capability.yes(f"{len(layers)} layers in one shared-input Triton launch")


def reference_shared_input(layers: Sequence[Fp8Linear], x: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in torch ops (any device): (L, R, N) bf16 for x (R, K) bf16."""
    outs = []
    for layer in layers:
        if isinstance(layer, ScaledMMLinear):
            x8, xs = layer.quantize_input(x)
            y = (x8.float() @ layer.weight.float().t()) * xs.float().reshape(-1, 1)
        else:
            y = x.float() @ layer.weight.float().t()
        y = y * layer.weight_scale.float().reshape(1, -1)
        if layer.bias is not None:
            y = y + layer.bias.float()
        outs.append(y.to(torch.bfloat16))
    return torch.stack(outs)


if triton is not None:

    @triton.jit
    def _shared_input_gemv_kernel(x_ptr, x_scale_ptr, w_table, s_table, b_table, out_ptr, n, ROWS: tl.constexpr,  # noqa: N803
                                  K: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,  # noqa: N803
                                  QUANTIZED_X: tl.constexpr, HAS_BIAS: tl.constexpr,  # noqa: N803
                                  INTERPRET: tl.constexpr, ALIGNED: tl.constexpr):  # noqa: N803
        """out[layer, :, n0:n0 + BN] for program (n-tile, layer): the input rows (padded to BR with zeros) times
        a (BN, K) slice of that layer's weight, as a tensor-core dot so Triton pipelines the weight loads.
        ``ALIGNED``: every table address is a multiple of 16 bytes (``tl.multiple_of`` on the loaded pointers).
        Triton cannot know the alignment of an address read from memory: without the hint it loads the e4m3
        weights a byte at a time and does not pipeline them (2.47 TB/s for the modulation weights on an H200,
        4.5 TB/s with it)."""
        layer = tl.program_id(1)
        w_ptr = tl.load(w_table + layer).to(tl.pointer_type(tl.float8e4nv))
        s_ptr = tl.load(s_table + layer).to(tl.pointer_type(tl.float32))
        if ALIGNED:
            w_ptr = tl.multiple_of(w_ptr, 16)
            s_ptr = tl.multiple_of(s_ptr, 16)
        offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
        offs_r = tl.arange(0, BR)
        offs_k = tl.arange(0, BK)
        n_ok = offs_n < n
        r_ok = offs_r < ROWS
        acc = tl.zeros((BR, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            x = tl.load(x_ptr + offs_r[:, None] * K + (k0 + offs_k)[None, :], mask=r_ok[:, None], other=0.0)
            w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * K + (k0 + offs_k)[:, None], mask=n_ok[None, :],
                        other=0.0)  # fmt: skip
            if INTERPRET:  # the CPU interpreter multiplies bf16 as raw bits: float32 products, exact here
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            elif QUANTIZED_X:
                acc = tl.dot(x, w, acc)
            else:
                acc = tl.dot(x, w.to(tl.bfloat16), acc)  # exact: every e4m3 value is a bf16 value
        if QUANTIZED_X:
            acc = acc * tl.load(x_scale_ptr + offs_r, mask=r_ok, other=0.0)[:, None]
        acc = acc * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            b_ptr = tl.load(b_table + layer).to(tl.pointer_type(tl.bfloat16))
            if ALIGNED:
                b_ptr = tl.multiple_of(b_ptr, 16)
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + layer.to(tl.int64) * ROWS * n + offs_r[:, None] * n + offs_n[None, :]
        tl.store(out, acc.to(tl.bfloat16), mask=r_ok[:, None] & n_ok[None, :])


    @triton.jit
    def _shared_input_gemv_fma_kernel(x_ptr, x_scale_ptr, w_table, s_table, b_table, out_ptr, n,
                                      ROWS: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,  # noqa: N803
                                      BK: tl.constexpr, QUANTIZED_X: tl.constexpr,  # noqa: N803
                                      HAS_BIAS: tl.constexpr, ROW_SUM: tl.constexpr,  # noqa: N803
                                      ALIGNED: tl.constexpr):  # noqa: N803
        """The same product without tensor cores, per input row: with ``ROW_SUM`` a (BN,) float32 accumulator
        that each K step's products are reduced into (few registers per program, so more programs and weight
        loads in flight per SM: the one-row default), else (BN, BK) float32 partials summed over K at the end
        (one reduction per row instead of one per K step). ``ALIGNED``: as in :func:`_shared_input_gemv_kernel`."""
        layer = tl.program_id(1)
        w_ptr = tl.load(w_table + layer).to(tl.pointer_type(tl.float8e4nv))
        s_ptr = tl.load(s_table + layer).to(tl.pointer_type(tl.float32))
        if ALIGNED:
            w_ptr = tl.multiple_of(w_ptr, 16)
            s_ptr = tl.multiple_of(s_ptr, 16)
        offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        n_ok = offs_n < n
        if ROW_SUM:
            acc0 = tl.zeros((BN,), dtype=tl.float32)
            acc1 = tl.zeros((BN,), dtype=tl.float32)
        else:
            acc0 = tl.zeros((BN, BK), dtype=tl.float32)
            acc1 = tl.zeros((BN, BK), dtype=tl.float32)
        for k0 in range(0, K, BK):
            w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + (k0 + offs_k)[None, :], mask=n_ok[:, None],
                        other=0.0).to(tl.float32)  # fmt: skip
            p0 = w * tl.load(x_ptr + k0 + offs_k).to(tl.float32)[None, :]
            acc0 += tl.sum(p0, axis=1) if ROW_SUM else p0
            if ROWS > 1:
                p1 = w * tl.load(x_ptr + K + k0 + offs_k).to(tl.float32)[None, :]
                acc1 += tl.sum(p1, axis=1) if ROW_SUM else p1
        scale = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)
        bias = tl.zeros((BN,), dtype=tl.float32)
        if HAS_BIAS:
            b_ptr = tl.load(b_table + layer).to(tl.pointer_type(tl.bfloat16))
            if ALIGNED:
                b_ptr = tl.multiple_of(b_ptr, 16)
            bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        for r in tl.static_range(ROWS):
            y = acc0 if r == 0 else acc1
            if not ROW_SUM:
                y = tl.sum(y, axis=1)
            if QUANTIZED_X:
                y = y * tl.load(x_scale_ptr + r)
            y = y * scale + bias
            tl.store(out_ptr + (layer.to(tl.int64) * ROWS + r) * n + offs_n, y.to(tl.bfloat16), mask=n_ok)


class SharedInputLinears:
    """A group of fp8 linears (same shape and kind) applied to one input in one kernel launch.

    ``SharedInputLinears(layers)(x)`` with x (R, K) bf16, R <= :data:`MAX_ROWS`, returns (L, R, N) bf16:
    ``out[i]`` is ``layers[i](x)`` (numerics: module docstring). Raises ValueError with the reason where
    the kernel cannot run (:func:`shared_input_capability`). Holds the layers' tensors while it lives.
    """

    def __init__(self, layers: Sequence[Fp8Linear]):
        capability = shared_input_capability(layers)
        if not capability.ok:
            raise ValueError(f"shared-input fp8 linears: {capability.reason}")
        self.layers = tuple(layers)
        self.quantized_input = _kind(self.layers[0]) == "scaled_mm"
        self.out_features, self.in_features = self.layers[0].weight.shape
        self.config: tuple | None = None
        """None: :func:`default_config`; or (BN, BK, num_warps, num_stages[, "fma" | "rowsum"])
        (docs/decisions/0010-modulation-launches.md)."""
        self._tables()

    def _tensors(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        return tuple((layer.weight, layer.weight_scale, layer.bias) for layer in self.layers)

    def _addresses(self) -> tuple[int, ...]:
        return tuple(0 if t is None else t.data_ptr() for group in self._tensors() for t in group)

    def _tables(self) -> None:
        """(Re)build the address tables (after a layer's storage changed); keeps those tensors alive."""
        tensors = self._tensors()
        device = self.layers[0].weight.device
        self._held = tensors
        self._signature = self._addresses()
        table = [[0 if t is None else t.data_ptr() for t in column] for column in zip(*tensors, strict=True)]
        self._w_table, self._s_table, self._b_table = (torch.tensor(c, dtype=torch.int64, device=device) for c in table)
        self.aligned = all(address % 16 == 0 for column in table for address in column)
        """Every weight, scale and bias address a multiple of 16 bytes: the kernels get that as a hint (vector
        loads); False (a view at an odd offset) runs them without it, correct and slower."""
        if not self.aligned:
            logger.info("shared-input fp8 linears: a weight, scale or bias address is not 16-byte aligned; the "
                        "kernel reads them with narrow loads (slower)")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, k = x.shape
        if x.dtype != torch.bfloat16 or k != self.in_features or not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"shared-input fp8 linears take (R <= {MAX_ROWS}, {self.in_features}) bf16 input, got "
                             f"{x.dtype} {tuple(x.shape)}")
        if self._addresses() != self._signature:
            logger.debug("shared-input fp8 linears: a layer's storage changed; rebuilding the address table")
            capability = shared_input_capability(self.layers)
            if not capability.ok:  # a layer moved off the GPU or was replaced by another kind
                raise ValueError(f"shared-input fp8 linears: a layer changed and the group cannot run: "
                                 f"{capability.reason}")
            self._tables()
        x = x.contiguous()
        if self.quantized_input:
            x_in, x_scale = self.layers[0].quantize_input(x)
            x_scale = x_scale.reshape(-1).float().expand(rows).contiguous()
        else:
            x_in, x_scale = x, x  # the scale pointer is unused
        n = self.out_features
        out = torch.empty((len(self.layers), rows, n), dtype=torch.bfloat16, device=x.device)
        config = self.config or default_config(rows, k)
        block_n, block_k, warps, stages = config[:4]
        if k % block_k:
            raise ValueError(f"shared-input fp8 linears: config {config} steps through K {block_k} at a time, "
                             f"which does not divide in_features={k}")
        tables = (self._w_table, self._s_table, self._b_table)
        has_bias = self.layers[0].bias is not None
        grid = (triton.cdiv(n, block_n), len(self.layers))
        if len(config) > 4 and rows <= 2:
            _shared_input_gemv_fma_kernel[grid](
                x_in, x_scale, *tables, out, n, ROWS=rows, K=k, BN=block_n, BK=block_k,
                QUANTIZED_X=self.quantized_input, HAS_BIAS=has_bias, ROW_SUM=config[4] != "fma", ALIGNED=self.aligned,
                num_warps=warps, num_stages=stages,
            )  # fmt: skip
            return out
        _shared_input_gemv_kernel[grid](
            x_in, x_scale, *tables, out, n, ROWS=rows, K=k, BR=16, BN=block_n, BK=block_k,
            QUANTIZED_X=self.quantized_input, HAS_BIAS=has_bias, INTERPRET=interpreter_active(), ALIGNED=self.aligned,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return out
