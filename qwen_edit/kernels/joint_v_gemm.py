"""The image stream's v projection written straight into FP8 attention's joint e4m3 v, scale from a bound (Triton).

cuDNN's FP8 attention takes v as one per-tensor-scaled e4m3 tensor over the joint sequence ``[image; text]``. The
shipped alternative (:mod:`.joint_v_quant`) has the v GEMM write bf16 (50 MB per block at 8192 tokens), then reads it
twice: a max pass for the scale and a cast into the joint sequence. Here the scale is known before the GEMM:

* by Cauchy-Schwarz, ``|v[t, j]| <= ||x[t]|| * ||W[j]|| + |b[j]|`` for each stream (x, W dequantized);
* so ``bound = max over both streams of (max_t ||x[t]|| * max_j ||W[j]|| + max_j |b[j]|) * BOUND_MARGIN``.

The row norms (upper bounds of them) come from the LayerNorm kernels that quantized each stream's input
(:mod:`...fp8.norm_quant`, ``with_norms``); the weight side from each layer's ``column_bound``
(:func:`...fp8.gelu_gemm.column_bound`; for the text stream's fused Q/K/V layer it covers all three projections, a
looser but valid bound). e4m3 is a float format: a loose scale only moves the codes down the exponent range
(about 14x, 4 of 15 binades, measured on Gaussian data).

Two kernels, in this order on one stream:

1. the GEMM (persistent, TMA, the tiles of :data:`...fp8.gelu_gemm.CONFIG`): every program takes the max of both
   streams' norms (8192 + 300 floats, from L2), forms the bound, and stores e4m3
   ``(acc * x_scale * w_scale + b) * 448 / bound`` into the joint sequence at row ``b * S_joint + t``; program 0
   writes the descale (``bound / 448``) and cuDNN's output scale (``448 / bound``), the first column block's tiles
   the image rows' scales for the output projection;
2. the text rows: bias + the same scale + the cast, one program per text token, and the text rows' scales.

Numerics: the product, scales and bias in float32 (the shipped path rounds the GEMM output and the bias sum to
bf16 first), one rounding to e4m3 (nearest even, saturating, though the bound keeps every value inside).

Limits: those of :func:`...fp8.gelu_gemm.gelu_gemm_capability`, plus: image tokens per sample a multiple of the
tile's 128 rows (a tile never spans two samples; 1024x1024 gives 8192), and the text stream's v (B, L, H, Dh) bf16
with rows of H * Dh contiguous values. Callers check :func:`joint_v_gemm_capability`. Registered as the custom op
``qwen_edit_hopper::joint_v_gemm`` (``torch.library.custom_op``).
"""

from __future__ import annotations

import torch

from ...fp8.capability import Capability
from ...fp8.gelu_gemm import _TRITON_MISSING, BOUND_MARGIN, CONFIG, gelu_gemm_capability
from ...fp8.quant import E4M3_MAX, FP8_DTYPE
from .joint_v_quant import JointV

__all__ = ["MIN_IMAGE_ROWS", "OP_NAME", "joint_v_gemm", "joint_v_gemm_capability", "reference_joint_v_gemm"]

OP_NAME = "qwen_edit_hopper::joint_v_gemm"

_NORM_CHUNK = 1024
"""Norms per step of each program's max over a stream's row norms."""

_TEXT_BLOCK = 1024
"""Columns per step of the text-row cast."""

MIN_IMAGE_ROWS = 1024
"""Fewest image rows (tokens x batch) the joint v GEMM is used for (its 128-row tiles; measured at 2048 and more)."""

_SCALAR_SLOTS, _SCALE_O_SLOT = 5, 4
"""The op's scalars: float32 [descale, -, -, -, scale_o], cuDNN's output scale 16 bytes in. Inductor marks a view that
starts at an offset not a multiple of 16 bytes (as ``[1:2]`` would) unaligned, then every buffer computed from it:
the attention output, the residual updates after it and the LayerNorm kernel's input (no vector loads there)."""

if _TRITON_MISSING is None:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ...fp8.gelu_gemm import _scaled_tile


def v_scale_bound(norms_img: torch.Tensor, col_bound_img: torch.Tensor, norms_txt: torch.Tensor,
                  col_bound_txt: torch.Tensor) -> torch.Tensor:
    """0-dim float32: the bound both kernels form (module docstring), in torch ops."""
    img = norms_img.float().max() * col_bound_img[0] + col_bound_img[1]
    txt = (norms_txt.float().max() if norms_txt.numel() else torch.zeros((), device=norms_img.device)) \
        * col_bound_txt[0] + col_bound_txt[1]
    return (torch.maximum(img, txt) * BOUND_MARGIN).clamp_min(1e-30)


def reference_joint_v_gemm(x8: torch.Tensor, x_scale: torch.Tensor, norms_img: torch.Tensor, w8: torch.Tensor,
                           w_scale: torch.Tensor, bias: torch.Tensor | None, col_bound_img: torch.Tensor,
                           v_txt: torch.Tensor, b_txt: torch.Tensor | None, norms_txt: torch.Tensor,
                           col_bound_txt: torch.Tensor) -> JointV:
    """What the kernels compute, in float32 torch ops (any device). Arguments: :func:`joint_v_gemm`'s."""
    b, length, heads, head_dim = v_txt.shape
    width = heads * head_dim
    s_img = x8.shape[0] // b
    bound = v_scale_bound(norms_img, col_bound_img, norms_txt, col_bound_txt)
    img = (x8.float() * x_scale.reshape(-1, 1).float()) @ (w8.float() * w_scale.reshape(-1, 1).float()).t()
    if bias is not None:
        img = img + bias.float()
    txt = v_txt.float().reshape(b, length, width)
    if b_txt is not None:
        txt = txt + b_txt.float().reshape(width)
    joint = torch.cat([img.reshape(b, s_img, width), txt], dim=1) * (E4M3_MAX / bound)
    v8 = joint.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE).reshape(b, s_img + length, heads, head_dim)
    descale = (bound / E4M3_MAX).reshape(1, 1, 1, 1)
    return JointV(v8, descale, (E4M3_MAX / bound).reshape(1, 1, 1, 1), descale.reshape(1, 1).expand(b * s_img, 1),
                  descale.reshape(1, 1).expand(b * length, 1))


def joint_v_gemm_capability(x8: torch.Tensor, w8: torch.Tensor, fast_accum: bool, image_tokens: int,
                            v_txt: torch.Tensor) -> Capability:
    """Whether :func:`joint_v_gemm` can run for these operands (those of the fused GELU GEMM, whole 128-row tiles
    per sample, the text v's layout)."""
    capability = gelu_gemm_capability(x8, w8, fast_accum)
    if not capability.ok:
        return capability
    if image_tokens % CONFIG[0]:
        return Capability.no(f"{image_tokens} image tokens per sample: not a multiple of the {CONFIG[0]}-row tiles")
    if v_txt.dtype != torch.bfloat16 or v_txt.dim() != 4 or v_txt.shape[2] * v_txt.shape[3] != w8.shape[0]:
        return Capability.no(f"the text stream's v must be (B, L, H, Dh) bf16 with H * Dh = {w8.shape[0]}, got "
                             f"{v_txt.dtype} {tuple(v_txt.shape)}")
    if v_txt.stride(3) != 1 or v_txt.stride(2) != v_txt.shape[3]:
        return Capability.no("the text stream's v needs rows of H * Dh contiguous values")
    return Capability.yes("Triton joint v GEMM with TMA on Hopper")

if _TRITON_MISSING is None:

    @triton.jit
    def _norm_max(ptr, n, CHUNK: tl.constexpr):  # noqa: N803
        peak = tl.zeros((CHUNK,), tl.float32)
        for i in range(0, n, CHUNK):
            offs = i + tl.arange(0, CHUNK)
            peak = tl.maximum(peak, tl.load(ptr + offs, mask=offs < n, other=0.0))
        return tl.max(peak, axis=0)

    @triton.jit
    def _joint_v_gemm_kernel(a_desc, b_desc, c_desc, xs_ptr, ws_ptr, bias_ptr, ni_ptr, nt_ptr, cbi_ptr,
                             cbt_ptr, rows_ptr, scal_ptr, M, N, K, n_txt, s_img, s_joint, margin,  # noqa: N803
                             HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,  # noqa: N803
                             BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,  # noqa: N803
                             CHUNK: tl.constexpr, SCALE_O_SLOT: tl.constexpr):  # noqa: N803
        start = tl.program_id(0)
        bound_img = _norm_max(ni_ptr, M, CHUNK) * tl.load(cbi_ptr) + tl.load(cbi_ptr + 1)
        bound_txt = _norm_max(nt_ptr, n_txt, CHUNK) * tl.load(cbt_ptr) + tl.load(cbt_ptr + 1)
        bound = tl.maximum(tl.maximum(bound_img, bound_txt) * margin, 1e-30)
        inv = 448.0 / bound
        descale = bound / 448.0
        if start == 0:
            tl.store(scal_ptr, descale)
            tl.store(scal_ptr + SCALE_O_SLOT, inv)
        for tile_id in tl.range(start, tl.cdiv(M, BM) * tl.cdiv(N, BN), NUM_SMS, flatten=True):
            y, rows, row_ok, om, on, pid_n = _scaled_tile(a_desc, b_desc, xs_ptr, ws_ptr, bias_ptr, tile_id, M, N, K,
                                                          HAS_BIAS, BM, BN, BK, GROUP_M)
            code = tl.clamp(y * inv, -448.0, 448.0)
            c_desc.store([(om // s_img) * s_joint + om % s_img, on], code.to(tl.float8e4nv))
            tl.store(rows_ptr + rows, tl.zeros((BM,), tl.float32) + descale, mask=row_ok & (pid_n == 0))

    @triton.jit
    def _text_v_cast_kernel(v_ptr, stride_b, stride_t, bias_ptr, scal_ptr, out_ptr, rows_ptr, length, s_img,
                            s_joint, N: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,  # noqa: N803
                            SCALE_O_SLOT: tl.constexpr):  # noqa: N803
        row = tl.program_id(0)
        b = row // length
        t = row % length
        descale = tl.load(scal_ptr)
        inv = tl.load(scal_ptr + SCALE_O_SLOT)
        src = v_ptr + b.to(tl.int64) * stride_b + t.to(tl.int64) * stride_t
        dst = out_ptr + (b.to(tl.int64) * s_joint + s_img + t) * N
        for start in tl.static_range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < N
            x = tl.load(src + cols, mask=ok, other=0.0).to(tl.float32)
            if HAS_BIAS:
                x = x + tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(dst + cols, tl.clamp(x * inv, -448.0, 448.0).to(tl.float8e4nv), mask=ok)
        tl.store(rows_ptr + row, descale)

    @torch.library.custom_op(OP_NAME, mutates_args=())
    def _joint_v_gemm_op(x8: torch.Tensor, x_scale: torch.Tensor, norms_img: torch.Tensor, w8: torch.Tensor,
                         w_scale: torch.Tensor, bias: torch.Tensor | None, col_bound_img: torch.Tensor,
                         v_txt: torch.Tensor, b_txt: torch.Tensor | None, norms_txt: torch.Tensor,
                         col_bound_txt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        b, length, heads, head_dim = v_txt.shape
        m, k = x8.shape
        n = w8.shape[0]
        s_img = m // b
        s_joint = s_img + length
        bm, bn, bk, warps, stages, group_m = CONFIG
        f32 = {"dtype": torch.float32, "device": x8.device}
        out = torch.empty((b * s_joint, n), dtype=FP8_DTYPE, device=x8.device)
        scal = torch.empty((_SCALAR_SLOTS,), **f32)
        img_rows, txt_rows = torch.empty((m, 1), **f32), torch.empty((b * length, 1), **f32)
        num_sms = torch.cuda.get_device_properties(x8.device).multi_processor_count
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        _joint_v_gemm_kernel[(min(num_sms, tiles),)](
            TensorDescriptor.from_tensor(x8, [bm, bk]), TensorDescriptor.from_tensor(w8, [bn, bk]),
            TensorDescriptor.from_tensor(out, [bm, bn]), x_scale, w_scale, bias if bias is not None else w_scale,
            norms_img, norms_txt, col_bound_img, col_bound_txt, img_rows, scal, m, n, k, norms_txt.numel(), s_img,
            s_joint, BOUND_MARGIN, HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk, GROUP_M=group_m,
            NUM_SMS=num_sms, CHUNK=_NORM_CHUNK, SCALE_O_SLOT=_SCALE_O_SLOT, num_warps=warps, num_stages=stages)
        if b * length:
            _text_v_cast_kernel[(b * length,)](
                v_txt, v_txt.stride(0), v_txt.stride(1), b_txt if b_txt is not None else scal, scal, out, txt_rows,
                length, s_img, s_joint, N=n, HAS_BIAS=b_txt is not None, BLOCK=_TEXT_BLOCK,
                SCALE_O_SLOT=_SCALE_O_SLOT, num_warps=4)
        return out.reshape(b, s_joint, heads, head_dim), scal, img_rows, txt_rows

    @_joint_v_gemm_op.register_fake
    def _(x8, x_scale, norms_img, w8, w_scale, bias, col_bound_img, v_txt, b_txt, norms_txt, col_bound_txt):
        b, length, heads, head_dim = v_txt.shape
        f32 = {"dtype": torch.float32, "device": x8.device}
        s_joint = x8.shape[0] // b + length
        return (torch.empty((b, s_joint, heads, head_dim), dtype=FP8_DTYPE, device=x8.device),
                torch.empty((_SCALAR_SLOTS,), **f32), torch.empty((x8.shape[0], 1), **f32),
                torch.empty((b * length, 1), **f32))


def joint_v_gemm(x8: torch.Tensor, x_scale: torch.Tensor, norms_img: torch.Tensor, w8: torch.Tensor,
                 w_scale: torch.Tensor, bias: torch.Tensor | None, col_bound_img: torch.Tensor, v_txt: torch.Tensor,
                 b_txt: torch.Tensor | None, norms_txt: torch.Tensor, col_bound_txt: torch.Tensor) -> JointV:
    """The joint e4m3 v for cuDNN's FP8 attention: the image stream's v GEMM and the text stream's cast, one scale.

    x8: (B * S_img, K) e4m3 image-stream input, x_scale / norms_img: (B * S_img, 1) float32 its row scales and row
    norms; w8: (N, K) e4m3 v weight, w_scale: (N, 1) float32, bias: (N,) or None, col_bound_img: its
    :func:`...fp8.gelu_gemm.column_bound`; v_txt: (B, L, H, Dh) bf16 text-stream v without its bias, b_txt: (H, Dh) or
    (N,) or None, norms_txt: (B * L, 1) float32 the text input's row norms, col_bound_txt: the text v layer's column
    bound. Returns :class:`.joint_v_quant.JointV` (v8 (B, S_img + L, H, Dh) e4m3, descale, cuDNN's output scale, the
    image and text rows' scales). Raises ValueError naming the reason where it cannot run
    (:func:`joint_v_gemm_capability`).
    """
    b = v_txt.shape[0]
    capability = joint_v_gemm_capability(x8, w8, True, x8.shape[0] // max(b, 1), v_txt)
    if capability.ok and x8.shape[0] % b:
        capability = Capability.no(f"{x8.shape[0]} image rows do not split into {b} samples")
    if not capability.ok:
        raise ValueError(f"joint_v_gemm: {capability.reason}")
    n = w8.shape[0]
    v8, scal, img_rows, txt_rows = _joint_v_gemm_op(
        x8, x_scale.reshape(-1).float().contiguous(), norms_img.reshape(-1).float().contiguous(), w8,
        w_scale.reshape(n).float().contiguous(), bias.contiguous() if bias is not None else None,
        col_bound_img.float().contiguous(), v_txt, None if b_txt is None else b_txt.reshape(n).contiguous(),
        norms_txt.reshape(-1).float().contiguous(), col_bound_txt.float().contiguous())
    return JointV(v8, scal[0:1].reshape(1, 1, 1, 1), scal[_SCALE_O_SLOT:_SCALE_O_SLOT + 1].reshape(1, 1, 1, 1),
                  img_rows, txt_rows)
