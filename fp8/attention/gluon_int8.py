"""Int8-QK / bf16-PV flash attention forward for Hopper in Gluon, with FlashAttention-3's overlap.

``gluon_int8_attention(q, k, v)`` computes softmax(q k^T / sqrt(D)) v for q, k, v of shape
(B, H, S, D) bfloat16 (D = 128, no mask, not causal) and returns (B, S, H*D) bfloat16, the
layout the DiT's output projection consumes.

Numerics are the ``triton_fp8`` kernel's default (``qk_format="int8"``, ``pv_format="bf16"``,
docs/experiments/attention.md): ``triton_fp8.quantize_qkv`` quantizes Q per token and K per
128-token block after subtracting K's mean over tokens (softmax-invariant); QK^T runs as int8
wgmma with int32 accumulation; the online softmax in fp32 with ``ex2.approx``; P is rounded to
bf16 and multiplied with the caller's bf16 V (fp32 accumulation).

Why Gluon and not ``triton.jit``: at 8 bits the tensor-core time and the exp2 time of one key
block are about equal (0.55 vs 0.47 ms per call at S = 8492), so a kernel is only fast if the
softmax of block j runs while the tensor cores compute block j's successor. Triton 3.6's
pipeliner waits for every wgmma right after issuing it; Gluon exposes ``warpgroup_mma(...,
is_async=True)`` and ``warpgroup_mma_wait(num_outstanding)``, so this kernel issues, per key
block j::

    S_j = Q K_j^T            (async)
    O  += P_{j-1} V_{j-1}    (async, O already rescaled)
    wait until S_j is done   (P V may still run)
    softmax(S_j) -> P_j, alpha_j     # exp2 on the MUFU while P_{j-1} V_{j-1} runs
    wait until O is done; O *= alpha_j

K and V tiles arrive by TMA into a ring of ``STAGES`` shared-memory buffers, each with its own
mbarrier; a buffer is refilled once both warpgroup MMAs that read it have retired.

Shapes and hardware: compute capability 9.0 only (wgmma, TMA); D = 128; BM = 64 query rows per
warpgroup (``num_warps`` 4 or 8: BM = 64 or 128); BN = 64 or 128 keys per step (the K scale block
of 128 tokens is indexed per step); any S >= 1 (the ragged last key block is masked, out-of-range
V rows are zero-filled by TMA or belong to the next sample and get P = 0).

Measured (H200, docs/experiments/attention.md): correct (within 1.5e-3 of ``triton_fp8``'s
int8/bf16 output, which uses the same quantized operands), but at S = 8492 1.68-1.79 ms against
cuDNN's bf16 1.46-1.48 ms: the softmax path, not the tensor cores, limits it. Kept as the base
for a warp-specialized version; the nodes do not offer it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .triton_fp8 import QUANT_BLOCK, Fp8AttentionConfig, quantize_qkv, validate_inputs

__all__ = [
    "DEFAULT_GLUON_CONFIG",
    "GLUON_HEAD_DIM",
    "GluonAttentionConfig",
    "gluon_attention_from_quantized",
    "gluon_int8_attention",
]

logger = logging.getLogger(__name__)

GLUON_HEAD_DIM = 128
_QUANT_CONFIG = Fp8AttentionConfig(qk_format="int8", pv_format="bf16")
# 1.5 * 2^23 as the bits of a float: int32 s + this, read as fp32, is exactly 12582912.0 + s for
# |s| < 2^22 (|s| <= 128 * 127 * 127 < 2^21), which saves the 16/clk integer-to-float conversion.
_MAGIC_BITS = gl.constexpr(0x4B400000)
_MAGIC = gl.constexpr(12582912.0)
QB = gl.constexpr(QUANT_BLOCK)  # tokens per K scale


@dataclass(frozen=True)
class GluonAttentionConfig:
    """Launch shape: ``num_warps`` 4 (BM = 64) or 8 (BM = 128, two warpgroups); ``block_n`` keys per step
    (64 or 128; 64 halves the score registers and the shared memory per stage, so more CTAs fit an SM);
    ``stages`` K/V buffers (2-4)."""

    num_warps: int = 4
    stages: int = 2
    block_n: int = 128

    def __post_init__(self) -> None:
        if self.num_warps not in (4, 8):
            raise ValueError(f"num_warps={self.num_warps} is not allowed; allowed values: 4, 8")
        if not 2 <= self.stages <= 4:
            raise ValueError(f"stages={self.stages} must be between 2 and 4")
        if self.block_n not in (64, 128):
            raise ValueError(f"block_n={self.block_n} is not allowed; allowed values: 64, 128")

    @property
    def block_m(self) -> int:
        return 16 * self.num_warps

    @property
    def label(self) -> str:
        return f"gluon_int8_m{self.block_m}n{self.block_n}w{self.num_warps}s{self.stages}"


DEFAULT_GLUON_CONFIG = GluonAttentionConfig()


@gluon.jit
def _exp2(x):
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _issue_kv(k_desc, v_desc, k_smem, v_smem, bars, kv_row, v_row, v_col, j, STAGES: gl.constexpr):
    """TMA loads of key block j (int8 K tile, bf16 V tile) into ring slot j % STAGES."""
    slot = j % STAGES
    bar = bars.index(slot)
    mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [kv_row + j * k_desc.block_type.shape[0], 0], bar, k_smem.index(slot))
    tma.async_copy_global_to_shared(v_desc, [v_row + j * v_desc.block_type.shape[0], v_col], bar, v_smem.index(slot))


@gluon.jit
def _row_reduce(x, combine: gl.constexpr, row_layout: gl.constexpr):
    """Reduce [BM, BN] over columns (combine 0: max, 1: sum) as four independent chains joined at the end.

    Triton reduces a thread's columns in one dependent chain (31 FMNMX / FADD per row for BN = 128);
    four chains cut that latency 4x. The splits (row halves, then even / odd columns) keep every
    element in its thread, so the reshapes and the final layout conversion move no data
    (``assert_trivial``).
    """
    lo, hi = gl.split(gl.permute(gl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), (0, 2, 1)))
    a, b = gl.split(gl.reshape(lo, [x.shape[0], x.shape[1] // 4, 2]))
    c, d = gl.split(gl.reshape(hi, [x.shape[0], x.shape[1] // 4, 2]))
    if combine == 0:
        r = gl.maximum(gl.maximum(gl.max(a, 1), gl.max(b, 1)), gl.maximum(gl.max(c, 1), gl.max(d, 1)))
    else:
        r = (gl.sum(a, 1) + gl.sum(b, 1)) + (gl.sum(c, 1) + gl.sum(d, 1))
    return gl.convert_layout(r, row_layout, assert_trivial=True)


@gluon.jit
def _softmax_step(s_int, c_row, ks, m_i, l_i, start_n, S, MASKED: gl.constexpr, s_layout: gl.constexpr):
    """Online-softmax update for one key block of int32 scores; returns (p fp32, alpha, m_new, l_new)."""
    f = (s_int + _MAGIC_BITS).to(gl.float32, bitcast=True)
    if MASKED:
        cols = start_n + gl.arange(0, f.shape[1], layout=gl.SliceLayout(0, s_layout))
        f = gl.where(gl.expand_dims(cols < S, 0), f, float("-inf"))
    c = c_row * ks
    blk_max = (_row_reduce(f, 0, gl.SliceLayout(1, s_layout)) - _MAGIC) * c
    m_new = gl.maximum(m_i, blk_max)
    alpha = _exp2(m_i - m_new)
    p = _exp2(f * gl.expand_dims(c, 1) - gl.expand_dims(_MAGIC * c + m_new, 1))
    l_new = l_i * alpha + _row_reduce(p, 1, gl.SliceLayout(1, s_layout))
    return p, alpha, m_new, l_new


@gluon.jit
def _overlapped_step(
    q_smem, k_smem, v_smem, kv_bars, k_desc, v_desc, ks_ptr, p16, acc, c_row, m_i, l_i, s_zero,
    j, n_blocks, S, kv_row, v_row, v_col, ks_row,
    MASKED: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr,
    row_o: gl.constexpr,
):  # fmt: skip
    """Key block j: QK_j^T and P_{j-1} V_{j-1} in flight, softmax of block j under the PV product.

    Returns (P_j as the bf16 A operand, O rescaled to block j's running maximum, m, l).
    """
    BN: gl.constexpr = k_desc.block_type.shape[0]
    slot = j % STAGES
    prev = (j - 1) % STAGES
    mbarrier.wait(kv_bars.index(slot), (j // STAGES) & 1)
    s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    o_tok = warpgroup_mma(p16, v_smem.index(prev), acc, is_async=True)
    s_int = warpgroup_mma_wait(1, deps=(s_tok,))
    ks = gl.load(ks_ptr + ks_row + (j * BN) // QB)
    p, alpha, m_i, l_i = _softmax_step(s_int, c_row, ks, m_i, l_i, j * BN, S, MASKED, s_layout)
    acc, p16 = warpgroup_mma_wait(0, deps=(o_tok, p16))
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    p16 = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    # Slot `prev` (K_{j-1}, V_{j-1}) is free once every warp passed its waits: refill it.
    nxt = j - 1 + STAGES
    if nxt < n_blocks:
        gl.thread_barrier()
        _issue_kv(k_desc, v_desc, k_smem, v_smem, kv_bars, kv_row, v_row, v_col, nxt, STAGES)
    return p16, acc, m_i, l_i


@gluon.jit(do_not_specialize=["S"])
def _attn_kernel(
    q_desc, qs_ptr, k_desc, ks_ptr, v_desc, o_ptr,
    S, S_pad, H, v_row_b, v_row_h, v_col_h,
    STAGES: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    BM: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    BN: gl.constexpr = k_desc.block_type.shape[0]

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 32]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, D, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    q_row = bh * S_pad + pid_m * BM
    kv_row = bh * S_pad
    ks_row = bh * (S_pad // QB)
    v_row = b * v_row_b + h * v_row_h
    v_col = h * v_col_h
    n_blocks = gl.cdiv(S, BN)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_bars.index(i), count=1)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        if i < n_blocks:
            _issue_kv(k_desc, v_desc, k_smem, v_smem, kv_bars, kv_row, v_row, v_col, i, STAGES)

    c_row = gl.load(qs_ptr + q_row + gl.arange(0, BM, layout=row_s))
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BM], gl.float32, layout=row_s)
    acc = gl.zeros([BM, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BM, BN], gl.int32, layout=s_layout)

    # Block 0: scores, softmax (masked: it may also be the last block).
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(kv_bars.index(0), 0)
    s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s_int = warpgroup_mma_wait(0, deps=(s_tok,))
    ks = gl.load(ks_ptr + ks_row)
    p, _, m_i, l_i = _softmax_step(s_int, c_row, ks, m_i, l_i, 0, S, True, s_layout)
    p16 = gl.convert_layout(p.to(gl.bfloat16), p_layout)

    # Blocks 1 .. n-2 unmasked, then the last (ragged) block masked: S_j and P_{j-1} V_{j-1} in
    # flight together, the softmax of S_j under P V.
    for j in range(1, n_blocks - 1):
        p16, acc, m_i, l_i = _overlapped_step(
            q_smem, k_smem, v_smem, kv_bars, k_desc, v_desc, ks_ptr, p16, acc, c_row, m_i, l_i, s_zero,
            j, n_blocks, S, kv_row, v_row, v_col, ks_row, False, STAGES, s_layout, p_layout, row_o,
        )  # fmt: skip
    if n_blocks > 1:
        p16, acc, m_i, l_i = _overlapped_step(
            q_smem, k_smem, v_smem, kv_bars, k_desc, v_desc, ks_ptr, p16, acc, c_row, m_i, l_i, s_zero,
            n_blocks - 1, n_blocks, S, kv_row, v_row, v_col, ks_row, True, STAGES, s_layout, p_layout, row_o,
        )  # fmt: skip

    last = (n_blocks - 1) % STAGES
    o_tok = warpgroup_mma(p16, v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(o_tok,))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(kv_bars.index(i))

    o = acc * gl.expand_dims(gl.convert_layout(1.0 / l_i, row_o), 1)
    rows = pid_m * BM + gl.arange(0, BM, layout=row_o)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    offs = gl.expand_dims((b * S + rows).to(gl.int64) * (H * D), 1) + gl.expand_dims(h * D + cols, 0)
    gl.store(o_ptr + offs, o.to(gl.bfloat16), mask=gl.expand_dims(rows < S, 1))


def _v_view(v: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """A 2-D (rows, cols) view of v (B, H, S, D) for TMA and how (b, h) map to its rows / columns.

    Returns (v2d, rows per sample, rows per head, columns per head). Works without a copy for the
    contiguous (B, H, S, D) layout and for the (B, S, H, D) memory the DiT's transposes produce.
    """
    B, H, S, D = v.shape
    sb, sh, ss, sd = v.stride()
    if sd == 1 and ss == H * D and sh == D and sb == S * H * D:
        return v.as_strided((B * S, H * D), (H * D, 1)), S, 0, D
    v = v.contiguous()
    return v.view(B * H * S, D), H * S, S, 0


def gluon_attention_from_quantized(
    q8: torch.Tensor, qs: torch.Tensor, k8: torch.Tensor, ks: torch.Tensor, v: torch.Tensor, s_pad: int,
    config: GluonAttentionConfig = DEFAULT_GLUON_CONFIG,
) -> torch.Tensor:  # fmt: skip
    """Attention over ``triton_fp8.quantize_qkv``'s int8 q8/k8 (and scales) with bf16 v (B, H, S, D).

    Returns (B, S, H*D) bfloat16.
    """
    B, H, S, D = v.shape
    bm, bn = config.block_m, config.block_n
    out = torch.empty(B, S, H * D, device=v.device, dtype=torch.bfloat16)
    v2d, v_row_b, v_row_h, v_col_h = _v_view(v)
    qk_layout = gl.NVMMASharedLayout.get_default_for([bm, D], gl.int8)
    k_layout = gl.NVMMASharedLayout.get_default_for([bn, D], gl.int8)
    v_layout = gl.NVMMASharedLayout.get_default_for([bn, D], gl.bfloat16)
    q_desc = TensorDescriptor.from_tensor(q8, [bm, D], qk_layout)
    k_desc = TensorDescriptor.from_tensor(k8, [bn, D], k_layout)
    v_desc = TensorDescriptor.from_tensor(v2d, [bn, D], v_layout)
    _attn_kernel[(s_pad // bm, B * H)](
        q_desc, qs, k_desc, ks, v_desc, out,
        S, s_pad, H, v_row_b, v_row_h, v_col_h,
        STAGES=config.stages, num_warps=config.num_warps,
    )  # fmt: skip
    return out


def gluon_int8_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: GluonAttentionConfig = DEFAULT_GLUON_CONFIG
) -> torch.Tensor:
    """Non-causal softmax(q k^T / sqrt(D)) v with int8 QK^T and bf16 PV, FA3-style overlap.

    q, k, v: (B, H, S, D) bfloat16 on a Hopper GPU (compute capability 9.0), D = 128, S >= 1,
    last dim contiguous. Returns (B, S, H*D) bfloat16. Launches: ``quantize_qkv``'s three
    (K mean, its finalize, quantize) and this kernel.
    """
    validate_inputs(q, k, v)
    if q.shape[-1] != GLUON_HEAD_DIM:
        raise ValueError(f"gluon_int8 supports head dim {GLUON_HEAD_DIM} only, not {q.shape[-1]}")
    prep = quantize_qkv(q, k, v, _QUANT_CONFIG)
    if triton.cdiv(prep.s_pad, config.block_m) * config.block_m != prep.s_pad:
        raise AssertionError("s_pad must be a multiple of block_m")
    return gluon_attention_from_quantized(prep.q8, prep.qs, prep.k8, prep.ks, v, prep.s_pad, config)
