"""RoPE for the fast forward: DiffSynth's complex ``QwenEmbedRope`` tables as real cos/sin, and the QK norm + rotation.

DiffSynth rotates each (even, odd) channel pair of q and k by a complex multiply with
``freqs_cis`` (complex64). Inductor cannot generate code for complex tensors, so the tables
are taken apart once per shape into ``cos = freqs.real`` and ``sin = freqs.imag`` (the same
float32 numbers DiffSynth multiplies by) and the rotation is written with real ops
(:func:`qk_norm_rope`). The tables are built here; :class:`.prepared.PreparedDit` keeps them per shape.

The joint sequence of the fast forward is ``[image tokens, text tokens]`` (DiffSynth's is
``[text, image]``; attention without a mask does not depend on the order of the tokens, and
this order makes the valid keys of a right-padded prompt a prefix). Text positions are the
same for every sample of a batch (right padding), so one table serves the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F  # noqa: N812

__all__ = ["qk_norm_rope", "rope_complex", "rope_real", "rope_tables", "target_selector", "with_bias"]


def rope_real(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DiffSynth's ``apply_rotary_emb_qwen`` with real ops (Inductor fuses them; it cannot codegen complex).

    x: (B, S, H, Dh), channel pairs (2i, 2i+1) rotated by angle i; cos, sin: (S, Dh // 2) float32.
    Returns (B, S, H, Dh) in x.dtype, computed in float32.
    """
    pairs = x.float().unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((re * c - im * s, re * s + im * c), dim=-1).flatten(-2).to(x.dtype)


def rope_complex(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The same rotation as one complex multiply, DiffSynth's way (fewer kernels in eager mode)."""
    freqs = torch.complex(cos, sin)[:, None, :]
    rotated = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous()) * freqs
    return torch.view_as_real(rotated).flatten(-2).to(x.dtype)


def qk_norm_rope(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """DiffSynth's ``RMSNorm`` over the head dim, then its ``apply_rotary_emb_qwen``.

    Args:
        x: (B, S, H, Dh) q or k, any strides (e.g. a view into a fused QKV output), bf16 or fp32.
        weight: (Dh,) RMSNorm weight (None: no affine).
        eps: RMSNorm epsilon.
        cos, sin: (S, Dh // 2) float32, the real and imaginary parts of DiffSynth's ``freqs_cis``.

    Returns:
        (B, S, H, Dh) contiguous in ``x.dtype``. Rounding points are DiffSynth's: the normalized value is
        rounded to ``x.dtype`` before the weight multiply, the rotation runs in float32 and is rounded back.
        Under ``torch.compile`` the rotation is real arithmetic (:func:`rope_real`) and the whole function
        becomes one kernel per q / k; in eager mode it is ``F.rms_norm`` (one kernel on CUDA) and one
        complex multiply (:func:`rope_complex`).
    """
    y = F.rms_norm(x, (x.shape[-1],), eps=eps)
    if weight is not None:
        y = y * weight
    if torch.compiler.is_compiling():
        return rope_real(y, cos, sin)
    return rope_complex(y, cos, sin)


def with_bias(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x + bias in x's dtype (as a linear layer adds it), or x."""
    return x if bias is None else x + bias.to(x.dtype)


def rope_tables(
    dit: torch.nn.Module,
    img_shapes: Sequence[tuple[int, int, int]],
    text_len: int,
    device: torch.device,
    *,
    interpolation: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Real RoPE tables for the joint sequence ``[image tokens, text tokens]`` (built each call: one host-to-device
    copy; :meth:`.prepared.PreparedDit.rope_tables` keeps them per shape).

    Args:
        dit: a DiffSynth ``QwenImageDiT`` whose ``pos_embed`` is a ``QwenEmbedRope``.
        img_shapes: ``(frames, h, w)`` per image in token units (``h = latent height // 2``), target
            first, then each reference, as DiffSynth's ``model_fn_qwen_image`` builds them for batch 1.
        text_len: text tokens (the padded length ``L``; positions do not depend on the mask).
        device: where the tables live.
        interpolation: DiffSynth's ``edit_rope_interpolation`` (``pos_embed.forward_sampling``).

    Returns:
        ``(cos, sin)``, each (S_img + L, head_dim // 2) float32 on ``device``: the real and imaginary
        parts of DiffSynth's ``freqs_cis`` rows (image rows first).
    """
    from diffsynth.models.qwen_image_dit import QwenEmbedRope

    pos_embed = dit.pos_embed
    if not isinstance(pos_embed, QwenEmbedRope):
        raise NotImplementedError(
            f"the fast forward supports DiffSynth's QwenEmbedRope only, not {type(pos_embed).__name__} "
            "(Qwen-Image-Layered's 3-D RoPE): use diffsynth's model_fn_qwen_image for that model"
        )
    device = torch.device(device)
    run = pos_embed.forward_sampling if interpolation else pos_embed.forward
    with torch.no_grad():
        vid, txt = run([tuple(int(v) for v in s) for s in img_shapes], [int(text_len)], device=device)
        freqs = torch.cat([vid.to(device), txt.to(device)], dim=0)
    return freqs.real.float().contiguous(), freqs.imag.float().contiguous()


def target_selector(target_tokens: int, image_tokens: int, device: torch.device) -> torch.Tensor:
    """zero_cond_t's ``modulate_index == 0`` as a (1, image_tokens, 1) bool tensor (True: target image token).

    DiffSynth builds the index from a Python list on every call (a host-to-device copy); this builds it on the
    device (:meth:`.prepared.PreparedDit.target_selector` keeps it per shape).
    """
    return (torch.arange(image_tokens, device=torch.device(device)) < target_tokens).view(1, image_tokens, 1)
