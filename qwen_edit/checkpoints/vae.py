"""The Qwen-Image VAE at the size its checkpoint says, from either key layout.

DiffSynth's ``QwenImageVAE`` uses the diffusers ``AutoencoderKLQwenImage``
names (``encoder.down_blocks.N``, ``decoder.up_blocks.I.resnets.J`` ...).
Comfy-Org's ``qwen_image_vae.safetensors`` uses ComfyUI's Wan 2.1 VAE names
(``comfy/ldm/wan/vae.py``: ``encoder.downsamples.N.residual.K``,
``decoder.upsamples.N``, ``middle``, ``head``, ``conv1``/``conv2``).
:func:`comfy_to_diffusers_keys` is the exact, complete mapping (and
:func:`diffusers_to_comfy_keys` its inverse); an unknown key is an error, never
dropped.

Sizes read from shapes (``B`` = base_dim, ``z`` = latent channels):
``encoder.conv_in.weight [B, 3, 3, 3, 3]``, ``post_quant_conv.weight [z, z, 1, 1, 1]``,
``decoder.up_blocks.I.resnets.0.conv1.weight [B * dim_mult[-1 - I], ...]``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config_json import check_config_agrees
from .safetensors_io import CheckpointError

LATENT_CHANNELS = 16

# Sub-module renames inside one residual block: ComfyUI (nn.Sequential indices) -> diffusers.
_RESIDUAL = {
    "residual.0.gamma": "norm1.gamma",
    "residual.2.weight": "conv1.weight",
    "residual.2.bias": "conv1.bias",
    "residual.3.gamma": "norm2.gamma",
    "residual.6.weight": "conv2.weight",
    "residual.6.bias": "conv2.bias",
    "shortcut.weight": "conv_shortcut.weight",
    "shortcut.bias": "conv_shortcut.bias",
}
_RESIDUAL_BACK = {v: k for k, v in _RESIDUAL.items()}
# Attention and resample blocks keep their names.
_SAME = frozenset(
    {
        "norm.gamma",
        "to_qkv.weight",
        "to_qkv.bias",
        "proj.weight",
        "proj.bias",
        "resample.1.weight",
        "resample.1.bias",
        "time_conv.weight",
        "time_conv.bias",
    }
)
_TOP = {  # ComfyUI -> diffusers, whole prefixes
    "encoder.conv1.": "encoder.conv_in.",
    "encoder.head.2.": "encoder.conv_out.",
    "decoder.conv1.": "decoder.conv_in.",
    "decoder.head.2.": "decoder.conv_out.",
    "conv1.": "quant_conv.",
    "conv2.": "post_quant_conv.",
}
_TOP_EXACT = {"encoder.head.0.gamma": "encoder.norm_out.gamma", "decoder.head.0.gamma": "decoder.norm_out.gamma"}
_MIDDLE = {"0": "resnets.0", "1": "attentions.0", "2": "resnets.1"}

_COMFY_FLAT = re.compile(r"^(encoder\.downsamples|decoder\.upsamples)\.(\d+)\.(.+)$")
_COMFY_MIDDLE = re.compile(r"^(encoder|decoder)\.middle\.(\d+)\.(.+)$")
_DIFF_DOWN = re.compile(r"^encoder\.down_blocks\.(\d+)\.(.+)$")
_DIFF_UP = re.compile(r"^decoder\.up_blocks\.(\d+)\.(resnets\.(\d+)|upsamplers\.0)\.(.+)$")
_DIFF_MID = re.compile(r"^(encoder|decoder)\.mid_block\.(resnets\.\d+|attentions\.0)\.(.+)$")


def _rename_sub(sub: str) -> str | None:
    if sub in _RESIDUAL:
        return _RESIDUAL[sub]
    return sub if sub in _SAME else None


def _rename_sub_back(sub: str) -> str | None:
    if sub in _RESIDUAL_BACK:
        return _RESIDUAL_BACK[sub]
    return sub if sub in _SAME else None


def comfy_to_diffusers_keys(keys: Iterable[str], *, source: Path) -> dict[str, str]:
    """Map every ComfyUI Wan-VAE key to its diffusers / DiffSynth ``QwenImageVAE`` name.

    The decoder's flat ``upsamples.N`` list is split into ``up_blocks.I`` at each
    resample block (``resnets.J`` before it, ``upsamplers.0`` for it).

    Raises:
        CheckpointError: a key that has no counterpart (the file is not a Qwen-Image / Wan 2.1 VAE).
    """
    keys = sorted(keys)
    decoder = [m for k in keys if (m := _COMFY_FLAT.match(k)) and m.group(1) == "decoder.upsamples"]
    upsample_ids = sorted({int(m.group(2)) for m in decoder})
    resamples = {int(m.group(2)) for m in decoder if m.group(3).startswith("resample.")}
    up_target: dict[int, str] = {}
    stage = resnet = 0
    for index in upsample_ids:
        if index in resamples:
            up_target[index] = f"decoder.up_blocks.{stage}.upsamplers.0"
            stage, resnet = stage + 1, 0
        else:
            up_target[index] = f"decoder.up_blocks.{stage}.resnets.{resnet}"
            resnet += 1

    mapping: dict[str, str] = {}
    for key in keys:
        new = _comfy_key(key, up_target)
        if new is None:
            raise CheckpointError(
                source,
                f"has the key {key!r}, which has no place in the Qwen-Image VAE (diffusers layout).",
                "Pick Comfy-Org's qwen_image_vae.safetensors or the diffusers vae/ folder of Qwen-Image-Edit.",
            )
        mapping[key] = new
    return mapping


def _comfy_key(key: str, up_target: Mapping[int, str]) -> str | None:
    if key in _TOP_EXACT:
        return _TOP_EXACT[key]
    if m := _COMFY_FLAT.match(key):
        part, index, sub = m.group(1), int(m.group(2)), m.group(3)
        new_sub = _rename_sub(sub)
        if new_sub is None:
            return None
        if part == "encoder.downsamples":
            return f"encoder.down_blocks.{index}.{new_sub}"
        if "upsamplers" in up_target[index] and not sub.startswith(("resample.", "time_conv.")):
            return None
        if "resnets" in up_target[index] and sub not in _RESIDUAL:
            return None  # attention inside decoder stages has no diffusers counterpart
        return f"{up_target[index]}.{new_sub}"
    if m := _COMFY_MIDDLE.match(key):
        part, index, sub = m.groups()
        block = _MIDDLE.get(index)
        if block is None:
            return None
        new_sub = (sub if sub in _SAME else None) if block == "attentions.0" else _RESIDUAL.get(sub)
        return None if new_sub is None else f"{part}.mid_block.{block}.{new_sub}"
    for old, new in _TOP.items():
        if key.startswith(old) and key[len(old) :] in ("weight", "bias"):
            return new + key[len(old) :]
    return None


def diffusers_to_comfy_keys(keys: Iterable[str]) -> dict[str, str]:
    """Inverse of :func:`comfy_to_diffusers_keys`: diffusers / DiffSynth name -> ComfyUI Wan-VAE name.

    Raises:
        ValueError: a key outside the Qwen-Image VAE layout.
    """
    keys = sorted(keys)
    stage_resnets: dict[int, int] = {}
    stage_upsampler: set[int] = set()
    for key in keys:
        if m := _DIFF_UP.match(key):
            stage = int(m.group(1))
            if m.group(3) is not None:
                stage_resnets[stage] = max(stage_resnets.get(stage, 0), int(m.group(3)) + 1)
            else:
                stage_upsampler.add(stage)
    offsets, total = {}, 0
    for stage in sorted(stage_resnets):
        offsets[stage] = total
        total += stage_resnets[stage] + (1 if stage in stage_upsampler else 0)

    back_top = {v: k for k, v in _TOP.items()}
    back_exact = {v: k for k, v in _TOP_EXACT.items()}
    back_middle = {v: k for k, v in _MIDDLE.items()}
    mapping: dict[str, str] = {}
    for key in keys:
        new: str | None = None
        if key in back_exact:
            new = back_exact[key]
        elif m := _DIFF_DOWN.match(key):
            sub = _rename_sub_back(m.group(2))
            new = None if sub is None else f"encoder.downsamples.{m.group(1)}.{sub}"
        elif m := _DIFF_UP.match(key):
            stage, resnet, sub = int(m.group(1)), m.group(3), m.group(4)
            index = offsets[stage] + (int(resnet) if resnet is not None else stage_resnets[stage])
            sub = _rename_sub_back(sub)
            new = None if sub is None else f"decoder.upsamples.{index}.{sub}"
        elif m := _DIFF_MID.match(key):
            part, block, sub = m.groups()
            sub = (sub if sub in _SAME else None) if block == "attentions.0" else _RESIDUAL_BACK.get(sub)
            new = None if sub is None else f"{part}.middle.{back_middle[block]}.{sub}"
        else:
            for old, prefix in back_top.items():
                if key.startswith(old) and key[len(old) :] in ("weight", "bias"):
                    new = prefix + key[len(old) :]
        if new is None:
            raise ValueError(f"{key!r} is not a Qwen-Image VAE key")
        mapping[key] = new
    return mapping


@dataclass(frozen=True)
class VAEConfig:
    """Sizes of a Qwen-Image (Wan 2.1-style) VAE; DiffSynth ``QwenImageVAE`` arguments.

    Attributes:
        base_dim: channels of the first stage (96 for the released VAE).
        z_dim: latent channels; DiffSynth's latent mean/std fix it at 16.
        dim_mult: channel multiplier per stage ((1, 2, 4, 4)).
        num_res_blocks: residual blocks per encoder stage (decoder: one more) (2).
        temperal_downsample: per downsampling stage, whether time is downsampled too ((False, True, True)).
        image_channels: image channels (3).
    """

    base_dim: int = 96
    z_dim: int = LATENT_CHANNELS
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    image_channels: int = 3

    def __post_init__(self) -> None:
        if self.z_dim != LATENT_CHANNELS:
            raise ValueError(f"z_dim must be {LATENT_CHANNELS} (DiffSynth's latent mean/std), got {self.z_dim}")
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            raise ValueError("temperal_downsample needs one entry per downsampling stage (len(dim_mult) - 1)")


_UP_RESNET0 = re.compile(r"^decoder\.up_blocks\.(\d+)\.resnets\.0\.conv1\.weight$")
_UP_RESNET = re.compile(r"^decoder\.up_blocks\.0\.resnets\.(\d+)\.conv1\.weight$")
_DOWN_RESAMPLE = re.compile(r"^encoder\.down_blocks\.(\d+)\.resample\.1\.weight$")


def infer_vae_config(
    shapes: Mapping[str, tuple[int, ...]],
    *,
    source: Path,
    hf_config: Mapping[str, Any] | None = None,
) -> VAEConfig:
    """Read the VAE sizes from tensor shapes in diffusers names.

    Args:
        shapes: tensor name -> shape.
        source: the file named in errors.
        hf_config: diffusers ``vae/config.json`` if present: its ``base_dim``, ``z_dim``, ``dim_mult``,
            ``num_res_blocks`` and ``temperal_downsample`` must agree with the weights.

    Raises:
        CheckpointError: missing tensors, attention blocks DiffSynth cannot place, a latent size other than 16,
            or a config that disagrees with the weights (naming both values).
    """

    def need(key: str) -> tuple[int, ...]:
        if key not in shapes:
            raise CheckpointError(
                source,
                f"lacks {key!r}, so it is not a complete Qwen-Image VAE.",
                "Pick qwen_image_vae.safetensors or the vae/ folder of Qwen-Image-Edit.",
            )
        return tuple(shapes[key])

    base_dim, image_channels = need("encoder.conv_in.weight")[:2]
    z_dim = need("post_quant_conv.weight")[0]
    stages = {int(m.group(1)): shapes[k][0] for k in shapes if (m := _UP_RESNET0.match(k))}
    resnets = {int(m.group(1)) for k in shapes if (m := _UP_RESNET.match(k))}
    resamples = sorted(int(m.group(1)) for k in shapes if (m := _DOWN_RESAMPLE.match(k)))
    if not stages or not resnets:
        need("decoder.up_blocks.0.resnets.0.conv1.weight")
    problems = []
    if any(".to_qkv." in k for k in shapes if k.startswith("encoder.down_blocks.")):
        problems.append("attention blocks inside the encoder stages (attn_scales) are not supported")
    if sorted(stages) != list(range(len(stages))):
        problems.append("decoder up_blocks are missing")
    if any(stages[i] % base_dim for i in stages):
        problems.append("decoder channels are not multiples of base_dim")
    if z_dim != LATENT_CHANNELS:
        problems.append(f"it has {z_dim} latent channels; Qwen-Image's VAE has {LATENT_CHANNELS}")
    if problems:
        raise CheckpointError(
            source,
            f"is not a VAE DiffSynth's QwenImageVAE can build: {'; '.join(problems)}.",
            "Pick qwen_image_vae.safetensors or the vae/ folder of Qwen-Image-Edit.",
        )
    dim_mult = tuple(stages[i] // base_dim for i in sorted(stages, reverse=True))
    temporal = tuple(f"encoder.down_blocks.{i}.time_conv.weight" in shapes for i in resamples)
    if hf_config is not None:
        check_config_agrees(
            hf_config,
            {
                "base_dim": base_dim,
                "z_dim": z_dim,
                "dim_mult": dim_mult,
                "num_res_blocks": len(resnets) - 1,
                "temperal_downsample": temporal,
            },
            config_name="vae/config.json",
            source=source,
        )
    try:
        return VAEConfig(
            base_dim=base_dim,
            z_dim=z_dim,
            dim_mult=dim_mult,
            num_res_blocks=len(resnets) - 1,
            temperal_downsample=temporal,
            image_channels=image_channels,
        )
    except ValueError as exc:
        raise CheckpointError(source, f"gives an unusable VAE configuration ({exc}).", "Check the file.") from exc


def create_vae(config: VAEConfig):
    """Build DiffSynth's ``QwenImageVAE`` at ``config`` size, parameters on ``meta``.

    Returns:
        A ``diffsynth`` ``QwenImageVAE``; ``encode`` maps images ``[B, 3, H, W]`` in [-1, 1] to
        latents ``[B, 16, H/8, W/8]``, ``decode`` the reverse.
    """
    from .vae_model import build_vae

    return build_vae(config)
