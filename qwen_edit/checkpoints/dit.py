"""The Qwen-Image DiT at the size its checkpoint says.

DiffSynth's ``QwenImageDiT`` hard-codes dim 3072, 24 heads of 128, text dim
3584 (only ``num_layers`` is a parameter). :func:`infer_dit_config` reads the
sizes from tensor shapes (diffusers key names, as in the diffusers
``transformer/`` folder and Comfy-Org's single files) and :func:`create_dit`
builds DiffSynth's own blocks at that size on ``meta``, so
``diffsynth.pipelines.qwen_image.model_fn_qwen_image`` runs on it unchanged.

Shapes used (``D`` = dim, ``T`` = text dim, ``h`` = head dim, ``C`` = latent channels * 2 * 2):
``img_in.weight [D, C]``, ``txt_in.weight [D, T]``, ``txt_norm.weight [T]``,
``transformer_blocks.0.attn.norm_q.weight [h]``, ``proj_out.weight [C_out, D]``,
``time_text_embed.timestep_embedder.linear_1.weight [D, 256]``,
``transformer_blocks.0.img_mlp.net.0.proj.weight [4D, D]``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .blocks import INCOMPLETE_REMEDY, check_block_count, check_blocks
from .config_json import check_config_agrees
from .safetensors_io import CheckpointError

logger = logging.getLogger(__name__)

#: DiffSynth's RoPE split for head_dim 128 (frame, height, width).
REFERENCE_AXES_DIM = (16, 56, 56)
REFERENCE_HEAD_DIM = 128

BLOCKS = "transformer_blocks"
BLOCK = "transformer block"

#: Blocks of the released DiTs by hidden size: every Qwen-Image / -Edit / -2509 / -2511 DiT at dim 3072 has 60.
RELEASED_BLOCKS = {3072: 60}


@dataclass(frozen=True)
class DiTConfig:
    """Sizes of a Qwen-Image DiT.

    Attributes:
        dim: hidden size ``D`` (3072 for the released models).
        num_layers: transformer blocks (60).
        num_heads: attention heads (24); ``num_heads * head_dim == dim``.
        head_dim: per-head size (128).
        text_dim: text-encoder hidden size ``T`` (3584).
        in_channels: packed latent channels in (64 = 16 * 2 * 2).
        out_channels: packed latent channels out (64).
        timestep_dim: sinusoidal timestep features (256).
        axes_dim: RoPE split over (frame, height, width); even, summing to ``head_dim``.
        use_additional_t_cond: has ``time_text_embed.addition_t_embedding`` (Qwen-Image-Layered).
        use_layer3d_rope: layered RoPE (Qwen-Image-Layered only; not detectable from weights).
    """

    dim: int
    num_layers: int
    num_heads: int
    head_dim: int
    text_dim: int
    in_channels: int = 64
    out_channels: int = 64
    timestep_dim: int = 256
    axes_dim: tuple[int, int, int] = REFERENCE_AXES_DIM
    use_additional_t_cond: bool = False
    use_layer3d_rope: bool = False

    def __post_init__(self) -> None:
        if self.num_heads * self.head_dim != self.dim:
            raise ValueError(f"num_heads {self.num_heads} * head_dim {self.head_dim} != dim {self.dim}")
        if len(self.axes_dim) != 3 or sum(self.axes_dim) != self.head_dim or any(a % 2 for a in self.axes_dim):
            raise ValueError(f"axes_dim {self.axes_dim} must be 3 even sizes summing to head_dim {self.head_dim}")
        if self.num_layers < 1:
            raise ValueError("num_layers must be >= 1")


def scaled_axes_dim(head_dim: int) -> tuple[int, int, int]:
    """DiffSynth's ``[16, 56, 56]`` scaled to ``head_dim``, each even, summing to ``head_dim``.

    ``128 -> (16, 56, 56)``, ``64 -> (8, 28, 28)``, ``32 -> (4, 14, 14)``.
    """
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"head_dim must be even and >= 6, got {head_dim}")
    frame = max(2, 2 * round(REFERENCE_AXES_DIM[0] * head_dim / REFERENCE_HEAD_DIM / 2))
    rest = head_dim - frame
    height = rest // 2 - (rest // 2) % 2
    return frame, height, rest - height


def infer_dit_config(
    shapes: Mapping[str, tuple[int, ...]],
    *,
    source: Path,
    hf_config: Mapping[str, Any] | None = None,
) -> DiTConfig:
    """Read the DiT sizes from tensor shapes (keys without any prefix).

    Args:
        shapes: tensor name -> shape, over all shards.
        source: the file named in errors.
        hf_config: diffusers ``transformer/config.json`` if present; its ``axes_dims_rope`` is used,
            ``num_layers``, ``attention_head_dim``, ``num_attention_heads`` and ``joint_attention_dim``
            must agree with the weights.

    Without a config, a DiT at a released width (dim 3072) must hold the released block count (60).

    Raises:
        CheckpointError: a required tensor is missing, transformer blocks are missing or incomplete,
            the sizes are inconsistent, or the config (or the released block count) disagrees with the
            weights, naming both numbers.
    """

    def need(key: str) -> tuple[int, ...]:
        if key not in shapes:
            raise CheckpointError(
                source,
                f"lacks {key!r}, so it is not a complete Qwen-Image DiT.",
                "Pick the full diffusion model file (e.g. qwen_image_edit_2509_bf16.safetensors).",
            )
        return tuple(shapes[key])

    num_layers = check_blocks(shapes, prefix=BLOCKS, what=BLOCK, source=source)
    dim, in_channels = need("img_in.weight")
    _, text_dim = need("txt_in.weight")
    (head_dim,) = need("transformer_blocks.0.attn.norm_q.weight")
    out_channels, _ = need("proj_out.weight")
    _, timestep_dim = need("time_text_embed.timestep_embedder.linear_1.weight")
    mlp_hidden, _ = need("transformer_blocks.0.img_mlp.net.0.proj.weight")
    (norm_dim,) = need("txt_norm.weight")

    problems = []
    if dim % head_dim:
        problems.append(f"dim {dim} is not a multiple of head_dim {head_dim}")
    if norm_dim != text_dim:
        problems.append(f"txt_norm has {norm_dim} channels but txt_in takes {text_dim}")
    if mlp_hidden != 4 * dim:
        problems.append(f"the MLP hidden size is {mlp_hidden}, DiffSynth's blocks need 4 * dim = {4 * dim}")
    if problems:
        raise CheckpointError(
            source,
            f"has inconsistent DiT sizes: {'; '.join(problems)}.",
            "The file is damaged or not a Qwen-Image DiT; download it again.",
        )

    axes_dim = scaled_axes_dim(head_dim)
    if hf_config is not None:
        if "axes_dims_rope" in hf_config:
            axes_dim = tuple(int(a) for a in hf_config["axes_dims_rope"])
        check_config_agrees(
            hf_config,
            {
                "num_layers": num_layers,
                "attention_head_dim": head_dim,
                "num_attention_heads": dim // head_dim,
                "joint_attention_dim": text_dim,
            },
            config_name="transformer/config.json",
            source=source,
        )
    elif dim in RELEASED_BLOCKS:
        check_block_count(
            num_layers,
            RELEASED_BLOCKS[dim],
            what=BLOCK,
            said_by=f"the released Qwen-Image DiT at dim {dim}",
            source=source,
            remedy=f"{INCOMPLETE_REMEDY} A deliberately pruned model loads from a diffusers folder whose "
            "transformer/config.json states its num_layers.",
        )
    try:
        return DiTConfig(
            dim=dim,
            num_layers=num_layers,
            num_heads=dim // head_dim,
            head_dim=head_dim,
            text_dim=text_dim,
            in_channels=in_channels,
            out_channels=out_channels,
            timestep_dim=timestep_dim,
            axes_dim=axes_dim,
            use_additional_t_cond="time_text_embed.addition_t_embedding.weight" in shapes,
        )
    except ValueError as exc:
        raise CheckpointError(source, f"gives an unusable DiT configuration ({exc}).", "Check the file.") from exc


def create_dit(config: DiTConfig):
    """Build DiffSynth's DiT at ``config`` size with parameters on ``meta``.

    Returns:
        A ``SizedQwenImageDiT`` (a ``diffsynth`` ``QwenImageDiT`` subclass) whose RoPE
        tables are real CPU tensors and whose parameters are meta, ready for
        :func:`~.materialize.load_into`.
    """
    from .dit_model import SizedQwenImageDiT

    return SizedQwenImageDiT(config)
