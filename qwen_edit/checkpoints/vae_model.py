"""DiffSynth's ``QwenImageVAE`` built on ``meta`` at a :class:`~.vae.VAEConfig` size.

Imported only when a VAE is built (it imports DiffSynth).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from diffsynth.models.qwen_image_vae import QwenImageVAE

from .materialize import meta_device

if TYPE_CHECKING:  # annotations only: .vae imports this module when it builds a model
    from .vae import VAEConfig


def _latent_statistics() -> tuple[torch.Tensor, torch.Tensor]:
    """DiffSynth's latent ``mean`` and ``1/std`` ([1, 16, 1, 1, 1] float32), from a tiny CPU instance."""
    probe = QwenImageVAE(base_dim=1, dim_mult=[1], num_res_blocks=0, temperal_downsample=[])
    return probe.mean.clone(), probe.std.clone()


def build_vae(config: VAEConfig) -> QwenImageVAE:
    """``QwenImageVAE`` at ``config`` size: parameters on ``meta``, latent statistics on CPU."""
    with meta_device():
        vae = QwenImageVAE(
            base_dim=config.base_dim,
            z_dim=config.z_dim,
            dim_mult=list(config.dim_mult),
            num_res_blocks=config.num_res_blocks,
            attn_scales=[],
            temperal_downsample=list(config.temperal_downsample),
            image_channels=config.image_channels,
        )
    vae.mean, vae.std = _latent_statistics()
    vae.vae_config = config
    return vae
