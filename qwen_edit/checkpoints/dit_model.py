"""DiffSynth's ``QwenImageDiT`` with sizes taken from a :class:`~.dit.DiTConfig`.

Imported only when a DiT is built (it imports DiffSynth).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from diffsynth.models.general_modules import AdaLayerNorm, RMSNorm, TimestepEmbeddings
from diffsynth.models.qwen_image_dit import (
    QwenEmbedLayer3DRope,
    QwenEmbedRope,
    QwenImageDiT,
    QwenImageTransformerBlock,
)

from .materialize import meta_device

if TYPE_CHECKING:  # annotations only: .dit imports this module when it builds a model
    from .dit import DiTConfig


def build_rope(config: DiTConfig) -> torch.nn.Module:
    """DiffSynth's RoPE module for ``config`` (its tables are plain CPU tensors)."""
    rope_cls = QwenEmbedLayer3DRope if config.use_layer3d_rope else QwenEmbedRope
    return rope_cls(theta=10000, axes_dim=list(config.axes_dim), scale_rope=True)


class SizedQwenImageDiT(QwenImageDiT):
    """``QwenImageDiT`` built from DiffSynth's own modules at the checkpoint's size.

    Same attribute names and submodule classes as DiffSynth's (``img_in``, ``txt_in``,
    ``txt_norm``, ``time_text_embed``, ``pos_embed``, ``transformer_blocks``,
    ``norm_out``, ``proj_out``), so ``model_fn_qwen_image`` and DiffSynth's
    VRAM / LoRA helpers treat it as the real thing. Parameters are created on
    ``meta``; the RoPE tables are built on CPU.

    Attributes:
        dit_config: the :class:`DiTConfig` it was built from.
    """

    def __init__(self, config: DiTConfig):
        torch.nn.Module.__init__(self)
        self.dit_config = config
        self.pos_embed = build_rope(config)
        with meta_device():
            self.time_text_embed = TimestepEmbeddings(
                config.timestep_dim,
                config.dim,
                diffusers_compatible_format=True,
                scale=1000,
                align_dtype_to_timestep=False,
                use_additional_t_cond=config.use_additional_t_cond,
            )
            self.txt_norm = RMSNorm(config.text_dim, eps=1e-6)
            self.img_in = torch.nn.Linear(config.in_channels, config.dim)
            self.txt_in = torch.nn.Linear(config.text_dim, config.dim)
            self.transformer_blocks = torch.nn.ModuleList(
                QwenImageTransformerBlock(
                    dim=config.dim,
                    num_attention_heads=config.num_heads,
                    attention_head_dim=config.head_dim,
                )
                for _ in range(config.num_layers)
            )
            self.norm_out = AdaLayerNorm(config.dim, single=True)
            self.proj_out = torch.nn.Linear(config.dim, config.out_channels)
