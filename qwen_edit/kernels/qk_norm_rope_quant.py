"""QK RMSNorm + interleaved RoPE + per-tensor e4m3 cast, written into the joint sequence (Triton, CUDA).

Before FP8 attention, each of q and k is two streams (image tokens, text tokens) of shape
(B, S_stream, H, Dh), often strided views into a fused QKV GEMM output whose bias is not yet added
(the kernel adds it, in bf16 as the linear layer would). Each goes through RMSNorm over
Dh with its stream's weight, then the rotary embedding on channel pairs (2i, 2i+1), then lands in the
joint (B, S_img + S_txt, H, Dh) sequence as e4m3 with one per-tensor scale (448 / ``bound``). Inductor
does this in three kernels (statistics, the pointwise rest, the text stream) at about 1.5 TB/s: on an
H200 about 13 ms of a 208 ms forward for q and k together (docs/decisions/0008-fused-quantization-kernels.md).
This kernel reads each
element once and writes one byte: one program per token, its heads in chunks of up to 8 (the chunks' loads
are independent), every reduction inside a warp. An earlier layout, one program per (token, 8 heads), took
40.7 us per call at the DiT's shape on an H200 against 28.3 us for this one, with identical codes: its bound
reduction and cos / sin broadcast went through shared memory with barriers, for each 1024 elements.

Numerics: those of ``qwen_edit.fast.rope.qk_norm_rope`` (compiled path) followed by
``fp8.attention.cudnn_fp8.quantize_with_bound``: RMS in float32, normalized value rounded to bf16, times
the weight rounded to bf16, rotation in float32 rounded to bf16, then ``x * (448 / bound)`` clamped and
rounded to nearest even e4m3.

Limits: CUDA tensors, bf16 inputs whose last dim is contiguous, Dh a power of two (the pair split), H
divisible by the head group (8, 4, 2 or 1). Callers check :func:`qk_norm_rope_quant_capability`.
"""

from __future__ import annotations

import functools

import torch

from ...fp8.capability import Capability
from ...fp8.gelu_quant import gelu_quant_capability
from ...fp8.quant import E4M3_MAX, FP8_DTYPE

__all__ = [
    "OP_NAME",
    "qk_norm_rope_quant_capability",
    "qk_norm_rope_quantize",
    "qk_norm_rope_quantize_scaled",
    "reference_qk_norm_rope_quantize",
    "stream_biases",
]

OP_NAME = "qwen_edit_hopper::qk_norm_rope_quantize"

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:  # pragma: no cover - depends on the torch build; gelu_quant_capability reports it
    triton = None


def _head_group(heads: int) -> int:
    return next(g for g in (8, 4, 2, 1) if heads % g == 0)


def qk_norm_rope_quant_capability(device: torch.device, head_dim: int) -> Capability:
    """Whether the kernel can run for heads of ``head_dim`` on ``device`` (CUDA, Triton, Dh a power of two)."""
    capability = gelu_quant_capability(device, head_dim)
    if not capability.ok:
        return capability
    if head_dim < 2 or head_dim & (head_dim - 1):
        return Capability.no(f"head dim {head_dim} is not a power of two")
    return Capability.yes(f"Triton QK norm + RoPE + quantize kernel on {device}")


def stream_biases(b_img: torch.Tensor | None, b_txt: torch.Tensor | None, like: torch.Tensor
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The (image, text) projection biases as contiguous (H, Dh) tensors in ``like``'s dtype ((B, S, H, Dh)
    input), a missing one as zeros (x + 0 rounds to x); (None, None) when neither is given."""
    if b_img is None and b_txt is None:
        return None, None
    heads, head_dim = like.shape[2], like.shape[3]
    zeros = torch.zeros(heads, head_dim, dtype=like.dtype, device=like.device)
    return tuple((b if b is not None else zeros).to(like.dtype).reshape(heads, head_dim).contiguous()
                 for b in (b_img, b_txt))  # fmt: skip


def reference_qk_norm_rope_quantize(x_img, x_txt, w_img, w_txt, eps_img, eps_txt, cos, sin, bound, b_img=None,
                                    b_txt=None):
    """What the kernel computes, in plain torch (any device): the block's eager math, then the e4m3 cast."""
    from ...fp8.attention.cudnn_fp8 import quantize_with_bound

    def stream(x, w, eps, c, s, bias):
        if bias is not None:
            x = x + bias.to(x.dtype)
        y = torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=eps)
        if w is not None:
            y = y * w
        pairs = y.float().unflatten(-1, (-1, 2))
        re, im = pairs[..., 0], pairs[..., 1]
        c, s = c[:, None, :], s[:, None, :]
        return torch.stack((re * c - im * s, re * s + im * c), dim=-1).flatten(-2).to(x.dtype)

    si = x_img.shape[1]
    joint = torch.cat([stream(x_img, w_img, eps_img, cos[:si], sin[:si], b_img),
                       stream(x_txt, w_txt, eps_txt, cos[si:], sin[si:], b_txt)], dim=1)  # fmt: skip
    return quantize_with_bound(joint, bound)[0]


if triton is not None:
    from ...fp8.attention.triton_fp8 import _to_e4m3, interpreter_active

    _E4M3_MAX = tl.constexpr(E4M3_MAX)
    _INV_E4M3_MAX = tl.constexpr(float(torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32)))

    @triton.jit
    def _head_chunk(src, sh, bias_ptr, w_row, cosx, sinx, eps, inv, h0, zero3, hs, dims,
                    HAS_BIAS: tl.constexpr, HG: tl.constexpr, HEAD_DIM: tl.constexpr):  # noqa: N803
        """One token's heads h0 .. h0 + HG as a (1, HG, HEAD_DIM) tile: bias, RMSNorm, weight, RoPE (bf16 roundings
        between the steps, as the block's eager math), scaled by ``inv`` and clamped to +-448, in float32."""
        x = tl.load(src + (h0 + hs) * sh + dims)
        if HAS_BIAS:  # the projection's bias, added in bf16 as the linear layer adds it
            x = (x.to(tl.float32) + tl.load(bias_ptr + (h0 + hs) * HEAD_DIM + dims + zero3).to(tl.float32))
            x = x.to(tl.bfloat16)
        x = x.to(tl.float32)
        rms = tl.rsqrt(tl.sum(x * x, axis=2) / HEAD_DIM + eps)
        y = (x * rms[:, :, None]).to(tl.bfloat16).to(tl.float32)
        y = (y * w_row).to(tl.bfloat16).to(tl.float32)
        re, im = tl.split(tl.reshape(y, (1, HG, HEAD_DIM // 2, 2)))
        swapped = tl.reshape(tl.join(-im, re), (1, HG, HEAD_DIM))  # (-x1, x0) per pair: the rotation's other term
        o = (y * cosx + swapped * sinx).to(tl.bfloat16).to(tl.float32)
        return tl.clamp(o * inv, -_E4M3_MAX, _E4M3_MAX)

    @triton.jit
    def _qk_norm_rope_quant_kernel(img_ptr, txt_ptr, w_img_ptr, w_txt_ptr, b_img_ptr, b_txt_ptr, cos_ptr, sin_ptr,
                                   bound_ptr, out_ptr, descale_ptr, s_img, s_txt, s_joint, n_img_tokens, sib, sis,
                                   sih, stb, sts, sth, eps_img, eps_txt, HEADS: tl.constexpr,  # noqa: N803
                                   HAS_BIAS: tl.constexpr, HG: tl.constexpr, HEAD_DIM: tl.constexpr,  # noqa: N803
                                   BOUND_FROM_WEIGHTS: tl.constexpr, BOUND_FACTOR: tl.constexpr,  # noqa: N803
                                   INTERPRET: tl.constexpr):  # noqa: N803
        """One program per token: programs [0, n_img_tokens) take the image stream's B * s_img tokens, the rest
        the text stream's. All HEADS heads, in chunks of HG whose loads are independent. Every tensor is laid out
        as the (1, HG, HEAD_DIM) data tile, so that no reduction or broadcast leaves a warp: the bound is taken
        per head row from weight tiles, and each pair's cos / sin is duplicated in registers."""
        pid = tl.program_id(0)
        hs = tl.arange(0, HG)[None, :, None]
        dims = tl.arange(0, HEAD_DIM)[None, None, :]
        zero3 = hs * 0 + dims * 0
        if pid < n_img_tokens:
            row = pid.to(tl.int64)
            b = row // s_img
            t = row % s_img
            src = img_ptr + b * sib + t * sis
            sh = sih
            bias_ptr = b_img_ptr
            w_ptr = w_img_ptr
            eps = eps_img
            jt = t
        else:
            row = (pid - n_img_tokens).to(tl.int64)
            b = row // s_txt
            t = row % s_txt
            src = txt_ptr + b * stb + t * sts
            sh = sth
            bias_ptr = b_txt_ptr
            w_ptr = w_txt_ptr
            eps = eps_txt
            jt = s_img + t
        wd = zero3 + dims
        w_row = tl.load(w_ptr + wd).to(tl.float32)
        if BOUND_FROM_WEIGHTS:  # rms_norm_bound of both streams' weights, per head row (all rows equal)
            w_max = tl.maximum(tl.max(tl.abs(tl.load(w_img_ptr + wd).to(tl.float32)), axis=2),
                               tl.max(tl.abs(tl.load(w_txt_ptr + wd).to(tl.float32)), axis=2))
            bound = (w_max * BOUND_FACTOR).to(tl.float32)
        else:
            bound = tl.max(tl.load(bound_ptr + zero3).to(tl.float32), axis=2)  # one value, in the tile's layout
        inv = _E4M3_MAX / bound[:, :, None]
        half = tl.arange(0, HEAD_DIM // 2)[None, :]
        c = tl.load(cos_ptr + jt * (HEAD_DIM // 2) + half)
        s = tl.load(sin_ptr + jt * (HEAD_DIM // 2) + half)
        cosx = tl.reshape(tl.join(c, c), (1, HEAD_DIM))[:, None, :] + zero3
        sinx = tl.reshape(tl.join(s, s), (1, HEAD_DIM))[:, None, :] + zero3
        dst = out_ptr + (b * s_joint + jt) * (HEADS * HEAD_DIM) + hs * HEAD_DIM + dims
        for chunk in tl.static_range(HEADS // HG):
            q = _head_chunk(src, sh, bias_ptr, w_row, cosx, sinx, eps, inv, chunk * HG, zero3, hs, dims, HAS_BIAS,
                            HG, HEAD_DIM)
            tl.store(dst + chunk * HG * HEAD_DIM, _to_e4m3(q, INTERPRET))
        if pid == 0:  # the descale, as torch's CUDA division by a scalar: times fp32(1 / 448)
            tl.store(descale_ptr + zero3, (bound * _INV_E4M3_MAX)[:, :, None] + zero3.to(tl.float32),
                     mask=(zero3 + hs + dims) == 0)

    @triton_op(OP_NAME, mutates_args={})
    def _qk_norm_rope_quantize_op(x_img: torch.Tensor, x_txt: torch.Tensor, w_img: torch.Tensor,
                                  w_txt: torch.Tensor, b_img: torch.Tensor | None, b_txt: torch.Tensor | None,
                                  eps_img: float, eps_txt: float, cos: torch.Tensor, sin: torch.Tensor,
                                  bound: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        b, si, h, d = x_img.shape
        st = x_txt.shape[1]
        out = torch.empty((b, si + st, h, d), dtype=FP8_DTYPE, device=x_img.device)
        descale = torch.empty((1,), dtype=torch.float32, device=x_img.device)
        has_bias = b_img is not None
        from_weights = bound is None
        wrap_triton(_qk_norm_rope_quant_kernel)[(b * (si + st),)](
            x_img, x_txt, w_img, w_txt, b_img if has_bias else w_img, b_txt if has_bias else w_txt, cos, sin,
            w_img if from_weights else bound, out, descale, si, st, si + st, b * si,
            x_img.stride(0), x_img.stride(1), x_img.stride(2), x_txt.stride(0), x_txt.stride(1), x_txt.stride(2),
            eps_img, eps_txt, HEADS=h, HAS_BIAS=has_bias, HG=_head_group(h), HEAD_DIM=d,
            BOUND_FROM_WEIGHTS=from_weights, BOUND_FACTOR=_bound_factor(d), INTERPRET=interpreter_active(),
            num_warps=4,
        )  # fmt: skip
        return out, descale


@functools.cache
def _bound_factor(head_dim: int) -> float:
    """:func:`...attention.cudnn_fp8.rms_norm_bound`'s factor, rounded to float32 as torch multiplies by it."""
    from ...fp8.attention.cudnn_fp8 import rms_norm_bound

    return float(torch.tensor(rms_norm_bound(None, head_dim), dtype=torch.float32))


def qk_norm_rope_quantize(x_img: torch.Tensor, x_txt: torch.Tensor, w_img: torch.Tensor | None,
                          w_txt: torch.Tensor | None, eps_img: float, eps_txt: float, cos: torch.Tensor,
                          sin: torch.Tensor, bound: torch.Tensor, b_img: torch.Tensor | None = None,
                          b_txt: torch.Tensor | None = None) -> torch.Tensor:
    """Fused RMSNorm + RoPE + e4m3 cast of one of q / k (layout and numerics: module docstring).

    x_img: (B, S_img, H, Dh), x_txt: (B, S_txt, H, Dh) bf16 CUDA, last dim contiguous (other strides free);
    w_img / w_txt: (Dh,) RMSNorm weights or None; cos, sin: (S_img + S_txt, Dh // 2) float32; bound: a
    float32 scalar tensor >= max |result|; b_img / b_txt: (H, Dh) projection biases not yet added (added
    in bf16 first), or None. Returns (B, S_img + S_txt, H, Dh) float8_e4m3fn, contiguous, in units of
    ``bound / 448``. Raises ValueError with the reason where the kernel cannot run.
    """
    return _checked_call(x_img, x_txt, w_img, w_txt, eps_img, eps_txt, cos, sin, bound, b_img, b_txt)[0]


def qk_norm_rope_quantize_scaled(x_img: torch.Tensor, x_txt: torch.Tensor, w_img: torch.Tensor | None,
                                 w_txt: torch.Tensor | None, eps_img: float, eps_txt: float, cos: torch.Tensor,
                                 sin: torch.Tensor, b_img: torch.Tensor | None = None,
                                 b_txt: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`qk_norm_rope_quantize` with the bound taken from the weights inside the kernel: the larger of
    both streams' :func:`...attention.cudnn_fp8.rms_norm_bound` (``sqrt(Dh) * 1.02 * max |w|``, of the bf16
    weights). Returns (x8, descale (1,) float32 = bound * float32(1 / 448)); saves the separate reduction
    kernels that computed the bound (two per block for q and k)."""
    return _checked_call(x_img, x_txt, w_img, w_txt, eps_img, eps_txt, cos, sin, None, b_img, b_txt)


def _checked_call(x_img, x_txt, w_img, w_txt, eps_img, eps_txt, cos, sin, bound, b_img, b_txt):
    d = x_img.shape[-1]
    capability = qk_norm_rope_quant_capability(x_img.device, d)
    if not capability.ok:
        raise ValueError(capability.reason)
    if x_img.dtype != torch.bfloat16 or x_txt.dtype != torch.bfloat16 or x_img.stride(-1) != 1 or x_txt.stride(-1) != 1:
        raise ValueError(f"qk_norm_rope_quantize takes bf16 (B, S, H, Dh) inputs with a contiguous last dim, got "
                         f"{x_img.dtype} strides {x_img.stride()} and {x_txt.dtype} strides {x_txt.stride()}")
    ones = None if w_img is not None and w_txt is not None else torch.ones(d, dtype=x_img.dtype, device=x_img.device)
    biases = stream_biases(b_img, b_txt, x_img)
    return _qk_norm_rope_quantize_op(
        x_img, x_txt, (w_img if w_img is not None else ones).to(x_img.dtype).contiguous(),
        (w_txt if w_txt is not None else ones).to(x_img.dtype).contiguous(), *biases, float(eps_img),
        float(eps_txt), cos.float().contiguous(), sin.float().contiguous(),
        None if bound is None else bound.float().reshape(1),
    )  # fmt: skip
