"""RoPE for the fast forward: DiffSynth's complex ``QwenEmbedRope`` tables as real cos/sin, cached per shape.

DiffSynth rotates each (even, odd) channel pair of q and k by a complex multiply with
``freqs_cis`` (complex64). Inductor cannot generate code for complex tensors, so the tables
are taken apart once per shape into ``cos = freqs.real`` and ``sin = freqs.imag`` (the same
float32 numbers DiffSynth multiplies by) and the rotation is written with real ops
(:func:`.block.qk_norm_rope`).

The joint sequence of the fast forward is ``[image tokens, text tokens]`` (DiffSynth's is
``[text, image]``; attention without a mask does not depend on the order of the tokens, and
this order makes the valid keys of a right-padded prompt a prefix). Text positions are the
same for every sample of a batch (right padding), so one table serves the whole batch.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

CACHE_ENTRIES = 16
"""Shapes remembered per model (resolutions x text lengths x devices)."""

_CACHES: weakref.WeakKeyDictionary[torch.nn.Module, OrderedDict] = weakref.WeakKeyDictionary()


def _cache_for(dit: torch.nn.Module) -> OrderedDict:
    cache = _CACHES.get(dit)
    if cache is None:
        cache = _CACHES[dit] = OrderedDict()
    return cache


def _remember(dit: torch.nn.Module, key: tuple, build):
    cache = _cache_for(dit)
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = build()
    cache[key] = value
    while len(cache) > CACHE_ENTRIES:
        cache.popitem(last=False)
    logger.debug("fast forward: built %s for a new shape", key[0])
    return value


def rope_tables(
    dit: torch.nn.Module,
    img_shapes: Sequence[tuple[int, int, int]],
    text_len: int,
    device: torch.device,
    *,
    interpolation: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Real RoPE tables for the joint sequence ``[image tokens, text tokens]``, cached on ``dit`` by shape.

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
    key = ("rope", tuple(tuple(int(v) for v in s) for s in img_shapes), int(text_len), str(device), interpolation)

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        run = pos_embed.forward_sampling if interpolation else pos_embed.forward
        with torch.no_grad():
            vid, txt = run([tuple(s) for s in img_shapes], [int(text_len)], device=device)
            freqs = torch.cat([vid.to(device), txt.to(device)], dim=0)
        return freqs.real.float().contiguous(), freqs.imag.float().contiguous()

    return _remember(dit, key, build)


def target_selector(dit: torch.nn.Module, target_tokens: int, image_tokens: int, device: torch.device) -> torch.Tensor:
    """zero_cond_t's ``modulate_index == 0`` as a (1, image_tokens, 1) bool tensor (True: target image token).

    DiffSynth builds the index from a Python list on every call (a host-to-device copy); this one is
    built once per shape and cached on ``dit``.
    """
    device = torch.device(device)
    key = ("target_selector", int(target_tokens), int(image_tokens), str(device))

    def build() -> torch.Tensor:
        return (torch.arange(image_tokens, device=device) < target_tokens).view(1, image_tokens, 1)

    return _remember(dit, key, build)


def clear_cache(dit: torch.nn.Module) -> None:
    """Forget the tables cached for ``dit`` (e.g. after moving it to another device)."""
    _CACHES.pop(dit, None)
