"""Row-wise fp8 GEMM for few tokens (the text stream at batch 1), where cuBLASLt's choice is slow (Triton, CUDA).

Qwen-Image's text stream runs its linears on M = text tokens (about 300 for an edit prompt with one
reference image). For these shapes ``torch._scaled_mm`` (cuBLASLt) picks kernels that reach 500-780
TFLOP/s on an H200, against about 1300 for the image stream; its MLP up-projection (3072 -> 12288) took
45.1 us per call. A plain Triton GEMM with 64-row tiles, ordered so that the few row tiles sharing a
weight tile run together, took 26.5 us (docs/decisions/0011-small-m-text-gemms.md, weights streamed from HBM):

=====================  ==================  =====================  ================
shape (K -> N), M=300  cuBLASLt (us)       this kernel (us)       config
=====================  ==================  =====================  ================
3072 -> 9216 (QKV)     21.7                18.1                   64 x 128, 4 warps, 3 stages
3072 -> 3072 (out)     11.4                9.8 (not used)         64 x 128, 4 warps, 4 stages
3072 -> 12288 (MLP up) 45.1                26.5                   64 x 256, 4 warps, 4 stages
12288 -> 3072 (down)   32.5                31.8 (not used)        -
=====================  ==================  =====================  ================

At M = 600 (true CFG batched) cuBLASLt was as fast or faster for every shape, so :func:`small_m_config`
answers only for 16 < M <= :data:`MAX_ROWS` and the QKV and MLP up-projection shapes; everything else keeps
``torch._scaled_mm``. The output projection (3072 -> 3072) stays with cuBLASLt: alone this kernel took 9.8 us
against 11.4, but in the compiled block, right after the attention kernel, 41 us against 15 (H200 timelines;
forward 179.36 -> 178.61 ms with cuBLASLt). Splitting the down-projection's K in two took 32.3 us against
cuBLASLt's 32.5: not kept. Callers that want cuBLASLt for every shape skip :func:`small_m_config`
(``ScaledMMLinear.gemm(..., small_m=False)``; the fast forward's ``ForwardOptions.small_m_gemm``).

Numerics: e4m3 x e4m3 products accumulated in float32 by Hopper's wgmma with Triton's sm_90 default
(no periodic promotion: the same "fast accumulation" as ``use_fast_accum=True``, so only layers built
with ``fast_accum`` take this path), then ``acc * x_scale[m] * w_scale[n]`` in float32 and one rounding to
bf16. Against ``torch._scaled_mm(use_fast_accum=True)`` the relative difference was 1.0-1.8e-5 on an
H200 (one bf16 rounding flip in a few outputs).

Limits: CUDA with compute capability 9.0 (the configs are Hopper's); x8 [M, K] float8_e4m3fn with
contiguous rows, x_scale [M, 1] float32 (any strides), w8 [N, K] float8_e4m3fn contiguous, w_scale
[N, 1] float32; bf16 output. Registered as ``qwen_edit_hopper::fp8_gemm_small_m`` through
``torch.library.triton_op``, so ``torch.compile`` keeps it in the graph.
"""

from __future__ import annotations

import logging

import torch

from .quant import FP8_DTYPE

__all__ = ["CONFIGS", "MAX_ROWS", "MIN_ROWS", "OP_NAME", "config_for_shape", "fp8_gemm_small_m", "small_m_config"]

logger = logging.getLogger(__name__)

OP_NAME = "qwen_edit_hopper::fp8_gemm_small_m"

MAX_ROWS = 384
"""Largest M this path takes. Measured faster than cuBLASLt at M = 300 and slower at M = 600 (H200). Under
torch.compile with a dynamic text length the range check is a guard: lengths inside it share one graph
(tests/gpu/test_fp8_backends.py), a length outside it compiles once more."""

MIN_ROWS = 17
"""Smallest M: GEMVs (the modulation's one timestep row) stay with cuBLASLt."""

CONFIGS: dict[tuple[int, int], tuple[int, ...]] = {
    (3072, 9216): (64, 128, 128, 4, 3),
    (3072, 12288): (64, 256, 128, 4, 4),
}
"""(K, N) -> (BM, BN, BK, warps, stages): the fastest of 72 tile configurations per shape at M = 300 on an
H200."""

try:  # Triton ships with CUDA builds of torch; without it the layers keep torch._scaled_mm.
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError as exc:  # pragma: no cover - depends on the torch build
    triton = None
    _TRITON_MISSING = f"Triton is not importable ({exc})"
else:
    _TRITON_MISSING = None


def config_for_shape(m: int, k: int, n: int, capability: tuple[int, int] | None) -> tuple[int, ...] | None:
    """(BM, BN, BK, warps, stages) for an M x K x N row-wise GEMM on a GPU of ``capability``, or None (cuBLASLt):
    compute capability 9.0, MIN_ROWS <= M <= MAX_ROWS and (K, N) in :data:`CONFIGS`."""
    if capability is None or tuple(capability) != (9, 0) or not MIN_ROWS <= m <= MAX_ROWS:
        return None
    return CONFIGS.get((k, n))


def small_m_config(x8: torch.Tensor, w8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype,
                   fast_accum: bool) -> tuple[int, ...] | None:
    """The tile config when the small-M kernel should run this row-wise GEMM, else None (cuBLASLt).

    Takes it only for: Triton importable, CUDA tensors, fast accumulation, bf16 output, e4m3 operands, row-wise
    input scales ([M, 1] float32), contiguous input rows, a contiguous weight and :func:`config_for_shape`.
    """
    if _TRITON_MISSING is not None or not fast_accum or out_dtype != torch.bfloat16:
        return None
    if not x8.is_cuda or x8.dtype != FP8_DTYPE or w8.dtype != FP8_DTYPE or x8.dim() != 2:
        return None
    m, k = x8.shape
    if x8.stride(-1) != 1 or not w8.is_contiguous():
        return None
    if x_scale.dim() != 2 or tuple(x_scale.shape) != (m, 1) or x_scale.dtype != torch.float32:
        return None
    return config_for_shape(m, k, w8.shape[0], torch.cuda.get_device_capability(x8.device))


if triton is not None:

    @triton.jit
    def _fp8_gemm_small_m_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, out_ptr, M, N, K, stride_xm, stride_xs,  # noqa: N803
                                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # noqa: N803
        """out[m, n] = bf16(xs[m] * ws[n] * sum_k x[m, k] w[n, k]); one program per (BM, BN) tile.

        Row tiles run fastest (program id % row tiles), so the 5 tiles of M = 300 that share a weight tile
        are scheduled together and the weight tile is read from HBM about once. Needs N % BN == 0 and
        K % BK == 0 (the configs' shapes).
        """
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        pid_m = pid % num_m
        pid_n = pid // num_m
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        a_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        b_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
        row_ok = offs_m[:, None] < M
        acc = tl.zeros((BM, BN), tl.float32)
        for _ in range(0, K, BK):
            a = tl.load(a_ptrs, mask=row_ok, other=0.0)
            b = tl.load(b_ptrs)
            acc = tl.dot(a, b, acc)
            a_ptrs += BK
            b_ptrs += BK
        xs = tl.load(xs_ptr + offs_m * stride_xs, mask=offs_m < M, other=0.0)
        ws = tl.load(ws_ptr + offs_n)
        acc = acc * xs[:, None] * ws[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(out_ptrs, acc.to(tl.bfloat16), mask=row_ok)

    @triton_op(OP_NAME, mutates_args={})
    def _fp8_gemm_small_m_op(x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                             bm: int, bn: int, bk: int, warps: int, stages: int) -> torch.Tensor:
        m, k = x8.shape
        n = w8.shape[0]
        out = torch.empty((m, n), dtype=torch.bfloat16, device=x8.device)
        wrap_triton(_fp8_gemm_small_m_kernel)[(triton.cdiv(m, bm) * (n // bn),)](
            x8, w8, x_scale, w_scale, out, m, n, k, x8.stride(0), x_scale.stride(0),
            BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages,
        )
        return out


def fp8_gemm_small_m(x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                     config: tuple[int, ...]) -> torch.Tensor:
    """x8 [M, K] e4m3, x_scale [M, 1] float32, w8 [N, K] e4m3, w_scale [N, 1] float32 -> [M, N] bf16.

    ``config`` from :func:`small_m_config` (which checks every limit): (BM, BN, BK, warps, stages). Raises
    ValueError where a shape does not fit the config's tiles.
    """
    if _TRITON_MISSING is not None:
        raise ValueError(_TRITON_MISSING)
    bm, bn, bk, warps, stages = config
    k, n = x8.shape[1], w8.shape[0]
    if n % bn or k % bk or w8.shape[1] != k:
        raise ValueError(f"fp8_gemm_small_m: weight {tuple(w8.shape)} and input {tuple(x8.shape)} do not fit "
                         f"tiles of {bn} columns x {bk} inner")
    return _fp8_gemm_small_m_op(x8, x_scale, w8, w_scale.reshape(n, 1).contiguous(), bm, bn, bk, warps, stages)
