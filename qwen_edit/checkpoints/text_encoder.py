"""The Qwen2.5-VL text encoder at the size its checkpoint says.

DiffSynth's ``QwenImageTextEncoder`` hard-codes the 7B config. Here the config
is read from tensor shapes (and from ``text_encoder/config.json`` when a
diffusers folder has one) and the same structure is built:
``model = transformers.Qwen2_5_VLModel`` plus ``lm_head``, so DiffSynth's
prompt encoding (``QwenImageUnit_PromptEmbedder``) runs on it unchanged.

Key layouts accepted, all mapped to DiffSynth's names
(``model.language_model.*``, ``model.visual.*``, ``lm_head.weight``):

* Hugging Face / diffusers ``text_encoder/`` and Comfy-Org single files:
  ``model.layers.*``, ``model.embed_tokens.weight``, ``model.norm.weight``,
  ``visual.*``, ``lm_head.weight`` (absent from files saved from ComfyUI's model) --
  the mapping of DiffSynth's ``QwenImageTextEncoderStateDictConverter``;
* transformers >= 4.52 saves, already in DiffSynth's names;
* Comfy-Org ``_fp8_scaled`` files: same names plus ``scaled_fp8`` and
  ``*.scale_weight``, dequantized by :mod:`.scaled_fp8`.
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

LM = "model.language_model."
VISUAL = "model.visual."
LM_HEAD = "lm_head.weight"

#: Qwen2.5-VL-7B multimodal RoPE sections for head_dim 128 (temporal, height, width).
REFERENCE_MROPE_SECTION = (16, 24, 24)
TEXT_HEAD_DIM = 128
VISION_HEAD_DIM = 80

LAYERS = LM + "layers"
LAYER = "language-model layer"
VISION_BLOCKS = VISUAL + "blocks"
VISION_BLOCK = "vision block"

#: Qwen2.5-VL's released block counts by width: the 7B language model (hidden 3584) has 28 layers; its vision
#: tower (hidden 1280) 32 blocks.
RELEASED_LAYERS = {3584: 28}
RELEASED_VISION_BLOCKS = {1280: 32}
_PRUNED_REMEDY = (
    f"{INCOMPLETE_REMEDY} A deliberately smaller model loads from a diffusers folder whose "
    "text_encoder/config.json states its sizes."
)


def canonical_key(key: str) -> str:
    """Map a stored text-encoder key to DiffSynth's name (unknown keys pass through unchanged)."""
    if key.startswith((LM, VISUAL)) or key == LM_HEAD:
        return key
    if key.startswith("model."):
        return LM + key[len("model.") :]
    if key.startswith("visual."):
        return "model." + key
    return key


def hf_key(key: str) -> str:
    """Inverse of :func:`canonical_key`: DiffSynth name -> Hugging Face / ComfyUI name."""
    if key.startswith(LM):
        return "model." + key[len(LM) :]
    if key.startswith(VISUAL):
        return key[len("model.") :]
    return key


@dataclass(frozen=True)
class TextEncoderConfig:
    """Sizes of a Qwen2.5-VL model (defaults: the 7B used by Qwen-Image).

    ``num_heads * head_dim == hidden_size``; ``sum(mrope_section) == head_dim / 2``;
    ``vision_out_hidden_size == hidden_size``.
    """

    hidden_size: int = 3584
    num_layers: int = 28
    num_heads: int = 28
    num_kv_heads: int = 4
    intermediate_size: int = 18944
    vocab_size: int = 152064
    mrope_section: tuple[int, int, int] = REFERENCE_MROPE_SECTION
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    vision_depth: int = 32
    vision_hidden_size: int = 1280
    vision_num_heads: int = 16
    vision_intermediate_size: int = 3420
    vision_out_hidden_size: int = 3584
    vision_patch_size: int = 14
    vision_temporal_patch_size: int = 2
    vision_spatial_merge_size: int = 2
    vision_in_channels: int = 3
    vision_window_size: int = 112
    vision_fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def hf_text_sizes(self) -> dict:
        """The text model's sizes under Hugging Face ``Qwen2_5_VLConfig`` / config.json names."""
        return {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": {"mrope_section": list(self.mrope_section), "rope_type": "default", "type": "default"},
        }

    def hf_vision_sizes(self) -> dict:
        """The vision tower's sizes under Hugging Face ``vision_config`` names."""
        return {
            "depth": self.vision_depth,
            "hidden_size": self.vision_hidden_size,
            "num_heads": self.vision_num_heads,
            "intermediate_size": self.vision_intermediate_size,
            "out_hidden_size": self.vision_out_hidden_size,
            "patch_size": self.vision_patch_size,
            "temporal_patch_size": self.vision_temporal_patch_size,
            "spatial_merge_size": self.vision_spatial_merge_size,
            "window_size": self.vision_window_size,
            "fullatt_block_indexes": list(self.vision_fullatt_block_indexes),
        }

    def __post_init__(self) -> None:
        problems = []
        if self.hidden_size % self.num_heads:
            problems.append(f"hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        elif sum(self.mrope_section) * 2 != self.head_dim:
            problems.append(f"mrope_section {self.mrope_section} must sum to head_dim/2 = {self.head_dim // 2}")
        if self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads {self.num_heads} not divisible by num_kv_heads {self.num_kv_heads}")
        if self.vision_hidden_size % self.vision_num_heads:
            problems.append(f"vision_hidden_size {self.vision_hidden_size} not divisible by {self.vision_num_heads}")
        if self.vision_out_hidden_size != self.hidden_size:
            problems.append(f"vision output {self.vision_out_hidden_size} != hidden_size {self.hidden_size}")
        if problems:
            raise ValueError("; ".join(problems))


def scaled_mrope_section(head_dim: int) -> tuple[int, int, int]:
    """Qwen2.5-VL's ``[16, 24, 24]`` scaled to ``head_dim`` (sums to ``head_dim // 2``)."""
    half = head_dim // 2
    temporal = max(1, round(REFERENCE_MROPE_SECTION[0] * head_dim / TEXT_HEAD_DIM))
    rest = half - temporal
    return temporal, rest // 2, rest - rest // 2


def default_fullatt_blocks(depth: int) -> tuple[int, ...]:
    """Qwen2.5-VL's full-attention vision blocks (every 8th: 7, 15, 23, 31); the last block if depth < 8."""
    blocks = tuple(i for i in range(depth) if i % 8 == 7)
    return blocks or (depth - 1,)


def _config_value(hf_config: Mapping[str, Any] | None, *names: str, section: str | None = None) -> Any:
    if not hf_config:
        return None
    places = [hf_config.get(section) or {}] if section else [hf_config.get("text_config") or {}, hf_config]
    for place in places:
        for name in names:
            if name in place:
                return place[name]
    return None


def _declared(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The sizes a Hugging Face Qwen2.5-VL config.json states (text sizes top-level or under ``text_config``)."""
    text = ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")
    vision = ("depth", "hidden_size", "intermediate_size", "out_hidden_size")
    declared = {name: _config_value(hf_config, name) for name in text}
    declared.update({f"vision_config.{n}": _config_value(hf_config, n, section="vision_config") for n in vision})
    return declared


def _check_counts(
    hf_config: Mapping[str, Any] | None,
    hidden: int,
    num_layers: int,
    vision_hidden: int,
    vision_depth: int,
    *,
    source: Path,
) -> None:
    """Without a config stating the counts, a released width must hold the released number of blocks."""
    if _config_value(hf_config, "num_hidden_layers") is None and hidden in RELEASED_LAYERS:
        check_block_count(
            num_layers,
            RELEASED_LAYERS[hidden],
            what=LAYER,
            said_by=f"the released Qwen2.5-VL language model at hidden size {hidden}",
            source=source,
            remedy=_PRUNED_REMEDY,
        )
    if _config_value(hf_config, "depth", section="vision_config") is None and vision_hidden in RELEASED_VISION_BLOCKS:
        check_block_count(
            vision_depth,
            RELEASED_VISION_BLOCKS[vision_hidden],
            what=VISION_BLOCK,
            said_by=f"the released Qwen2.5-VL vision tower at hidden size {vision_hidden}",
            source=source,
            remedy=_PRUNED_REMEDY,
        )


def infer_text_encoder_config(
    shapes: Mapping[str, tuple[int, ...]],
    *,
    source: Path,
    hf_config: Mapping[str, Any] | None = None,
) -> TextEncoderConfig:
    """Read the Qwen2.5-VL sizes from tensor shapes in DiffSynth names (see :func:`canonical_key`).

    Head counts are not visible in the shapes; they come from ``hf_config`` (a
    diffusers ``text_encoder/config.json``) when given, else head_dim 128 (text)
    and 80 (vision) when they divide the sizes (the released 7B), else two heads.
    The sizes the config states (layers, widths, vocabulary, vision depth) must
    agree with the weights; without a config, the released widths must hold the
    released block counts (28 layers at 3584, 32 vision blocks at 1280).

    Raises:
        CheckpointError: missing tensors, missing or incomplete layers / vision blocks,
            inconsistent sizes, or a config (or released count) that disagrees with the weights.
    """

    def need(key: str) -> tuple[int, ...]:
        if key not in shapes:
            raise CheckpointError(
                source,
                f"lacks {hf_key(key)!r}, so it is not a complete Qwen2.5-VL text encoder.",
                "Pick qwen_2.5_vl_7b.safetensors (or its _fp8_scaled variant) or a full text_encoder/ folder.",
            )
        return tuple(shapes[key])

    num_layers = check_blocks(shapes, prefix=LAYERS, what=LAYER, source=source)
    vision_depth = check_blocks(shapes, prefix=VISION_BLOCKS, what=VISION_BLOCK, source=source)
    vocab, hidden = need(f"{LM}embed_tokens.weight")
    q_out, _ = need(f"{LM}layers.0.self_attn.q_proj.weight")
    kv_out, _ = need(f"{LM}layers.0.self_attn.k_proj.weight")
    intermediate, _ = need(f"{LM}layers.0.mlp.gate_proj.weight")
    patch = need(f"{VISUAL}patch_embed.proj.weight")
    vision_intermediate, _ = need(f"{VISUAL}blocks.0.mlp.gate_proj.weight")
    merged, _ = need(f"{VISUAL}merger.mlp.0.weight")
    out_hidden, _ = need(f"{VISUAL}merger.mlp.2.weight")
    if len(patch) != 5:
        raise CheckpointError(source, f"has a {len(patch)}-d patch embedding; expected 5-d.", "Check the file.")
    vision_hidden, in_channels, temporal_patch, patch_size, _ = patch
    merge = round((merged / vision_hidden) ** 0.5)

    problems = []
    if q_out != hidden:
        problems.append(f"q_proj projects to {q_out}, not hidden_size {hidden}")
    if merge * merge * vision_hidden != merged:
        problems.append(f"merger input {merged} is not vision_hidden {vision_hidden} times a square")
    if problems:
        raise CheckpointError(source, f"has inconsistent text-encoder sizes: {'; '.join(problems)}.", "Check the file.")

    _check_counts(hf_config, hidden, num_layers, vision_hidden, vision_depth, source=source)
    if hf_config:
        check_config_agrees(
            _declared(hf_config),
            {
                "num_hidden_layers": num_layers,
                "hidden_size": hidden,
                "intermediate_size": intermediate,
                "vocab_size": vocab,
                "vision_config.depth": vision_depth,
                "vision_config.hidden_size": vision_hidden,
                "vision_config.intermediate_size": vision_intermediate,
                "vision_config.out_hidden_size": out_hidden,
            },
            config_name="text_encoder/config.json",
            source=source,
        )

    heads = _config_value(hf_config, "num_attention_heads")
    kv_heads = _config_value(hf_config, "num_key_value_heads")
    vision_heads = _config_value(hf_config, "num_heads", section="vision_config")
    rope = _config_value(hf_config, "rope_scaling", "rope_parameters") or {}
    mrope = rope.get("mrope_section") if isinstance(rope, dict) else None
    fullatt = _config_value(hf_config, "fullatt_block_indexes", section="vision_config")
    window = _config_value(hf_config, "window_size", section="vision_config")
    if heads is None:
        head_dim = TEXT_HEAD_DIM if hidden % TEXT_HEAD_DIM == 0 and kv_out % TEXT_HEAD_DIM == 0 else hidden // 2
        heads = hidden // head_dim
        kv_heads = max(1, kv_out // head_dim)
    elif kv_heads is None:
        kv_heads = kv_out // (hidden // heads)
    if vision_heads is None:
        vision_head_dim = VISION_HEAD_DIM if vision_hidden % VISION_HEAD_DIM == 0 else vision_hidden // 2
        vision_heads = vision_hidden // vision_head_dim
    head_dim = hidden // int(heads)
    if int(kv_heads) * head_dim != kv_out:
        raise CheckpointError(
            source,
            f"has k_proj of {kv_out} outputs, which is not {kv_heads} kv heads of {head_dim}.",
            "Check the file or its config.json.",
        )
    try:
        return TextEncoderConfig(
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=int(heads),
            num_kv_heads=int(kv_heads),
            intermediate_size=intermediate,
            vocab_size=vocab,
            mrope_section=tuple(mrope) if mrope else scaled_mrope_section(head_dim),
            vision_depth=vision_depth,
            vision_hidden_size=vision_hidden,
            vision_num_heads=int(vision_heads),
            vision_intermediate_size=vision_intermediate,
            vision_out_hidden_size=out_hidden,
            vision_patch_size=patch_size,
            vision_temporal_patch_size=temporal_patch,
            vision_spatial_merge_size=merge,
            vision_in_channels=in_channels,
            vision_window_size=int(window) if window else 112,
            vision_fullatt_block_indexes=tuple(fullatt) if fullatt else default_fullatt_blocks(vision_depth),
        )
    except ValueError as exc:
        raise CheckpointError(
            source, f"gives an unusable text-encoder configuration ({exc}).", "Check the file."
        ) from exc


def create_text_encoder(config: TextEncoderConfig):
    """Build the DiffSynth-structured text encoder at ``config`` size, parameters on ``meta``.

    Returns:
        A ``SizedQwenImageTextEncoder`` (subclass of DiffSynth's ``QwenImageTextEncoder``).
    """
    from .text_encoder_model import SizedQwenImageTextEncoder

    return SizedQwenImageTextEncoder(config)
