"""8-bit flash attention forward for Hopper, in Triton (SageAttention-style quantization).

``fp8_attention(q, k, v, config)`` takes q, k, v of shape (B, H, S, D) in bfloat16
(after QK-norm and RoPE, no mask, not causal) and returns the attention output
as (B, S, H*D) bfloat16, the layout the DiT's output projection consumes.

How it works (four launches, all Triton):

1. ``_kv_stats_kernel`` reads K (and V when PV is 8-bit) once and writes
   per-chunk partial sums (and V's per-channel min/max) per head;
   ``_kv_stats_finalize_kernel`` reduces the chunks to per-head rows (deterministic, no atomics).
2. ``_quantize_kernel`` reads Q, K (and V) once: Q gets one scale per token
   (row), K has its mean over all tokens of the head subtracted (softmax is
   unchanged by adding ``q . mean_k`` to every score of a row) and one scale
   per block of 128 tokens; V (8-bit PV only) has its per-channel mean
   subtracted (added back at the end, since each softmax row sums to one) and
   one scale per channel. The outputs are zero-padded to a multiple of 128
   tokens; V is stored transposed (D, S) because 8-bit wgmma needs its B
   operand K-major. ``sm_scale * log2(e)`` is folded into Q's scales.
3. ``_attn_kernel``: flash attention over the quantized tensors. QK^T runs on
   the tensor cores in int8 (int32 accumulate) or e4m3 (fp32 accumulate), the
   online softmax in fp32 with exp2, and PV in one of three formats:

   * ``bf16``: P rounded to bf16, V the original bf16 tensor (read through a
     TMA descriptor, no copy); fp32 accumulate.
   * ``int8``: P scaled so that each row's block maximum maps to 127 and
     rounded to int8, V int8 per channel; a fresh int32 product per block is
     converted (exactly, by the 2^23 magic-number trick) and added to the fp32
     accumulator with the block's rescale factor.
   * ``e4m3``: P scaled by 2^8 (its maximum is at most 256) and cast to
     float8_e4m3fn, V e4m3 per channel; fp32 accumulate.

Why int8 is the default for QK (measured numerically on CPU,
docs/decisions/0003-cudnn-fp8-attention.md): e4m3 keeps 3 mantissa bits, a relative error
of about 2.5% on every element whatever the scale; on Gaussian q/k after
RMSNorm that alone puts 3.7e-2 relative error on the output. Int8 with a
per-token (Q) / per-128-token-block (K) scale has an absolute step of amax/127
and lands near 1.1e-2. For the same reason int8 P/V beat e4m3 P/V.

Hardware: the kernels need a CUDA GPU with compute capability 9.0 (Hopper:
wgmma and TMA through host tensor descriptors). They also run under Triton's
interpreter (``TRITON_INTERPRET=1``, CPU tensors) with ``fast_math=False`` for
tests. Head dim 64 or 128; any sequence length >= 1; batch and heads any.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = [
    "DEFAULT_CONFIG",
    "PV_FORMATS",
    "QK_FORMATS",
    "QUANT_BLOCK",
    "Fp8AttentionConfig",
    "QuantizedQKV",
    "attention_from_quantized",
    "fp8_attention",
    "interpreter_active",
    "quantize_qkv",
    "validate_inputs",
]

logger = logging.getLogger(__name__)

QK_FORMATS = ("int8", "e4m3")
PV_FORMATS = ("bf16", "int8", "e4m3")
HEAD_DIMS = (64, 128)
# Tokens per K scale, and the padding multiple of every quantized buffer.
QUANT_BLOCK = 128
LOG2E = 1.4426950408889634  # 1/ln(2)
_QK_MAX = {"int8": 127.0, "e4m3": 448.0}
_PV_MODE = {"bf16": 0, "e4m3": 1, "int8": 2}
# Floor for amax so that all-zero rows/blocks/channels quantize to exact zeros.
AMAX_FLOOR = tl.constexpr(1e-30)


def interpreter_active() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class Fp8AttentionConfig:
    """Numerics and launch shape of the 8-bit attention kernel.

    qk_format:
        ``int8`` (default; per-token Q scale, per-128-token K scale after
        subtracting K's mean) or ``e4m3`` (same scales, float8_e4m3fn).
    pv_format:
        ``bf16`` (P and V in bf16: most accurate), ``int8`` (block-relative
        int8 P, per-channel int8 V) or ``e4m3`` (P * 2^8 and per-channel V in
        float8_e4m3fn).
    block_m, block_n:
        Query rows per program (64 or 128) and keys per inner step (32, 64 or
        128; must divide 128, the K scale block).
    num_warps, num_stages:
        Triton launch parameters (4 or 8 warps; software pipelining depth).
    fast_math:
        Inline PTX for ``ex2.approx.ftz.f32`` and a magic-number float->int8
        rounding; must be False under Triton's interpreter.
    pipeline_qk:
        Issue the next key block's QK^T before this block's softmax (overlaps tensor-core and
        exp2 work inside a warpgroup; costs one more score tile of registers).
    """

    qk_format: str = "int8"
    pv_format: str = "bf16"
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2
    fast_math: bool = True
    pipeline_qk: bool = False

    def __post_init__(self) -> None:
        if self.qk_format not in QK_FORMATS:
            raise ValueError(f"qk_format={self.qk_format!r} is not allowed; allowed values: {', '.join(QK_FORMATS)}")
        if self.pv_format not in PV_FORMATS:
            raise ValueError(f"pv_format={self.pv_format!r} is not allowed; allowed values: {', '.join(PV_FORMATS)}")
        if self.block_m not in (64, 128):
            raise ValueError(f"block_m={self.block_m} is not allowed; allowed values: 64, 128")
        if self.block_n not in (32, 64, 128):
            raise ValueError(f"block_n={self.block_n} is not allowed; allowed values: 32, 64, 128")
        if self.num_warps not in (4, 8):
            raise ValueError(f"num_warps={self.num_warps} is not allowed; allowed values: 4, 8")
        if not 1 <= self.num_stages <= 6:
            raise ValueError(f"num_stages={self.num_stages} must be between 1 and 6")
        for name in ("fast_math", "pipeline_qk"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def label(self) -> str:
        """Short name, e.g. ``qk-int8_pv-bf16_m128n128w8s2``."""
        extra = ("" if self.fast_math else "_nofast") + ("_pipe" if self.pipeline_qk else "")
        return (
            f"qk-{self.qk_format}_pv-{self.pv_format}_m{self.block_m}n{self.block_n}"
            f"w{self.num_warps}s{self.num_stages}{extra}"
        )


DEFAULT_CONFIG = Fp8AttentionConfig()


# --------------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------------


@triton.jit
def _exp2(x, FAST: tl.constexpr):
    if FAST:
        return tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.math.exp2(x)


@triton.jit
def _round_to_int8(x, FAST: tl.constexpr):
    """Round fp32 x in [-127.5, 127.5] to int8, nearest with ties to even (torch.round).

    x + 1.5 * 2^23 (an fp32 add, round-to-nearest-even) leaves round(x) in the low mantissa bits, two's
    complement in the low byte; FAST packs four such bytes with PRMT instead of four 16/clk F2I conversions.
    """
    if FAST:
        return tl.inline_asm_elementwise(
            """
            {
            .reg .b32 a, b, c, d, lo, hi;
            add.rn.f32 a, $1, 0f4B400000;
            add.rn.f32 b, $2, 0f4B400000;
            add.rn.f32 c, $3, 0f4B400000;
            add.rn.f32 d, $4, 0f4B400000;
            prmt.b32 lo, a, b, 0x0040;
            prmt.b32 hi, c, d, 0x0040;
            prmt.b32 $0, lo, hi, 0x5410;
            }
            """,
            "=r,r,r,r,r",
            [x],
            dtype=tl.int8,
            is_pure=True,
            pack=4,
        )
    else:
        return ((x + 12582912.0) - 12582912.0).to(tl.int8)


@triton.jit
def _round_to_bf16(x):
    """fp32 -> fp32 holding x rounded to bf16 (nearest, ties to even); the interpreter's cast truncates."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_to_e4m3(x):
    """fp32 -> fp32 holding x rounded to float8_e4m3fn (nearest even, saturated at 448); interpreter only.

    Triton 3.6's interpreter mis-rounds fp32->e4m3 casts that carry into the next binade (124.3 -> 64).
    """
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    subnormal = (x + 24576.0) - 24576.0  # 1.5 * 2^14 has an ulp of 2^-9, e4m3's subnormal step
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _to_e4m3(x, INTERPRET: tl.constexpr):
    """Cast fp32 in [-448, 448] to float8_e4m3fn, rounding to nearest even (cvt.rn.satfinite on the GPU)."""
    if INTERPRET:
        return _round_to_e4m3(x).to(tl.float8e4nv)
    else:
        return x.to(tl.float8e4nv)


@triton.jit
def _quantize_tile(x, inv_scale, QK_INT8: tl.constexpr, FAST: tl.constexpr, INTERPRET: tl.constexpr):
    """x * inv_scale rounded to int8 (nearest, ties to even) or cast to e4m3 (nearest even, saturated)."""
    y = x * inv_scale
    if QK_INT8:
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        return _round_to_int8(y, FAST)
    else:
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        return _to_e4m3(y, INTERPRET)


# --------------------------------------------------------------------------------------------------
# Pass 1: per-chunk statistics of K (sum) and V (sum, min, max) per head
# --------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["S", "chunk"])
def _kv_stats_kernel(
    k_ptr, v_ptr, part_ptr,
    S, H, chunk, n_chunks,
    s_kb, s_kh, s_ks,
    s_vb, s_vh, s_vs,
    D: tl.constexpr, ROWS: tl.constexpr, WITH_V: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    d = tl.arange(0, D)
    ksum = tl.zeros([D], dtype=tl.float32)
    vsum = tl.zeros([D], dtype=tl.float32)
    vmax = tl.full([D], float("-inf"), dtype=tl.float32)
    vmin = tl.full([D], float("inf"), dtype=tl.float32)
    k_base = k_ptr + b * s_kb + h * s_kh
    v_base = v_ptr + b * s_vb + h * s_vh
    start = c * chunk
    for r0 in range(0, chunk, ROWS):
        rows = start + r0 + tl.arange(0, ROWS)
        valid = rows < S
        k = tl.load(k_base + rows[:, None].to(tl.int64) * s_ks + d[None, :], mask=valid[:, None], other=0.0)
        ksum += tl.sum(k.to(tl.float32), 0)
        if WITH_V:
            v = tl.load(v_base + rows[:, None].to(tl.int64) * s_vs + d[None, :], mask=valid[:, None], other=0.0)
            v = v.to(tl.float32)
            vsum += tl.sum(v, 0)
            vmax = tl.maximum(vmax, tl.max(tl.where(valid[:, None], v, float("-inf")), 0))
            vmin = tl.minimum(vmin, tl.min(tl.where(valid[:, None], v, float("inf")), 0))
    out = part_ptr + (bh * n_chunks + c).to(tl.int64) * 4 * D
    tl.store(out + d, ksum)
    if WITH_V:
        tl.store(out + D + d, vsum)
        tl.store(out + 2 * D + d, vmax)
        tl.store(out + 3 * D + d, vmin)


@triton.jit(do_not_specialize=["n_chunks"])
def _kv_stats_finalize_kernel(
    part_ptr, stats_ptr, n_chunks, inv_S,
    D: tl.constexpr, NC: tl.constexpr, WITH_V: tl.constexpr, VMAX: tl.constexpr,
):  # fmt: skip
    """Per head: stats[bh] = (mean of K, mean of V, V's scale amax/VMAX, VMAX/amax), each a [D] row."""
    bh = tl.program_id(0)
    c = tl.arange(0, NC)
    d = tl.arange(0, D)
    live = (c < n_chunks)[:, None]
    part = part_ptr + bh.to(tl.int64) * n_chunks * 4 * D + c[:, None] * 4 * D + d[None, :]
    out = stats_ptr + bh.to(tl.int64) * 4 * D + d
    tl.store(out, tl.sum(tl.load(part, mask=live, other=0.0), 0) * inv_S)
    if WITH_V:
        vmean = tl.sum(tl.load(part + D, mask=live, other=0.0), 0) * inv_S
        vmax = tl.max(tl.load(part + 2 * D, mask=live, other=float("-inf")), 0)
        vmin = tl.min(tl.load(part + 3 * D, mask=live, other=float("inf")), 0)
        v_amax = tl.maximum(tl.maximum(vmax - vmean, vmean - vmin), AMAX_FLOOR)
        vmax_full = tl.full([D], VMAX, tl.float32)
        tl.store(out + D, vmean)
        tl.store(out + 2 * D, tl.math.div_rn(v_amax, vmax_full))
        tl.store(out + 3 * D, tl.math.div_rn(vmax_full, v_amax))


# --------------------------------------------------------------------------------------------------
# Pass 2: quantize Q (per token), K (mean-subtracted, per block), V (mean-subtracted, per channel)
# --------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["S"])
def _quantize_kernel(
    q_ptr, k_ptr, v_ptr, stats_ptr,
    q8_ptr, qs_ptr, k8_ptr, ks_ptr, v8_ptr,
    S, S_pad, H, q_mult,
    s_qb, s_qh, s_qs,
    s_kb, s_kh, s_ks,
    s_vb, s_vh, s_vs,
    D: tl.constexpr, QB: tl.constexpr, QK_INT8: tl.constexpr, PV_MODE: tl.constexpr, FAST: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    d = tl.arange(0, D)
    rows = blk * QB + tl.arange(0, QB)
    valid = rows < S
    rows64 = rows.to(tl.int64)
    if QK_INT8:
        QMAX: tl.constexpr = 127.0
    else:
        QMAX: tl.constexpr = 448.0

    stats = stats_ptr + bh.to(tl.int64) * 4 * D
    kmean = tl.load(stats + d)

    # Q: one scale per token; sm_scale * log2(e) folded into the stored scale.
    q = tl.load(q_ptr + b * s_qb + h * s_qh + rows64[:, None] * s_qs + d[None, :], mask=valid[:, None], other=0.0)
    q = q.to(tl.float32)
    q_amax = tl.maximum(tl.max(tl.abs(q), 1), AMAX_FLOOR)
    q_inv = tl.math.div_rn(tl.full([QB], QMAX, tl.float32), q_amax)
    q8 = _quantize_tile(q, q_inv[:, None], QK_INT8, FAST, INTERPRET)
    row_off = bh.to(tl.int64) * S_pad + rows64
    tl.store(q8_ptr + row_off[:, None] * D + d[None, :], q8)
    tl.store(qs_ptr + row_off, tl.math.div_rn(q_amax, tl.full([QB], QMAX, tl.float32)) * q_mult)

    # K: subtract the head's mean over tokens, one scale per QB-token block.
    k = tl.load(k_ptr + b * s_kb + h * s_kh + rows64[:, None] * s_ks + d[None, :], mask=valid[:, None], other=0.0)
    k = tl.where(valid[:, None], k.to(tl.float32) - kmean[None, :], 0.0)
    k_amax = tl.maximum(tl.max(tl.max(tl.abs(k), 1), 0), AMAX_FLOOR)
    k_inv = tl.math.div_rn(QMAX, k_amax)
    k8 = _quantize_tile(k, k_inv, QK_INT8, FAST, INTERPRET)
    tl.store(k8_ptr + row_off[:, None] * D + d[None, :], k8)
    tl.store(ks_ptr + bh.to(tl.int64) * (S_pad // QB) + blk, tl.math.div_rn(k_amax, QMAX))

    # V (8-bit PV only): subtract the per-channel mean, one scale per channel, store transposed (D, S_pad).
    if PV_MODE != 0:
        vmean = tl.load(stats + D + d)
        v_inv = tl.load(stats + 3 * D + d)
        v = tl.load(v_ptr + b * s_vb + h * s_vh + rows64[:, None] * s_vs + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.where(valid[:, None], v.to(tl.float32) - vmean[None, :], 0.0)
        v8 = _quantize_tile(v, v_inv[None, :], PV_MODE == 2, FAST, INTERPRET)
        tl.store(v8_ptr + bh.to(tl.int64) * D * S_pad + d[None, :].to(tl.int64) * S_pad + rows64[:, None], v8)


# --------------------------------------------------------------------------------------------------
# Pass 3: flash attention over the quantized tensors
# --------------------------------------------------------------------------------------------------


@triton.jit
def _qk_scores(q, k_desc, row, QK_INT8: tl.constexpr):
    """Raw scores of one key block: fp32, or for int8 the float 12582912 + s (exact, see below)."""
    k = k_desc.load([row, 0])
    if QK_INT8:
        s_int = tl.dot(q, k.T, out_dtype=tl.int32)
        # 0x4B400000 is 1.5 * 2^23: for |s| < 2^22 the bits of (s + it) are the float 12582912 + s, exactly
        # (|s| <= 128 * 127 * 127 < 2^21), which saves the 16/clk integer-to-float conversion.
        return (s_int + 0x4B400000).to(tl.float32, bitcast=True)
    else:
        return tl.dot(q, k.T)


@triton.jit
def _softmax_pv(
    acc, l_i, m_i, f, c_row, v_desc, ks_ptr,
    ks_row, b, h, bh, start_n, S,
    D: tl.constexpr, BN: tl.constexpr, QB: tl.constexpr,
    QK_INT8: tl.constexpr, PV_MODE: tl.constexpr, FAST: tl.constexpr, MASKED: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """Online-softmax update with one key block's scores ``f``; returns (acc, l_i, m_i)."""
    ks = tl.load(ks_ptr + ks_row + start_n // QB)
    c = c_row * ks
    if QK_INT8:
        MAGIC: tl.constexpr = 12582912.0
    else:
        MAGIC: tl.constexpr = 0.0
    if MASKED:
        cols = start_n + tl.arange(0, BN)
        f = tl.where((cols < S)[None, :], f, float("-inf"))
    blk_max = (tl.max(f, 1) - MAGIC) * c
    m_new = tl.maximum(m_i, blk_max)
    alpha = _exp2(m_i - m_new, FAST)
    if PV_MODE == 2:
        # int8 P: each row's block maximum maps to 127 (log2(127) = 6.988684686772166).
        p = _exp2(f * c[:, None] - (MAGIC * c + blk_max - 6.988684686772166)[:, None], FAST)
        beta = _exp2(blk_max - m_new, FAST)
        l_i = l_i * alpha + tl.sum(p, 1) * beta
        p8 = _round_to_int8(p, FAST)
        v = v_desc.load([bh * D, start_n]).T
        pv = tl.dot(p8, v, out_dtype=tl.int32)
        pv_f = (pv + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
        acc = acc * alpha[:, None] + pv_f * beta[:, None]
    elif PV_MODE == 1:
        # e4m3 P: scaled by 2^8 (max 256 < 448); the factor cancels against l.
        p = _exp2(f * c[:, None] - (MAGIC * c + m_new - 8.0)[:, None], FAST)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([bh * D, start_n]).T
        acc = acc * alpha[:, None]
        acc = tl.dot(_to_e4m3(p, INTERPRET), v, acc)
    else:
        p = _exp2(f * c[:, None] - (MAGIC * c + m_new)[:, None], FAST)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([b, h, start_n, 0]).reshape([BN, D])
        acc = acc * alpha[:, None]
        if INTERPRET:
            # Triton 3.6's interpreter multiplies bf16 bit patterns in tl.dot and truncates fp32->bf16
            # casts; emulate the GPU (round-to-nearest-even, fp32 accumulate) exactly in fp32.
            acc = tl.dot(_round_to_bf16(p), v.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(tl.bfloat16), v, acc)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["S"])
def _attn_kernel(
    q_desc, qs_ptr, k_desc, ks_ptr, v_desc, stats_ptr, o_desc,
    S, S_pad, H,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, QB: tl.constexpr,
    QK_INT8: tl.constexpr, PV_MODE: tl.constexpr, FAST: tl.constexpr, PIPE_QK: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    q_row = bh * S_pad + pid_m * BM
    q = q_desc.load([q_row, 0])
    c_row = tl.load(qs_ptr + q_row + tl.arange(0, BM))
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    kv_row = bh * S_pad
    ks_row = bh * (S_pad // QB)
    # Every key block but the last is full; the last one is masked (it may be ragged).
    n_iter = tl.cdiv(S, BN)
    if PIPE_QK:
        # Issue block j+1's QK^T (asynchronous wgmma) before block j's softmax, so that the tensor
        # cores work while the warps do exp2 (FlashAttention-3's intra-warpgroup overlap).
        f = _qk_scores(q, k_desc, kv_row, QK_INT8)
        for j in range(0, n_iter - 1):
            f_next = _qk_scores(q, k_desc, kv_row + (j + 1) * BN, QK_INT8)
            acc, l_i, m_i = _softmax_pv(
                acc, l_i, m_i, f, c_row, v_desc, ks_ptr, ks_row, b, h, bh, j * BN, S,
                D, BN, QB, QK_INT8, PV_MODE, FAST, False, INTERPRET,
            )  # fmt: skip
            f = f_next
        acc, l_i, m_i = _softmax_pv(
            acc, l_i, m_i, f, c_row, v_desc, ks_ptr, ks_row, b, h, bh, (n_iter - 1) * BN, S,
            D, BN, QB, QK_INT8, PV_MODE, FAST, True, INTERPRET,
        )  # fmt: skip
    else:
        n_full = S // BN
        for j in range(0, n_full):
            f = _qk_scores(q, k_desc, kv_row + j * BN, QK_INT8)
            acc, l_i, m_i = _softmax_pv(
                acc, l_i, m_i, f, c_row, v_desc, ks_ptr, ks_row, b, h, bh, j * BN, S,
                D, BN, QB, QK_INT8, PV_MODE, FAST, False, INTERPRET,
            )  # fmt: skip
        if n_full < n_iter:
            f = _qk_scores(q, k_desc, kv_row + n_full * BN, QK_INT8)
            acc, l_i, m_i = _softmax_pv(
                acc, l_i, m_i, f, c_row, v_desc, ks_ptr, ks_row, b, h, bh, n_full * BN, S,
                D, BN, QB, QK_INT8, PV_MODE, FAST, True, INTERPRET,
            )  # fmt: skip
    inv_l = 1.0 / l_i
    if PV_MODE == 0:
        o = acc * inv_l[:, None]
    else:
        d = tl.arange(0, D)
        vm = tl.load(stats_ptr + bh * 4 * D + D + d)
        vs = tl.load(stats_ptr + bh * 4 * D + 2 * D + d)
        o = acc * inv_l[:, None] * vs[None, :] + vm[None, :]
    if INTERPRET:
        o = _round_to_bf16(o)
    o_desc.store([b, pid_m * BM, h * D], o.to(tl.bfloat16).reshape([1, BM, D]))


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantizedQKV:
    """What ``quantize_qkv`` produces: the attention kernel's inputs (padded to ``s_pad`` tokens).

    q8, k8: (B*H*s_pad, D) int8 or float8_e4m3fn. qs: (B*H*s_pad,) float32 per-token Q scale times
    sm_scale*log2(e). ks: (B*H*s_pad/128,) float32 per-block K scale. stats: (B*H, 4, D) float32 rows
    (K mean, V mean, V scale, 1/V scale). v8: (B*H*D, s_pad) 8-bit V, transposed, for 8-bit PV; for
    bf16 PV ``v`` is the original (B, H, S, D) bf16 tensor and v8 is None.
    """

    q8: torch.Tensor
    qs: torch.Tensor
    k8: torch.Tensor
    ks: torch.Tensor
    stats: torch.Tensor
    v: torch.Tensor | None
    v8: torch.Tensor | None
    shape: tuple[int, int, int, int]
    s_pad: int


def validate_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError unless q, k, v are (B, H, S, D) bf16 of equal shape, D in (64, 128), last dim contiguous."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, S, D), got shape {tuple(t.shape)}")
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be bfloat16, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"q, k, v must have equal shapes (no GQA, no cross-attention): {q.shape}, {k.shape}, {v.shape}"
        )
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"head dim {q.shape[-1]} is not supported by the Triton 8-bit kernel; supported: 64, 128")
    if q.shape[2] < 1:
        raise ValueError("sequence length must be at least 1")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device: {q.device}, {k.device}, {v.device}")
    if q.device.type != "cuda" and not interpreter_active():
        raise ValueError(f"the Triton 8-bit kernel needs CUDA tensors (got {q.device}) or TRITON_INTERPRET=1")


def _stats_split(bh: int, s: int, rows: int) -> tuple[int, int]:
    """Chunk length (a multiple of ``rows``) and count (<= 32) so that bh * chunks fills the GPU a few times."""
    want = max(1, min(math.ceil(528 / bh), math.ceil(s / rows), 32))
    chunk = math.ceil(math.ceil(s / want) / rows) * rows
    return chunk, math.ceil(s / chunk)


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: Fp8AttentionConfig) -> QuantizedQKV:
    """Quantize q, k (and v for 8-bit PV) for ``attention_from_quantized``; three Triton launches.

    q, k, v: (B, H, S, D) bfloat16, last dim contiguous. See the module docstring for the scales.
    """
    validate_inputs(q, k, v)
    B, H, S, D = q.shape
    bh = B * H
    s_pad = triton.cdiv(S, QUANT_BLOCK) * QUANT_BLOCK
    dev = q.device
    qk_dtype = torch.int8 if config.qk_format == "int8" else torch.float8_e4m3fn
    pv_mode = _PV_MODE[config.pv_format]
    rows = 32
    chunk, n_chunks = _stats_split(bh, S, rows)
    part = torch.empty(bh * n_chunks * 4 * D, device=dev, dtype=torch.float32)
    _kv_stats_kernel[(n_chunks, bh)](
        k, v, part, S, H, chunk, n_chunks, *k.stride()[:3], *v.stride()[:3],
        D=D, ROWS=rows, WITH_V=pv_mode != 0, num_warps=4,
    )  # fmt: skip
    stats = torch.empty(bh, 4, D, device=dev, dtype=torch.float32)
    _kv_stats_finalize_kernel[(bh,)](
        part, stats, n_chunks, 1.0 / S,
        D=D, NC=triton.next_power_of_2(n_chunks), WITH_V=pv_mode != 0, VMAX=127.0 if pv_mode == 2 else 448.0,
        num_warps=4,
    )  # fmt: skip
    q8 = torch.empty(bh * s_pad, D, device=dev, dtype=qk_dtype)
    k8 = torch.empty(bh * s_pad, D, device=dev, dtype=qk_dtype)
    qs = torch.empty(bh * s_pad, device=dev, dtype=torch.float32)
    ks = torch.empty(bh * (s_pad // QUANT_BLOCK), device=dev, dtype=torch.float32)
    if pv_mode != 0:
        v8 = torch.empty(bh * D, s_pad, device=dev, dtype=torch.int8 if pv_mode == 2 else torch.float8_e4m3fn)
    else:
        v8 = qs  # placeholder, never touched by the kernel
    q_mult = (1.0 / math.sqrt(D)) * LOG2E
    _quantize_kernel[(s_pad // QUANT_BLOCK, bh)](
        q, k, v, stats, q8, qs, k8, ks, v8,
        S, s_pad, H, q_mult,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        D=D, QB=QUANT_BLOCK, QK_INT8=config.qk_format == "int8", PV_MODE=pv_mode, FAST=config.fast_math,
        INTERPRET=interpreter_active(), num_warps=8,
    )  # fmt: skip
    if pv_mode == 0:
        return QuantizedQKV(q8, qs, k8, ks, stats, v, None, (B, H, S, D), s_pad)
    return QuantizedQKV(q8, qs, k8, ks, stats, None, v8, (B, H, S, D), s_pad)


def _v_descriptor(prep: QuantizedQKV, config: Fp8AttentionConfig) -> TensorDescriptor:
    D = prep.shape[3]
    bn = config.block_n
    if prep.v8 is not None:
        return TensorDescriptor.from_tensor(prep.v8, [D, bn])
    v = prep.v
    if any((st * v.element_size()) % 16 for st in v.stride()[:3]) or v.data_ptr() % 16:
        logger.debug("v strides %s are not 16-byte aligned for TMA; copying to contiguous", v.stride())
        v = v.contiguous()
    return TensorDescriptor(v, list(v.shape), list(v.stride()), [1, 1, bn, D])


def attention_from_quantized(
    prep: QuantizedQKV, config: Fp8AttentionConfig, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Run the attention kernel on ``quantize_qkv``'s output; returns (B, S, H*D) bfloat16."""
    B, H, S, D = prep.shape
    bm, bn = config.block_m, config.block_n
    if out is None:
        out = torch.empty(B, S, H * D, device=prep.q8.device, dtype=torch.bfloat16)
    q_desc = TensorDescriptor.from_tensor(prep.q8, [bm, D])
    k_desc = TensorDescriptor.from_tensor(prep.k8, [bn, D])
    v_desc = _v_descriptor(prep, config)
    o_desc = TensorDescriptor.from_tensor(out, [1, bm, D])
    _attn_kernel[(prep.s_pad // bm, B * H)](
        q_desc, prep.qs, k_desc, prep.ks, v_desc, prep.stats, o_desc,
        S, prep.s_pad, H,
        D=D, BM=bm, BN=bn, QB=QUANT_BLOCK,
        QK_INT8=config.qk_format == "int8", PV_MODE=_PV_MODE[config.pv_format],
        FAST=config.fast_math, PIPE_QK=config.pipeline_qk, INTERPRET=interpreter_active(),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def fp8_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: Fp8AttentionConfig = DEFAULT_CONFIG
) -> torch.Tensor:
    """Non-causal attention softmax(q k^T / sqrt(D)) v with 8-bit tensor-core products.

    q, k, v: (B, H, S, D) bfloat16 on a Hopper GPU (compute capability 9.0), D in (64, 128),
    any S >= 1, no mask. Returns (B, S, H*D) bfloat16. Four Triton launches (stats, stats
    finalize, quantize, attention); see the module docstring for the numerics.
    """
    if config.fast_math and interpreter_active():
        raise ValueError("fast_math=True uses inline PTX, which Triton's interpreter cannot run; pass fast_math=False")
    prep = quantize_qkv(q, k, v, config)
    return attention_from_quantized(prep, config)
