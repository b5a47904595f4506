"""The block's joint attention through cuDNN's FP8 kernel (backend ``cudnn_fp8``), quantization folded in.

The generic ``fp8.attention.attention(q, k, v, "cudnn_fp8")`` finds each scale with a pass over the
tensor and dequantizes the output. Inside a block neither pass is needed:

* q and k come out of RMSNorm + RoPE, so |q| <= sqrt(Dh) * max |norm weight|
  (:func:`...fp8.attention.cudnn_fp8.rms_norm_bound`): a static per-tensor scale. Where the kernel plan has
  ``qk_quant``, one Triton kernel per q / k (:mod:`..kernels.qk_norm_rope_quant`) reads both streams'
  projections, takes the bound from the RMSNorm weights and writes the joint e4m3 sequence and its descale;
  otherwise the same math runs in torch ops;
* v has no such bound: its per-tensor max, then the cast into the joint sequence, with the projection
  biases added on the way. Where the plan has ``v_quant``, two Triton kernels (:mod:`..kernels.joint_v_quant`),
  the cast kernel also writing 1 / descale (cuDNN's output scale) and the output projections' row scales;
  otherwise torch ops. Where the plan has ``joint_v_gemm`` the block's image v GEMM already wrote the joint v
  (:mod:`..kernels.joint_v_gemm`, :func:`joint_v_layers`);
* the e4m3 output, in units of v's scale, feeds the row-wise fp8 output projections directly as a
  :class:`.prequant.Prequantized` with that scale on every row, when both output projections are
  row-wise fp8 GEMMs; otherwise it is dequantized to bf16.

Shapes: q, k and v arrive per stream (image, text), q and k before their RMSNorm; all bf16. Right-padded text
(``txt_lens``, true CFG's two prompts): one batched kernel call with cuDNN's padding mask (per-sample
key lengths), so batch 2 also hands fp8 to the output projections. ``text_padding="mask"`` (an SDPA
boolean mask) is refused for ``cudnn_fp8`` before any work: its ``split`` mode is the padding mask.
"""

from __future__ import annotations

import torch

from ...fp8.attention.cudnn_fp8 import attention_quantized, quantize_with_bound, rms_norm_bound
from ...fp8.linear import ScaledMMLinear
from ..kernels.joint_v_quant import JointV, joint_v_quantize_scales, reference_joint_v_quantize
from ..kernels.qk_norm_rope_quant import qk_norm_rope_quantize_scaled
from .block_kernels import BlockKernels
from .prequant import Prequantized
from .rope import qk_norm_rope, with_bias

__all__ = ["Fp8AttentionOutput", "cudnn_fp8_joint_attention", "joint_v_layers", "split_output"]


class Fp8AttentionOutput:
    """e4m3 attention output (B, S, H * Dh) and its float32 descale (1, 1): value = out8.float() * descale.
    ``row_scales``: (image rows (B * S_img, 1), text rows (B * S_txt, 1)) float32 tensors filled with the
    descale, when the v kernel wrote them; otherwise :func:`split_output` expands the descale."""

    def __init__(self, out8: torch.Tensor, descale: torch.Tensor,
                 row_scales: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.out8, self.descale, self.row_scales = out8, descale, row_scales


def joint_v_layers(img_qkv: tuple[torch.nn.Module, ...], txt_qkv: tuple[torch.nn.Module, ...]
                   ) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(the image v layer, the text layer holding v) when their kind lets :func:`..kernels.joint_v_gemm.joint_v_gemm`
    make the joint v: three image projections, and fast-accumulation row-wise fp8 layers (not emulated) with a
    ``column_bound`` (kept for CUDA layers); else None. The kernel plan checks the rest (``joint_v_gemm``: the
    ``cudnn_fp8`` backend, Hopper, whole 128-row tiles, enough rows); the inputs must then arrive quantized with
    row norms (the caller asks the LayerNorm kernels for them)."""
    if len(img_qkv) != 3:
        return None
    v_img, v_txt = img_qkv[2], txt_qkv[-1]
    for layer in (v_img, v_txt):
        if (not isinstance(layer, ScaledMMLinear) or layer.granularity != "rowwise" or layer.emulate
                or not layer.fast_accum or layer.column_bound is None):
            return None
    return v_img, v_txt


def _joint_bound(attn: torch.nn.Module, norms: tuple[str, str], head_dim: int, device: torch.device) -> torch.Tensor:
    """One bound for the joint q (or k): the larger of the image and text streams' RMSNorm bounds."""
    bounds = [rms_norm_bound(getattr(getattr(attn, name), "weight", None), head_dim) for name in norms]
    return torch.maximum(*(torch.as_tensor(b, dtype=torch.float32, device=device) for b in bounds))


def _norm_rope_quantize(attn: torch.nn.Module, parts: tuple[torch.Tensor, torch.Tensor], norms: tuple[str, str],
                        cos: torch.Tensor, sin: torch.Tensor, fused: bool,
                        biases: tuple[torch.Tensor | None, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """One of q / k: both streams (plus their projection biases, if not yet added) through their RMSNorm and
    RoPE into the joint e4m3 sequence, and its descale. ``fused``: the Triton kernel, which also takes the bound
    from the RMSNorm weights."""
    image, text = parts
    n_img, n_txt = (getattr(attn, name) for name in norms)
    if fused:
        x8, descale = qk_norm_rope_quantize_scaled(image, text, n_img.weight, n_txt.weight, n_img.eps, n_txt.eps,
                                                   cos, sin, *biases)  # fmt: skip
        return x8, descale.reshape(1, 1, 1, 1)
    bound = _joint_bound(attn, norms, image.shape[-1], image.device)
    image, text = with_bias(image, biases[0]), with_bias(text, biases[1])
    si = image.shape[1]
    joint = torch.cat([qk_norm_rope(image, n_img.weight, n_img.eps, cos[:si], sin[:si]),
                       qk_norm_rope(text, n_txt.weight, n_txt.eps, cos[si:], sin[si:])], dim=1)  # fmt: skip
    return quantize_with_bound(joint, bound)


def cudnn_fp8_joint_attention(
    attn: torch.nn.Module,
    q_parts: tuple[torch.Tensor, torch.Tensor],
    k_parts: tuple[torch.Tensor, torch.Tensor],
    v_parts: tuple[torch.Tensor, torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    txt_lens: tuple[torch.Tensor, ...] | None,
    fp8_output: bool,
    kernels: BlockKernels,
    emulate: bool = False,
    q_biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    k_biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    v_biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    v_joint: JointV | None = None,
    query_tokens: torch.Tensor | None = None,
) -> torch.Tensor | Fp8AttentionOutput:
    """Attention over the joint sequence; (B, S, H * Dh) bf16, or :class:`Fp8AttentionOutput` when
    ``fp8_output``. With ``txt_lens`` (right-padded text, :func:`.block.length_carriers`) one batched call
    whose padding mask hides each sample's padded keys; padded query rows get finite values that the
    forward discards (as with the SDPA key mask).

    attn: the block's attention module (its ``norm_q`` / ``norm_added_q`` / ``norm_k`` / ``norm_added_k``
    RMSNorms). q_parts, k_parts, v_parts: (image, text) projections (q and k before QK RMSNorm and RoPE),
    (B, S_img, H, Dh) and (B, L, H, Dh) bf16, any strides with Dh contiguous; S = S_img + L.
    cos, sin: (S, Dh // 2) float32 RoPE tables. ``kernels``: the block's kernel plan (``qk_quant``, ``v_quant``).
    ``emulate``: the kernel's fp32 mirror instead of cuDNN (backend ``cudnn_fp8_emulated``). q_biases, k_biases,
    v_biases: (image, text) (H, Dh) projection biases that the parts do not include yet, or None. v_joint: the joint
    e4m3 v already made (:func:`..kernels.joint_v_gemm.joint_v_gemm`); ``v_parts`` and ``v_biases`` are then not
    read. query_tokens: None, or a (T, 0) size carrier: only each sample's first T query rows are computed (cuDNN
    gets q's first T rows and every key), for a caller that reads only those; the output then holds T rows per
    sample.
    """
    image_tokens = q_parts[0].shape[1]
    q_img = q_parts[0]
    q8, dq = _norm_rope_quantize(attn, q_parts, ("norm_q", "norm_added_q"), cos, sin, kernels.qk_quant, q_biases)
    k8, dk = _norm_rope_quantize(attn, k_parts, ("norm_k", "norm_added_k"), cos, sin, kernels.qk_quant, k_biases)
    scale_o = row_scales = None
    if v_joint is not None:  # the v GEMM wrote the joint e4m3 v and its scalars
        v8, dv, scale_o, row_scales = v_joint.v8, v_joint.descale, v_joint.scale_o, (v_joint.image_rows,
                                                                                    v_joint.text_rows)
    elif kernels.v_quant:  # the cast kernel also writes 1 / descale and the output rows' scales
        v = joint_v_quantize_scales(*v_parts, *v_biases)
        v8, dv, scale_o, row_scales = v.v8, v.descale, v.scale_o, (v.image_rows, v.text_rows)
    else:
        v8, dv = reference_joint_v_quantize(*v_parts, *v_biases)
    q8, k8, v8 = q8.transpose(1, 2), k8.transpose(1, 2), v8.transpose(1, 2)
    lengths = None
    if txt_lens is not None:
        # device fills, not torch.tensor(list): no host-to-device copy, so a CUDA graph can capture it
        lengths = torch.cat([torch.full((1,), image_tokens + c.shape[0], dtype=torch.int32, device=q_img.device)
                             for c in txt_lens])  # fmt: skip
    if query_tokens is not None:  # the first T query rows against every key
        q8 = q8[:, :, : query_tokens.shape[0]]
    out8 = attention_quantized(q8, k8, v8, dq, dk, dv, emulate, lengths, scale_o)
    if fp8_output:
        return Fp8AttentionOutput(out8, dv.reshape(1, 1), row_scales)
    return (out8.float() * dv.reshape(1, 1)).to(q_img.dtype)


def _token_rows(out: Fp8AttentionOutput, first: int, stop: int, row_scale: torch.Tensor | None) -> Prequantized:
    """Tokens [first, stop) of each sample of ``out`` as a :class:`Prequantized` ((B * n, K) e4m3 and row scales)."""
    o8 = out.out8
    b, _, width = o8.shape
    rows = o8[:, first:stop]
    n = rows.shape[1]
    if row_scale is None:
        scale = out.descale.expand(b * n, 1).contiguous()
    else:  # every row scale holds the one descale: the first b * n of them serve any b * n rows
        scale = row_scale if row_scale.shape[0] == b * n else row_scale[: b * n]
    return Prequantized(rows.reshape(b * n, width), scale, b, n)


def split_output(out: torch.Tensor | Fp8AttentionOutput, image_tokens: int, image_kept: int | None = None
                 ) -> tuple[torch.Tensor | Prequantized, torch.Tensor | Prequantized | None]:
    """The image rows and the text rows of the joint attention output, as the output projections' inputs.

    bf16 (B, S, K) -> two views. :class:`Fp8AttentionOutput` -> two :class:`Prequantized` (rows, K) e4m3
    with the per-tensor descale repeated as a (rows, 1) row-wise scale. ``image_kept`` (the last block): only each
    sample's first ``image_kept`` tokens, which ``out`` may hold alone (attention for those query rows only), and
    None for the text rows.
    """
    kept = image_tokens if image_kept is None else image_kept
    if not isinstance(out, Fp8AttentionOutput):
        return out[:, :kept], (None if image_kept is not None else out[:, image_tokens:])
    scales = out.row_scales or (None, None)
    image = _token_rows(out, 0, kept, scales[0])
    if image_kept is not None:
        return image, None
    return image, _token_rows(out, image_tokens, out.out8.shape[1], scales[1])
