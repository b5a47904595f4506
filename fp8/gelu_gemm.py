"""MLP up-projection, bias, GELU and the hidden state's e4m3 cast in one row-wise fp8 GEMM (Triton, Hopper).

The shipped alternative is two kernels: cuBLASLt writes the up-projection's (M, 4D) bf16 output (201 MB at
M = 8192, 4D = 12288) and :mod:`.gelu_quant` reads it back for bias + GELU + the row-wise e4m3 cast, because a
row's amax spans every column tile of the GEMM. Here the row scale is known before the GEMM, from a bound:

* by Cauchy-Schwarz, ``|y[t, j]| <= ||x[t]|| * ||W[j]|| + |b[j]|`` for ``y = x W^T + b`` (x, W dequantized);
* ``|GELU(y)| <= |y|`` for both GELU forms (:data:`.gelu_quant.GELUS`: ``y * sigmoid(1.702 y)`` and the tanh
  approximation ``y * sigmoid(2 sqrt(2 / pi) (y + 0.044715 y^3))``; a sigmoid is in (0, 1));
* so ``bound[t] = (||x[t]|| * max_j ||W[j]|| + max_j |b[j]|) * BOUND_MARGIN`` never lets the cast saturate.

``||x[t]||`` comes from the LayerNorm kernel that quantized x (:mod:`.norm_quant`, ``with_norms``): an upper bound
of the e4m3 row's norm, at most 6.25% above it (an upper bound, not the exact norm of the codes); ``max_j ||W[j]||``
and ``max_j |b[j]|`` from :func:`column_bound`, kept with the layer (``ScaledMMLinear.column_bound``). e4m3 is a
float format: a scale that is loose by a factor f only moves the codes down by log2(f) binades. On Gaussian data the
bound is about 15x the row's true max (4 binades of e4m3's 15), and the hidden state's error against float64 was
2.66e-2, as the amax-scaled path's 2.67e-2
(docs/decisions/0009-gemm-epilogue-fusions.md).

The kernel: persistent, TMA loads of x and W (128 x 256 x 128 tiles, 3 stages, 8 warps), fp32 accumulation of the
e4m3 products without promotion (as cuBLASLt's fast accumulation; only ``fast_accum`` layers take this path),
then per tile ``acc * x_scale[t] * w_scale[j] + b[j]`` in float32, GELU as ``y * (0.5 + 0.5 tanh(0.851 y))``, or
for the tanh form ``y * (0.5 + 0.5 tanh(0.79788 (y + 0.044715 y^3)))``
(``tanh.approx.f32``: one MUFU op per element instead of ex2 + reciprocal; the identity is exact, the
approximation's relative error is about 2^-11, far below e4m3's 2^-4 rounding), times ``448 / bound[t]``, clamp,
round to nearest even e4m3, TMA store. Tiles of the first column block also write ``bound[t] / 448``, the row
scale the down-projection takes.

Both streams take it: the image stream's 8192 rows in :data:`CONFIG`'s tiles, the text stream's few hundred in
:data:`SMALL_M_CONFIG`'s (:func:`config_for_rows`). At 32 to 600 rows it beats the small-M GEMM + :mod:`.gelu_quant`
pair it replaced there at every size measured (H200, docs/decisions/0009-gemm-epilogue-fusions.md: 34.2 ->
24.2 us at 300 rows, 48.3 -> 40.4 us at 600).

Limits: CUDA compute capability 9.0, Triton with TMA descriptors, e4m3 x (M, K) with contiguous rows and w (N, K)
contiguous, K and N multiples of 16 (TMA's 16-byte strides). Callers check :func:`gelu_gemm_capability`. Registered
as the custom op ``qwen_edit_hopper::gelu_gemm_rowwise`` (``torch.library.custom_op``: one opaque call in compiled
blocks, as the pack's other TMA kernels).
"""

from __future__ import annotations

import logging

import torch

from .capability import Capability
from .gelu_quant import GELUS, SIGMOID, TANH, reference_gelu
from .quant import E4M3_MAX, FP8_DTYPE

__all__ = ["BOUND_MARGIN", "CONFIG", "OP_NAME", "SMALL_M_CONFIG", "column_bound", "config_for_rows",
           "gelu_gemm_capability", "gelu_gemm_rowwise", "reference_gelu_gemm"]

logger = logging.getLogger(__name__)

OP_NAME = "qwen_edit_hopper::gelu_gemm_rowwise"

CONFIG = (128, 256, 128, 8, 3, 16)
"""(BM, BN, BK, warps, stages, GROUP_M): the fastest of 12 on an H200 at 8192 x 3072 -> 12288: 441 us, against
492 us for cuBLASLt + :mod:`.gelu_quant` (docs/decisions/0009-gemm-epilogue-fusions.md)."""

SMALL_M_CONFIG = (64, 256, 128, 4, 4, 8)
"""The tiles for at most :data:`SMALL_M_MAX_ROWS` rows (the text stream): at 300 rows 24.2 us against 38.5 us in
:data:`CONFIG`'s (H200, 300 x 3072 -> 12288, docs/decisions/0009-gemm-epilogue-fusions.md)."""

SMALL_M_MAX_ROWS = 512
"""Most rows that take :data:`SMALL_M_CONFIG`. Measured at 32, 64, 128, 200, 300, 384, 450, 512 and 600 rows:
it was the faster of the two at every size but 200 (23.3 against 20.8 us) and 600 (47.0 against 40.4 us)."""


def config_for_rows(m: int) -> tuple[int, int, int, int, int, int]:
    """The kernel's (BM, BN, BK, warps, stages, GROUP_M) for an M-row input."""
    return SMALL_M_CONFIG if m <= SMALL_M_MAX_ROWS else CONFIG

BOUND_MARGIN = 1.02
"""Covers the float32 roundings of the bound and of the accumulation; the bound itself is exact math."""

_TINY = 1e-30
"""Floor of a row's bound: an all-zero row with no bias gets a finite scale (its codes are 0)."""

try:  # Triton ships with CUDA builds of torch; without it the MLP keeps cuBLASLt + gelu_quant (callers say why)
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError as exc:  # pragma: no cover - depends on the torch build
    triton = None
    _TRITON_MISSING = f"Triton with TMA descriptors is not importable ({exc})"
else:
    _TRITON_MISSING = None


@torch.no_grad()
def column_bound(w8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(2,) float32 on w8's device: [max_j ||W[j]||_2 of the dequantized rows, max_j |b[j]| (0 without a bias)].

    w8: (N, K) float8_e4m3fn; w_scale: (N, 1) or (N,) float32 row scales; bias: (N,) or None. One pass over the
    weight (37.7 MB for the MLP up-projection): computed when a layer is made or its weight is rewritten.
    """
    norms = w8.float().pow(2).sum(1).sqrt() * w_scale.reshape(-1).float()
    b_max = bias.detach().float().abs().amax() if bias is not None else torch.zeros((), device=w8.device)
    return torch.stack((norms.amax(), b_max.to(norms.device))).float()


def row_bound_scale(x_norm: torch.Tensor, col_bound: torch.Tensor) -> torch.Tensor:
    """(M, 1) float32: ``bound[t] / 448``, the hidden state's row scale (x_norm: (M, 1) or (M,) float32)."""
    bound = (x_norm.reshape(-1, 1).float() * col_bound[0] + col_bound[1]) * BOUND_MARGIN
    return bound.clamp_min(_TINY) / E4M3_MAX


def reference_gelu_gemm(x8: torch.Tensor, x_scale: torch.Tensor, x_norm: torch.Tensor, w8: torch.Tensor,
                        w_scale: torch.Tensor, bias: torch.Tensor | None, col_bound: torch.Tensor,
                        gelu: str = SIGMOID) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, in float32 torch ops (any device; GELU in the form ``gelu`` through torch's own
    functions, :func:`.gelu_quant.reference_gelu`).

    Returns (h8 (M, N) float8_e4m3fn, h_scale (M, 1) float32): ``h8 * h_scale`` is GELU(x W^T + b).
    """
    y = (x8.float() * x_scale.reshape(-1, 1).float()) @ (w8.float() * w_scale.reshape(-1, 1).float()).t()
    if bias is not None:
        y = y + bias.float()
    h = reference_gelu(y, gelu)
    h_scale = row_bound_scale(x_norm, col_bound)
    return (h / h_scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE), h_scale


def gelu_gemm_capability(x8: torch.Tensor, w8: torch.Tensor, fast_accum: bool) -> Capability:
    """Whether :func:`gelu_gemm_rowwise` can run for these operands."""
    if _TRITON_MISSING is not None:
        return Capability.no(_TRITON_MISSING)
    if not fast_accum:
        return Capability.no("the layer does not use fast accumulation (the kernel accumulates e4m3 products "
                             "without promotion)")
    if not x8.is_cuda or tuple(torch.cuda.get_device_capability(x8.device)) != (9, 0):
        return Capability.no("the fused GELU GEMM is written for Hopper (CUDA compute capability 9.0)")
    if x8.dtype != FP8_DTYPE or w8.dtype != FP8_DTYPE or x8.dim() != 2 or w8.dim() != 2:
        return Capability.no(f"operands must be 2-D {FP8_DTYPE}, got {x8.dtype} {tuple(x8.shape)} and {w8.dtype} "
                             f"{tuple(w8.shape)}")
    m, k = x8.shape
    n = w8.shape[0]
    if k % 16 or n % 16 or w8.shape[1] != k:
        return Capability.no(f"shapes ({m}, {k}) x ({n}, {w8.shape[1]}): K and N must be equal multiples of 16")
    if x8.stride(1) != 1 or x8.stride(0) % 16 or not w8.is_contiguous():
        return Capability.no("x8 needs contiguous rows (16-byte aligned stride) and w8 must be contiguous")
    return Capability.yes("Triton GEMM with TMA on Hopper")


if triton is not None:

    @triton.jit
    def _tile_ids(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):  # noqa: N803
        group = GROUP_M * num_pid_n
        first_m = (tile_id // group) * GROUP_M
        size_m = min(num_pid_m - first_m, GROUP_M)
        return first_m + (tile_id % size_m), (tile_id % group) // size_m

    @triton.jit
    def _tile_acc(a_desc, b_desc, om, on, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # noqa: N803
        """float32 (BM, BN) sum over K of the e4m3 products of A rows om.. and B rows on.. (TMA loads; wgmma
        accumulates without promotion)."""
        acc = tl.zeros((BM, BN), tl.float32)
        for ki in range(tl.cdiv(K, BK)):
            a = a_desc.load([om, ki * BK])
            b = b_desc.load([on, ki * BK])
            acc = tl.dot(a, b.T, acc)
        return acc

    @triton.jit
    def _scaled_tile(a_desc, b_desc, xs_ptr, ws_ptr, bias_ptr, tile_id, M, N, K, HAS_BIAS: tl.constexpr,  # noqa: N803
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):  # noqa: N803
        """Output tile ``tile_id`` (grouped by GROUP_M row tiles) as float32 ``acc * x_scale * w_scale (+ bias)``:
        returns (y (BM, BN), rows (BM,), rows < M, first row, first column, column-tile index)."""
        pid_m, pid_n = _tile_ids(tile_id, tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
        om = pid_m * BM
        on = pid_n * BN
        acc = _tile_acc(a_desc, b_desc, om, on, K, BM, BN, BK)
        rows = om + tl.arange(0, BM)
        cols = on + tl.arange(0, BN)
        row_ok = rows < M
        col_ok = cols < N
        y = acc * tl.load(xs_ptr + rows, mask=row_ok, other=0.0)[:, None] \
            * tl.load(ws_ptr + cols, mask=col_ok, other=0.0)[None, :]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        return y, rows, row_ok, om, on, pid_n

    @triton.jit
    def _gelu_gemm_kernel(a_desc, b_desc, c_desc, xs_ptr, xn_ptr, ws_ptr, bias_ptr, cb_ptr, hs_ptr, M, N, K,  # noqa: N803
                          margin, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,  # noqa: N803
                          BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,  # noqa: N803
                          TANH: tl.constexpr):  # noqa: N803
        """One persistent program per SM over (BM, BN) output tiles, grouped by GROUP_M row tiles."""
        start = tl.program_id(0)
        w_norm = tl.load(cb_ptr)
        b_max = tl.load(cb_ptr + 1)
        for tile_id in tl.range(start, tl.cdiv(M, BM) * tl.cdiv(N, BN), NUM_SMS, flatten=True):
            y, rows, row_ok, om, on, pid_n = _scaled_tile(a_desc, b_desc, xs_ptr, ws_ptr, bias_ptr, tile_id, M, N, K,
                                                          HAS_BIAS, BM, BN, BK, GROUP_M)
            if TANH:  # noqa: SIM108 (a constexpr branch: Triton compiles one side)
                inner = y * (0.7978845608028654 + 0.035677408136300125 * y * y)
            else:
                inner = 0.851 * y
            th = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [inner], dtype=tl.float32,
                                           is_pure=True, pack=1)
            h = y * (0.5 + 0.5 * th)
            bound = tl.maximum((tl.load(xn_ptr + rows, mask=row_ok, other=0.0) * w_norm + b_max) * margin, 1e-30)
            code = tl.clamp(h * (448.0 / bound)[:, None], -448.0, 448.0)
            c_desc.store([om, on], code.to(tl.float8e4nv))
            # the first column block's tiles write the row scales (a mask, not a branch: the flattened loop
            # takes no branches)
            tl.store(hs_ptr + rows, bound / 448.0, mask=row_ok & (pid_n == 0))

    @torch.library.custom_op(OP_NAME, mutates_args=())
    def _gelu_gemm_op(x8: torch.Tensor, x_scale: torch.Tensor, x_norm: torch.Tensor, w8: torch.Tensor,
                      w_scale: torch.Tensor, bias: torch.Tensor | None, col_bound: torch.Tensor, tanh: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        m, k = x8.shape
        n = w8.shape[0]
        bm, bn, bk, warps, stages, group_m = config_for_rows(m)
        out = torch.empty((m, n), dtype=FP8_DTYPE, device=x8.device)
        h_scale = torch.empty((m, 1), dtype=torch.float32, device=x8.device)
        num_sms = torch.cuda.get_device_properties(x8.device).multi_processor_count
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        _gelu_gemm_kernel[(min(num_sms, tiles),)](
            TensorDescriptor.from_tensor(x8, [bm, bk]), TensorDescriptor.from_tensor(w8, [bn, bk]),
            TensorDescriptor.from_tensor(out, [bm, bn]), x_scale, x_norm, w_scale,
            bias if bias is not None else w_scale, col_bound, h_scale, m, n, k, BOUND_MARGIN,
            HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk, GROUP_M=group_m, NUM_SMS=num_sms, TANH=tanh,
            num_warps=warps, num_stages=stages)
        return out, h_scale

    @_gelu_gemm_op.register_fake
    def _(x8, x_scale, x_norm, w8, w_scale, bias, col_bound, tanh=False):
        m, n = x8.shape[0], w8.shape[0]
        return (torch.empty((m, n), dtype=FP8_DTYPE, device=x8.device),
                torch.empty((m, 1), dtype=torch.float32, device=x8.device))


def gelu_gemm_rowwise(x8: torch.Tensor, x_scale: torch.Tensor, x_norm: torch.Tensor, w8: torch.Tensor,
                      w_scale: torch.Tensor, bias: torch.Tensor | None, col_bound: torch.Tensor,
                      gelu: str = SIGMOID) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize(GELU(x W^T + b))`` with the bound's row scale, in one kernel (module docstring).

    x8: (M, K) float8_e4m3fn; x_scale: (M, 1) float32 row scales; x_norm: (M, 1) float32, ``||x8[t] * x_scale[t]||``
    (or any upper bound of it); w8: (N, K) float8_e4m3fn; w_scale: (N, 1) float32; bias: (N,) or None;
    col_bound: :func:`column_bound` of (w8, w_scale, bias); gelu: the GELU form (:data:`.gelu_quant.GELUS`).
    Returns (h8 (M, N) float8_e4m3fn, h_scale (M, 1) float32), the down-projection's row-wise input. Raises
    ValueError naming the reason where the kernel cannot run (:func:`gelu_gemm_capability`).
    """
    if gelu not in GELUS:
        raise ValueError(f"gelu_gemm_rowwise: gelu {gelu!r} is not one of {', '.join(GELUS)}")
    capability = gelu_gemm_capability(x8, w8, True)
    if not capability.ok:
        raise ValueError(f"gelu_gemm_rowwise: {capability.reason}")
    m, n = x8.shape[0], w8.shape[0]
    if x_scale.numel() != m or x_norm.numel() != m or w_scale.numel() != n or col_bound.numel() != 2:
        raise ValueError(f"gelu_gemm_rowwise: x_scale and x_norm need {m} values, w_scale {n}, col_bound 2; got "
                         f"{x_scale.numel()}, {x_norm.numel()}, {w_scale.numel()}, {col_bound.numel()}")
    return _gelu_gemm_op(x8, x_scale.reshape(m).float().contiguous(), x_norm.reshape(m).float().contiguous(), w8,
                         w_scale.reshape(n).float().contiguous(),
                         bias.contiguous() if bias is not None else None, col_bound.float().contiguous(),
                         gelu == TANH)
