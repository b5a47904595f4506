"""Every block's modulation linear in two launches per forward: all ``img_mod.1``, then all ``txt_mod.1``.

Each block's ``img_mod`` / ``txt_mod`` is ``Linear(dim, 6 * dim)`` on ``silu(conditioning)``, the same one
to two rows for all 60 blocks. With fp8 weights (the "attn+mlp+mod compute" preset: row-wise
``ScaledMMLinear``; the default preset: ``WeightOnlyLinear``) they run as two
:class:`...fp8.shared_input_gemv.SharedInputLinears` launches before the first block, and each block gets
its two (Bt, 6 * dim) rows instead of calling its layers. bf16 models, Transformer Engine layers and CPU
runs keep the per-block calls; the kernel plan (``shared_modulation``) says why.

Measured on an H200: the two launches take 1.51 ms at one row and 1.60 ms at two (4.5 / 4.2 TB/s), against
about 3.0 ms for the compiled blocks' 120 GEMVs; whole forward 177.80 -> 175.89 ms at batch 1.

:class:`.prepared.PreparedDit` keeps a model's two groups (they hold the layers' weight addresses).
"""

from __future__ import annotations

import torch

from ...fp8.capability import Capability
from ...fp8.shared_input_gemv import MAX_ROWS, SharedInputLinears, shared_input_capability

__all__ = ["MAX_ROWS", "block_modulations", "modulation_capability", "modulation_groups", "modulation_layers"]


def modulation_layers(dit: torch.nn.Module) -> tuple[tuple[torch.nn.Module, ...], tuple[torch.nn.Module, ...]]:
    """(every block's ``img_mod.1``, every block's ``txt_mod.1``)."""
    blocks = dit.transformer_blocks
    return tuple(b.img_mod[1] for b in blocks), tuple(b.txt_mod[1] for b in blocks)


def modulation_capability(dit: torch.nn.Module) -> Capability:
    """Whether ``dit``'s modulation linears can run as two shared-input launches (their kind, shapes, device)."""
    img_layers, txt_layers = modulation_layers(dit)
    for layers in (img_layers, txt_layers):
        capability = shared_input_capability(layers)
        if not capability.ok:
            return capability
    return Capability.yes(f"{2 * len(img_layers)} modulation linears in two shared-input launches")


def modulation_groups(dit: torch.nn.Module) -> tuple[SharedInputLinears, SharedInputLinears]:
    """The two launch groups of ``dit`` (raises ValueError with the reason where :func:`modulation_capability`
    says no)."""
    img_layers, txt_layers = modulation_layers(dit)
    return SharedInputLinears(img_layers), SharedInputLinears(txt_layers)


def block_modulations(groups: tuple[SharedInputLinears, SharedInputLinears], temb_img: torch.Tensor,
                      temb_txt: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each block's ``(img_mod.1(temb_img), txt_mod.1(temb_txt))`` from the two groups.

    temb_img: (Bt, D) or (2 Bt, D) (zero_cond_t), temb_txt: (Bt, D), bf16, at most :data:`MAX_ROWS` rows each.
    Returns one pair of (rows, 6 * D) bf16 views per block.
    """
    return list(zip(groups[0](temb_img).unbind(0), groups[1](temb_txt).unbind(0), strict=True))
