"""The joint attention values ``[image; text]`` plus their projection biases, cast to per-tensor e4m3 (Triton, CUDA).

Before FP8 attention, v arrives per stream as (B, S_stream, H, Dh) views into each stream's fused QKV
GEMM output, its bias not yet added. Unlike q and k (RMSNorm bounds them, :mod:`.qk_norm_quant`), v has
no static bound, so its per-tensor scale needs the max over the whole joint tensor first. Inductor did
this as a concatenation + bias + max reduction (3.8 ms of a 191 ms forward on an H200) and a second
concatenation + bias + cast kernel (1.5 ms): about 1 TB/s. Here two kernels read v at memory speed:

1. :func:`_v_amax_kernel`: each program runs over ``ROWS`` tokens of one head group and folds its max into
   one float32 (``tl.atomic_max``; a few hundred atomics per call);
2. :func:`_v_cast_kernel`: one program per (token, head group) adds the bias, scales by ``448 / amax`` and
   writes the joint (B, S_img + S_txt, H, Dh) e4m3 sequence, contiguous. It also writes the scalars that
   follow from the max, so that no tiny kernel computes them between the launches of a block: the descale
   ``amax / 448`` (as torch divides by a scalar on CUDA: times the float32 reciprocal of 448), its reciprocal
   (cuDNN's output scale, IEEE division), and that descale once per token as the row-wise scales of the image
   and text output projections, which take the e4m3 attention output as is.

Numerics: those of the block's torch path, ``cudnn_fp8.quantize_per_tensor(torch.cat([v_img + b_img,
v_txt + b_txt], 1))``: the bias added in bf16, amax of the bf16 values (clamped to >= 1e-12), ``v * (448 /
amax)`` in float32 (IEEE division), clamped to +-448, rounded to nearest even e4m3.

Limits: CUDA tensors, bf16 inputs whose last dim is contiguous, H divisible by a head group of 8, 4, 2 or
1, Dh a power of two. Callers check :func:`joint_v_quant_capability`. Registered as the custom op
``qwen_edit_hopper::joint_v_quantize`` (``torch.library.triton_op``), so compiled blocks keep it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...fp8.capability import Capability
from ...fp8.quant import E4M3_MAX, FP8_DTYPE
from .qk_norm_rope_quant import _head_group, qk_norm_rope_quant_capability, stream_biases

__all__ = [
    "AMAX_FLOOR",
    "OP_NAME",
    "JointV",
    "joint_v_quant_capability",
    "joint_v_quantize",
    "joint_v_quantize_scales",
    "reference_joint_v_quantize",
]

OP_NAME = "qwen_edit_hopper::joint_v_quantize"

AMAX_FLOOR = 1e-12
"""An all-zero v still gets a finite scale (as ``quantize_per_tensor`` clamps)."""

ROWS_PER_AMAX_PROGRAM = 32
"""Tokens per program of the max pass: 266 x 3 programs (and atomics) at 8492 tokens, 24 heads."""

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:  # pragma: no cover - depends on the torch build; joint_v_quant_capability reports it
    triton = None


def joint_v_quant_capability(device: torch.device, head_dim: int) -> Capability:
    """Whether the kernels can run for heads of ``head_dim`` on ``device`` (those of the QK kernel)."""
    capability = qk_norm_rope_quant_capability(device, head_dim)
    if not capability.ok:
        return capability
    return Capability.yes(f"Triton joint v max + cast kernels on {device}")


def _with_bias(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x if bias is None else x + bias.reshape(x.shape[-2:]).to(x.dtype)


def reference_joint_v_quantize(v_img: torch.Tensor, v_txt: torch.Tensor, b_img: torch.Tensor | None = None,
                               b_txt: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernels compute, in plain torch (any device): the block's concatenation and per-tensor cast.

    Returns (v8 (B, S_img + S_txt, H, Dh) float8_e4m3fn, descale (1, 1, 1, 1) float32 = amax / 448).
    """
    from ...fp8.attention.cudnn_fp8 import quantize_per_tensor

    return quantize_per_tensor(torch.cat([_with_bias(v_img, b_img), _with_bias(v_txt, b_txt)], dim=1))


class JointV(NamedTuple):
    """:func:`joint_v_quantize_scales`' result. v8: (B, S_img + S_txt, H, Dh) float8_e4m3fn, contiguous;
    descale: (1, 1, 1, 1) float32 = amax / 448; scale_o: (1, 1, 1, 1) float32 = 1 / descale (cuDNN's output
    scale); image_rows: (B * S_img, 1) and text_rows: (B * S_txt, 1) float32, every entry = descale (the
    row-wise scales of the output projections' e4m3 inputs)."""

    v8: torch.Tensor
    descale: torch.Tensor
    scale_o: torch.Tensor
    image_rows: torch.Tensor
    text_rows: torch.Tensor


if triton is not None:
    from ...fp8.attention.triton_fp8 import _to_e4m3, interpreter_active

    _E4M3_MAX = tl.constexpr(E4M3_MAX)
    _INV_E4M3_MAX = tl.constexpr(1.0 / E4M3_MAX)
    _AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)

    @triton.jit
    def _load_token(img_ptr, txt_ptr, b_img_ptr, b_txt_ptr, t, b, s_img, sib, sis, sih, stb, sts, sth, hs, dims,
                    HAS_BIAS: tl.constexpr, HEAD_DIM: tl.constexpr):  # noqa: N803
        """Token ``t`` of sample ``b`` of the joint sequence, heads ``hs``: (HG, Dh) float32, bias added in bf16."""
        if t < s_img:
            x = tl.load(img_ptr + b * sib + t * sis + hs[:, None] * sih + dims[None, :])
            bias_ptrs = b_img_ptr + hs[:, None] * HEAD_DIM + dims[None, :]
        else:
            x = tl.load(txt_ptr + b * stb + (t - s_img) * sts + hs[:, None] * sth + dims[None, :])
            bias_ptrs = b_txt_ptr + hs[:, None] * HEAD_DIM + dims[None, :]
        if HAS_BIAS:
            x = (x.to(tl.float32) + tl.load(bias_ptrs).to(tl.float32)).to(tl.bfloat16)
        return x.to(tl.float32)

    @triton.jit
    def _v_amax_kernel(img_ptr, txt_ptr, b_img_ptr, b_txt_ptr, amax_ptr, rows_total, s_img, s_joint, sib, sis, sih,
                       stb, sts, sth, HAS_BIAS: tl.constexpr, HG: tl.constexpr, HEAD_DIM: tl.constexpr,  # noqa: N803
                       ROWS: tl.constexpr):  # noqa: N803
        first = tl.program_id(0).to(tl.int64) * ROWS
        hs = tl.program_id(1) * HG + tl.arange(0, HG)
        dims = tl.arange(0, HEAD_DIM)
        peak = tl.zeros((HG, HEAD_DIM), dtype=tl.float32)
        for i in range(ROWS):
            row = first + i
            if row < rows_total:
                x = _load_token(img_ptr, txt_ptr, b_img_ptr, b_txt_ptr, row % s_joint, row // s_joint, s_img, sib,
                                sis, sih, stb, sts, sth, hs, dims, HAS_BIAS, HEAD_DIM)
                peak = tl.maximum(peak, tl.abs(x))
        tl.atomic_max(amax_ptr, tl.max(tl.max(peak, axis=1), axis=0))

    @triton.jit
    def _v_cast_kernel(img_ptr, txt_ptr, b_img_ptr, b_txt_ptr, amax_ptr, out_ptr, descale_ptr, scale_o_ptr,
                       img_rows_ptr, txt_rows_ptr, s_img, s_joint, heads, sib, sis, sih, stb, sts, sth,
                       HAS_BIAS: tl.constexpr, HG: tl.constexpr, HEAD_DIM: tl.constexpr,  # noqa: N803
                       INTERPRET: tl.constexpr):  # noqa: N803
        row = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1)
        hs = group * HG + tl.arange(0, HG)
        dims = tl.arange(0, HEAD_DIM)
        b, t = row // s_joint, row % s_joint
        x = _load_token(img_ptr, txt_ptr, b_img_ptr, b_txt_ptr, t, b, s_img, sib, sis, sih, stb, sts, sth, hs, dims,
                        HAS_BIAS, HEAD_DIM)  # fmt: skip
        amax = tl.maximum(tl.load(amax_ptr), _AMAX_FLOOR)
        inv = tl.math.div_rn(_E4M3_MAX, amax)
        q = tl.clamp(x * inv, -_E4M3_MAX, _E4M3_MAX)
        tl.store(out_ptr + row * heads * HEAD_DIM + hs[:, None] * HEAD_DIM + dims[None, :], _to_e4m3(q, INTERPRET))
        descale = amax * _INV_E4M3_MAX  # as torch's CUDA division by a scalar: times the fp32 reciprocal
        if group == 0:  # the output projections' row scales: this token's row of the image or the text stream
            if t < s_img:
                tl.store(img_rows_ptr + b * s_img + t, descale)
            else:
                tl.store(txt_rows_ptr + b * (s_joint - s_img) + (t - s_img), descale)
            if row == 0:
                tl.store(descale_ptr, descale)
                tl.store(scale_o_ptr, tl.math.div_rn(1.0, descale))

    @triton_op(OP_NAME, mutates_args={})
    def _joint_v_quantize_op(v_img: torch.Tensor, v_txt: torch.Tensor, b_img: torch.Tensor | None,
                             b_txt: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor, torch.Tensor, torch.Tensor]:
        b, si, h, d = v_img.shape
        sj = si + v_txt.shape[1]
        f32 = {"dtype": torch.float32, "device": v_img.device}
        out = torch.empty((b, sj, h, d), dtype=FP8_DTYPE, device=v_img.device)
        amax = torch.zeros(1, **f32)
        descale, scale_o = torch.empty((1, 1, 1, 1), **f32), torch.empty((1, 1, 1, 1), **f32)
        img_rows, txt_rows = torch.empty((b * si, 1), **f32), torch.empty((b * (sj - si), 1), **f32)
        group = _head_group(h)
        has_bias = b_img is not None
        strides = (v_img.stride(0), v_img.stride(1), v_img.stride(2), v_txt.stride(0), v_txt.stride(1),
                   v_txt.stride(2))
        biases = (b_img, b_txt) if has_bias else (v_img, v_txt)
        rows = ROWS_PER_AMAX_PROGRAM
        wrap_triton(_v_amax_kernel)[(triton.cdiv(b * sj, rows), h // group)](
            v_img, v_txt, *biases, amax, b * sj, si, sj, *strides, HAS_BIAS=has_bias, HG=group, HEAD_DIM=d, ROWS=rows,
            num_warps=4,
        )  # fmt: skip
        wrap_triton(_v_cast_kernel)[(b * sj, h // group)](
            v_img, v_txt, *biases, amax, out, descale, scale_o, img_rows, txt_rows, si, sj, h, *strides,
            HAS_BIAS=has_bias, HG=group, HEAD_DIM=d, INTERPRET=interpreter_active(), num_warps=4,
        )  # fmt: skip
        return out, amax, descale, scale_o, img_rows, txt_rows


def joint_v_quantize(v_img: torch.Tensor, v_txt: torch.Tensor, b_img: torch.Tensor | None = None,
                     b_txt: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``quantize_per_tensor(cat([v_img + b_img, v_txt + b_txt], dim=1))`` (numerics: module docstring).

    v_img: (B, S_img, H, Dh), v_txt: (B, S_txt, H, Dh) bf16 CUDA, last dim contiguous (other strides free);
    b_img / b_txt: (H, Dh) or (H * Dh,) projection biases not yet added, or None. Returns (v8 (B, S_img + S_txt,
    H, Dh) float8_e4m3fn contiguous, descale (1, 1, 1, 1) float32 = amax / 448). Raises ValueError with the
    reason where the kernels cannot run.
    """
    result = joint_v_quantize_scales(v_img, v_txt, b_img, b_txt)
    return result.v8, result.descale


def joint_v_quantize_scales(v_img: torch.Tensor, v_txt: torch.Tensor, b_img: torch.Tensor | None = None,
                            b_txt: torch.Tensor | None = None) -> JointV:
    """:func:`joint_v_quantize` with the scalars the block needs next, all written by the cast kernel
    (:class:`JointV`). Same inputs and checks."""
    b, _, h, d = v_img.shape
    capability = joint_v_quant_capability(v_img.device, d)
    if not capability.ok:
        raise ValueError(capability.reason)
    if (v_img.dtype != torch.bfloat16 or v_txt.dtype != torch.bfloat16 or v_img.stride(-1) != 1
            or v_txt.stride(-1) != 1 or v_txt.shape[0] != b or tuple(v_txt.shape[2:]) != (h, d)):
        raise ValueError(f"joint_v_quantize takes bf16 (B, S, H, Dh) inputs with a contiguous last dim and equal B, H, "
                         f"Dh, got {v_img.dtype} {tuple(v_img.shape)} strides {v_img.stride()} and {v_txt.dtype} "
                         f"{tuple(v_txt.shape)} strides {v_txt.stride()}")
    v8, _, descale, scale_o, img_rows, txt_rows = _joint_v_quantize_op(v_img, v_txt,
                                                                      *stream_biases(b_img, b_txt, v_img))
    return JointV(v8, descale, scale_o, img_rows, txt_rows)
