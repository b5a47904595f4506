"""One Qwen-Image transformer block as a plain function: DiffSynth's ``QwenImageTransformerBlock`` math.

:func:`fast_block` computes what ``QwenImageTransformerBlock.forward`` computes (modulation,
LayerNorm, Q/K/V, QK RMSNorm, RoPE, joint attention, output projections, gated residuals, MLPs)
for a batch, written so that ``torch.compile`` turns the elementwise work into few kernels:

* Q/K/V: one GEMM per stream when the block has a fused layer (:func:`.qkv.fuse_qkv`, ``attn.to_qkv``,
  ``attn.add_qkv_proj``), else DiffSynth's three.
* QK RMSNorm and RoPE in one pass per q/k (:func:`.rope.qk_norm_rope`, real cos/sin, no complex ops),
  writing straight into the joint sequence.
* modulation: the six shift/scale/gate vectors of each stream come from one GEMM and are views
  (no copies); ``norm -> (1 + scale) * x + shift`` is one ``addcmul`` and the gated residuals are
  ``addcmul`` too (one pass each in eager, fused into neighbours by Inductor).
* attention through :func:`...fp8.attention.attention` (the user's backend) on the joint sequence
  ``[image, text]``; right-padded text is handled per sample (valid keys only) or by an SDPA key mask.
  ``cudnn_fp8`` goes through :mod:`.fp8_attention` instead, which folds its quantization into the block.

The fused kernels it may use come in ``kernels`` (:class:`.block_kernels.BlockKernels`, decided by
:func:`.kernel_plan.select_kernels`); each runs where the block's layers are the kind it is written for:

* with row-wise fp8 consumers, LayerNorm + modulation + quantization of each stream's attention and MLP input in
  one Triton kernel (:mod:`.prequant`), shared by Q/K/V; before the MLP the same kernel also applies the gated
  residual update of the attention output;
* the MLP through :func:`.mlp.mlp_residual`: bias + GELU + quantization of the hidden state in one Triton kernel,
  or the whole up-projection in the fused GELU GEMM;
* gated residual updates in the output projections' cuBLASLt epilogue (:mod:`.residual_gemm`);
* with ``cudnn_fp8``, the QK and v kernels of :mod:`.fp8_attention` and the joint v GEMM.

No ``.item()`` / ``.tolist()``: nothing here syncs with the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...fp8.attention import attention
from ..kernels.joint_v_gemm import joint_v_gemm
from .block_kernels import BlockKernels
from .fp8_attention import cudnn_fp8_joint_attention, joint_v_layers, split_output
from .mlp import mlp_residual, mlp_takes_prequantized, uses_gelu_gemm
from .prequant import (
    Prequantized,
    apply_linear,
    modulated_input,
    residual_then_modulated,
    takes_prequantized,
    unbiased_output,
)
from .qkv import FUSED_IMAGE, FUSED_TEXT
from .rope import qk_norm_rope

MASK_BACKENDS: dict[str, SDPBackend | None] = {
    "sdpa": None,
    "sdpa_math": SDPBackend.MATH,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
}
"""Attention backends that take a key mask (``text_padding="mask"``): SDPA, PyTorch's choice or forced."""


def _mod_params(mod: torch.Tensor, dim: int, selector: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Six (shift, scale, gate) x (attention, MLP) vectors from a modulation GEMM output.

    mod: (Bm, 6 * dim). Without ``selector``: six (Bm, 1, dim) views. With ``selector`` (1, S, 1) bool
    (zero_cond_t): ``mod`` is (2 * Bt, 6 * dim), rows ``[:Bt]`` for the real timestep (target tokens,
    selector True) and ``[Bt:]`` for timestep 0 (reference tokens); each output is (Bt, S, dim).
    """
    p = mod.unflatten(-1, (6, dim)).unsqueeze(1)
    if selector is None:
        return p.unbind(2)
    n = p.shape[0] // 2
    first, second = p[:n], p[n:]
    return tuple(torch.where(selector, first[:, :, j], second[:, :, j]) for j in range(6))


def qkv_layers(attn: torch.nn.Module, image_stream: bool) -> tuple[torch.nn.Module, ...]:
    """The fused QKV linear of one stream, or its three projections."""
    fused = getattr(attn, FUSED_IMAGE if image_stream else FUSED_TEXT, None)
    if fused is not None:
        return (fused,)
    return (attn.to_q, attn.to_k, attn.to_v) if image_stream else (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)


def head_shape(attn: torch.nn.Module) -> tuple[int, int]:
    """(heads, head_dim) of a block's attention: DiffSynth's ``num_heads`` / ``head_dim``, or ComfyUI's ``heads`` /
    ``dim_head`` (``comfy.ldm.qwen_image.model.Attention``)."""
    if hasattr(attn, "num_heads"):
        return attn.num_heads, attn.head_dim
    return attn.heads, attn.dim_head


def _qkv(attn: torch.nn.Module, layers: tuple[torch.nn.Module, ...], x: torch.Tensor | Prequantized,
         kernels: BlockKernels) -> tuple[torch.Tensor, ...]:
    """q, k, v of one stream, each (B, S, H, Dh) (views into one GEMM output when fused)."""
    heads, head_dim = head_shape(attn)
    if len(layers) == 1:
        return apply_linear(layers[0], x, kernels).unflatten(-1, (3, heads, head_dim)).unbind(2)
    return tuple(apply_linear(p, x, kernels).unflatten(-1, (heads, head_dim)) for p in layers)


def _qkv_unbiased(attn: torch.nn.Module, layers: tuple[torch.nn.Module, ...], x: torch.Tensor | Prequantized,
                  kernels: BlockKernels) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...]]:
    """Like :func:`_qkv`, but a row-wise fp8 layer's bias is left out and returned, (H, Dh) per q / k / v,
    for the consumer to add in its own pass (:func:`.prequant.unbiased_output`); None where it was added."""
    heads, head_dim = head_shape(attn)
    b, s = (x.batch, x.tokens) if isinstance(x, Prequantized) else x.shape[:2]
    flat = x if isinstance(x, Prequantized) else x.reshape(-1, x.shape[-1])
    outputs = [unbiased_output(layer, flat, kernels) for layer in layers]
    if len(layers) == 1:
        y, bias = outputs[0]
        biases = (None,) * 3 if bias is None else bias.reshape(3, heads, head_dim).unbind(0)
        return y.reshape(b, s, 3, heads, head_dim).unbind(2), biases
    return (tuple(y.reshape(b, s, heads, head_dim) for y, _ in outputs),
            tuple(None if bias is None else bias.reshape(heads, head_dim) for _, bias in outputs))


def length_carriers(lens: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Valid text lengths as tensor sizes: one (n_i, 0) tensor per sample (zero elements, no memory).

    A Python int argument makes dynamo specialize the graph on its value (and recompile when a new prompt
    length comes); a tensor size can be marked dynamic like the sequence dims.
    """
    return tuple(torch.empty((n, 0), device=device) for n in lens)


def joint_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    image_tokens: int,
    txt_lens: tuple[torch.Tensor, ...] | None,
    key_mask: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    """Attention over ``[image, text]`` with right-padded text; returns (B, S, H * Dh).

    q, k, v: (B, H, S, Dh), S = image_tokens + L.

    * ``key_mask`` (B, 1, 1, S) bool given: one SDPA call with the mask (``backend`` in
      :data:`MASK_BACKENDS`); padded query rows get finite outputs that are discarded later.
    * ``txt_lens`` given (length carriers, see :func:`length_carriers`): per sample, attention over its
      first ``image_tokens + txt_lens[i].shape[0]`` tokens through ``fp8.attention.attention(backend)``
      (every backend, exact, no mask); padded query rows are zero.
    * neither: one batched ``fp8.attention.attention`` call (no padding anywhere).
    """
    if key_mask is not None:
        kind = MASK_BACKENDS[backend]
        if kind is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        else:
            with sdpa_kernel([kind]):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return out.transpose(1, 2).flatten(2)
    if txt_lens is None:
        return attention(q, k, v, backend)
    return per_sample_attention(
        lambda i, valid: attention(q[i : i + 1, :, :valid], k[i : i + 1, :, :valid], v[i : i + 1, :, :valid], backend),
        image_tokens, txt_lens, q.shape[2])


def per_sample_attention(
    attend: Callable[[int, int], torch.Tensor],
    image_tokens: int,
    txt_lens: tuple[torch.Tensor, ...],
    total: int,
) -> torch.Tensor:
    """Each sample's attention over its own first ``image_tokens + txt_lens[i].shape[0]`` tokens, stacked.

    ``attend(i, valid)`` returns sample i's (1, valid, C) output (any dtype); its rows past ``valid`` up to ``total``
    are zero in the (B, total, C) result (padded query rows, discarded later).
    """
    outs = []
    for i, carrier in enumerate(txt_lens):
        valid = image_tokens + carrier.shape[0]
        outs.append(F.pad(attend(i, valid), (0, 0, 0, total - valid)))
    return torch.cat(outs, dim=0)


def fast_block(
    block: torch.nn.Module,
    image: torch.Tensor,
    text: torch.Tensor,
    temb_img: torch.Tensor,
    temb_txt: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    selector: torch.Tensor | None,
    txt_lens: tuple[int, ...] | None,
    key_mask: torch.Tensor | None,
    backend: str,
    kernels: BlockKernels,
    mods: tuple[torch.Tensor, torch.Tensor] | None = None,
    target: torch.Tensor | None = None,
    sequence: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One ``QwenImageTransformerBlock`` forward; returns ``(image, text)`` (DiffSynth returns ``(text, image)``).

    Args:
        block: a DiffSynth ``QwenImageTransformerBlock`` (optionally after :func:`.qkv.fuse_qkv` and
            ``fp8.quantize_linears``), or ComfyUI's (same modules; its heads named as :func:`head_shape` reads,
            its MLP activation as :mod:`.mlp` reads).
        image: (B, S_img, D) image tokens (target, then references).
        text: (B, L, D) text tokens, right-padded.
        temb_img: (Bt, D), or (2 * Bt, D) with ``selector``: ``silu(conditioning)`` for ``img_mod``;
            Bt is 1 or B.
        temb_txt: (Bt, D) ``silu(conditioning)`` for ``txt_mod``.
        cos, sin: (S_img + L, Dh // 2) float32 RoPE tables (:func:`.rope.rope_tables`).
        selector: None, or zero_cond_t's (1, S_img, 1) bool (True: target token, modulated with the real
            timestep; False: reference token, modulated with timestep 0).
        txt_lens: None (no padding), or valid text tokens per sample as :func:`length_carriers`
            (per-sample attention).
        key_mask: None, or a (B, 1, 1, S_img + L) bool SDPA key mask.
        backend: attention backend name (``fp8.attention.BACKENDS``).
        kernels: the fused kernels the block may use (:class:`.block_kernels.BlockKernels`; ``BlockKernels()``:
            none).
        mods: None, or this block's ``(img_mod.1(temb_img), txt_mod.1(temb_txt))`` computed beforehand
            (:func:`.modulation.block_modulations`), (rows, 6 * D) each.
        target: None, or for the last block a (T, 0) size carrier (:func:`length_carriers`): the forward reads
            only the first T image tokens of each sample (the target image) after this block, so only those go
            through the output projection and the MLP, the cuDNN FP8 attention computes only their query rows,
            and the text stream is returned as it came in (nothing reads it). Exact for the rows returned.
        sequence: None, or Ulysses sequence parallel: ``(shards, image_valid)``, a
            :class:`...parallel.ulysses.SequenceShards` and the (N, 0) size carrier of the valid image tokens in all
            shards. ``image`` and ``text`` are then this rank's shards (``cos``/``sin``/``selector`` rows too, and
            ``txt_lens`` is given); the attention runs over the whole sequence after an all-to-all (any backend;
            ``cudnn_fp8`` through ``fp8.attention``'s generic call, its quantization not folded into the block).
            ``key_mask`` and ``target`` must be None.

    Returns:
        ``(image, text)`` with the input shapes and dtypes; with ``target``, image (B, T, D) and the input text.
    """
    attn = block.attn
    dim = image.shape[-1]
    si = image.shape[1]
    if mods is None:
        img_mod, txt_mod = block.img_mod[1](temb_img), block.txt_mod[1](temb_txt)  # 1 or 2 rows: never small-M
    else:
        img_mod, txt_mod = mods
    img_p = _mod_params(img_mod, dim, selector)
    txt_p = _mod_params(txt_mod, dim, None)

    img_qkv, txt_qkv = qkv_layers(attn, True), qkv_layers(attn, False)
    img_fp8 = all(takes_prequantized(p) for p in img_qkv)
    txt_fp8 = all(takes_prequantized(p) for p in txt_qkv)
    v_layers = joint_v_layers(img_qkv, txt_qkv) if kernels.joint_v_gemm and key_mask is None else None
    norms = v_layers is not None  # the joint v GEMM's bound needs both inputs' row norms
    img_x = modulated_input(image, block.img_norm1.eps, img_mod, 0, 1, img_p[0], img_p[1], selector, img_fp8,
                            kernels, norms)
    txt_x = modulated_input(text, block.txt_norm1.eps, txt_mod, 0, 1, txt_p[0], txt_p[1], None, txt_fp8, kernels,
                            norms)
    if backend in ("cudnn_fp8", "cudnn_fp8_emulated") and key_mask is None and sequence is None:
        # The QKV biases go into the fused QK and v kernels instead of a pass of their own.
        v_gemm = norms and all(isinstance(x, Prequantized) and x.norms is not None for x in (img_x, txt_x))
        (q_i, k_i, *v_i), (bq_i, bk_i, *bv_i) = _qkv_unbiased(attn, img_qkv[:2] if v_gemm else img_qkv, img_x,
                                                              kernels)
        (q_t, k_t, v_t), (bq_t, bk_t, bv_t) = _qkv_unbiased(attn, txt_qkv, txt_x, kernels)
        v_joint = None
        if v_gemm:  # the image v GEMM writes the joint e4m3 v (and the text rows), scale from a bound
            v_img, v_txt = v_layers
            v_joint = joint_v_gemm(img_x.x8, img_x.scale, img_x.norms, v_img.weight, v_img.weight_scale, v_img.bias,
                                   v_img.column_bound, v_t, bv_t, txt_x.norms, v_txt.column_bound)
            v_i, bv_i = [None], [None]
        fp8_out = takes_prequantized(attn.to_out[0]) and takes_prequantized(attn.to_add_out)
        out = cudnn_fp8_joint_attention(attn, (q_i, q_t), (k_i, k_t), (v_i[0], v_t), cos, sin, txt_lens, fp8_out,
                                        kernels, backend == "cudnn_fp8_emulated", (bq_i, bq_t), (bk_i, bk_t),
                                        (bv_i[0], bv_t), v_joint, target)
    else:
        q_i, k_i, v_i = _qkv(attn, img_qkv, img_x, kernels)
        q_t, k_t, v_t = _qkv(attn, txt_qkv, txt_x, kernels)
        v = torch.cat([v_i, v_t], dim=1)
        cos_i, sin_i, cos_t, sin_t = cos[:si], sin[:si], cos[si:], sin[si:]
        q = torch.cat([qk_norm_rope(q_i, attn.norm_q.weight, attn.norm_q.eps, cos_i, sin_i),
                       qk_norm_rope(q_t, attn.norm_added_q.weight, attn.norm_added_q.eps, cos_t, sin_t)], dim=1)
        k = torch.cat([qk_norm_rope(k_i, attn.norm_k.weight, attn.norm_k.eps, cos_i, sin_i),
                       qk_norm_rope(k_t, attn.norm_added_k.weight, attn.norm_added_k.eps, cos_t, sin_t)], dim=1)
        if sequence is None:
            out = joint_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), si, txt_lens, key_mask,
                                  backend)
        else:
            out = sequence[0].attention(q, k, v, si, sequence[1], txt_lens, backend, kernels.traced_exchange,
                                        kernels.fp8_exchange)
    kept = None if target is None else target.shape[0]
    img_attn, txt_attn = split_output(out, si, kept)
    if kept is not None:  # the last block: only the target tokens' image stream is read after it
        image = image[:, :kept].contiguous()
        if selector is not None:
            img_p, selector = tuple(p[:, :kept] for p in img_p), selector[:, :kept]

    image, img_in = residual_then_modulated(image, img_p[2], attn.to_out[0], img_attn, block.img_norm2.eps,
                                            img_mod, (2, 3, 4), img_p[3], img_p[4], selector,
                                            mlp_takes_prequantized(block.img_mlp, kernels), kernels,
                                            uses_gelu_gemm(block.img_mlp, "image", kernels))
    if kept is not None:
        return mlp_residual(block.img_mlp, img_in, image, img_p[5], kernels), text
    text, txt_in = residual_then_modulated(text, txt_p[2], attn.to_add_out, txt_attn, block.txt_norm2.eps,
                                           txt_mod, (2, 3, 4), txt_p[3], txt_p[4], None,
                                           mlp_takes_prequantized(block.txt_mlp, kernels), kernels,
                                           uses_gelu_gemm(block.txt_mlp, "text", kernels))
    image = mlp_residual(block.img_mlp, img_in, image, img_p[5], kernels)
    text = mlp_residual(block.txt_mlp, txt_in, text, txt_p[5], kernels)
    return image, text
