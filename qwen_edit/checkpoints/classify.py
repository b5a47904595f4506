"""Tell what a checkpoint holds from its tensor names (never from its file name).

Users pick files from dropdowns and easily put a VAE in the diffusion-model
slot. :func:`classify_keys` recognizes the layouts this pack loads, and
:func:`expect_slot` turns a mismatch into an error that names the file, what it
holds and which slot it belongs in.

Pure Python: no torch, no DiffSynth.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from .safetensors_io import FLOAT8_DTYPES, CheckpointError, SafetensorsHeader


class CheckpointKind(str, Enum):
    """What a checkpoint holds."""

    DIT = "dit"
    TEXT_ENCODER = "text_encoder"
    TEXT_ENCODER_FP8_SCALED = "text_encoder_fp8_scaled"
    VAE_DIFFUSERS = "vae_diffusers"
    VAE_COMFY = "vae_comfy"
    LORA = "lora"
    UNKNOWN = "unknown"

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    CheckpointKind.DIT: "a Qwen-Image diffusion model (DiT)",
    CheckpointKind.TEXT_ENCODER: "a Qwen2.5-VL text encoder",
    CheckpointKind.TEXT_ENCODER_FP8_SCALED: "a Qwen2.5-VL text encoder (fp8_scaled)",
    CheckpointKind.VAE_DIFFUSERS: "a VAE (diffusers layout)",
    CheckpointKind.VAE_COMFY: "a VAE (ComfyUI layout)",
    CheckpointKind.LORA: "a LoRA",
    CheckpointKind.UNKNOWN: "no model this loader knows",
}


@dataclass(frozen=True)
class Slot:
    """A place in the loader a file can be chosen for."""

    name: str
    label: str
    accepts: frozenset[CheckpointKind]


SLOTS: Mapping[str, Slot] = {
    "dit": Slot("dit", "the diffusion model (DiT)", frozenset({CheckpointKind.DIT})),
    "text_encoder": Slot(
        "text_encoder",
        "the text encoder",
        frozenset({CheckpointKind.TEXT_ENCODER, CheckpointKind.TEXT_ENCODER_FP8_SCALED}),
    ),
    "vae": Slot("vae", "the VAE", frozenset({CheckpointKind.VAE_DIFFUSERS, CheckpointKind.VAE_COMFY})),
}

_WHERE_IT_BELONGS = {
    CheckpointKind.DIT: "pick it in the diffusion model (dit) slot",
    CheckpointKind.TEXT_ENCODER: "pick it in the text_encoder slot",
    CheckpointKind.TEXT_ENCODER_FP8_SCALED: "pick it in the text_encoder slot",
    CheckpointKind.VAE_DIFFUSERS: "pick it in the vae slot",
    CheckpointKind.VAE_COMFY: "pick it in the vae slot",
    CheckpointKind.LORA: "load it with the LoRA node, on top of a base model",
    CheckpointKind.UNKNOWN: "pick a Qwen-Image-Edit checkpoint",
}


@dataclass(frozen=True)
class Classification:
    """Result of :func:`classify_keys`.

    Attributes:
        kind: what the keys describe.
        reason: the evidence, for messages and logs.
        prefix: a common key prefix to strip before use (e.g. ``"model.diffusion_model."``); ``""`` if none.
    """

    kind: CheckpointKind
    reason: str
    prefix: str = ""


_LORA_PART = re.compile(r"(^|\.)(lora_A|lora_B|lora_down|lora_up|lora_mid|alpha|hada_w1_a|lokr_w1)(\.|$)")
_LAYER_INDEX = re.compile(r"transformer_blocks\.(\d+)\.")
_FP8_SCALE_SUFFIXES = (".scale_weight", ".weight_scale")


def classify_keys(
    keys: Iterable[str],
    *,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    dtypes: Mapping[str, str] | None = None,
) -> Classification:
    """Classify a checkpoint from its tensor names (and, when given, shapes and dtypes).

    Args:
        keys: all tensor names (the union over shards for sharded checkpoints).
        shapes: optional name -> shape, used to reject look-alikes (e.g. a 48-channel VAE).
        dtypes: optional name -> safetensors dtype name, used to spot fp8 weights.

    Returns:
        A :class:`Classification`; ``UNKNOWN`` carries the reason nothing matched.
    """
    keys = set(keys)
    shapes = shapes or {}
    dtypes = dtypes or {}
    if not keys:
        return Classification(CheckpointKind.UNKNOWN, "it holds no tensors")

    lora_keys = sorted(k for k in keys if _LORA_PART.search(k))
    if lora_keys:
        return Classification(
            CheckpointKind.LORA,
            f"{len(lora_keys)} tensors are LoRA deltas (e.g. {lora_keys[0]!r})",
        )

    for anchor in sorted(k for k in keys if k.endswith("img_in.weight")):
        prefix = anchor[: -len("img_in.weight")]
        blocks = {int(m.group(1)) for k in keys if k.startswith(prefix) and (m := _LAYER_INDEX.search(k))}
        if f"{prefix}txt_in.weight" in keys and blocks:
            where = f" under the prefix {prefix!r}" if prefix else ""
            return Classification(
                CheckpointKind.DIT,
                f"it has img_in, txt_in and {len(blocks)} transformer_blocks (Qwen-Image DiT key names){where}",
                prefix=prefix,
            )

    text = _classify_text_encoder(keys, dtypes)
    if text is not None:
        return text

    if {"encoder.conv_in.weight", "decoder.conv_in.weight", "post_quant_conv.weight"} <= keys and any(
        k.startswith("decoder.up_blocks.") and k.endswith(".gamma") for k in keys
    ):
        z = shapes.get("post_quant_conv.weight", (16,))[0]
        if z != 16:
            return Classification(
                CheckpointKind.UNKNOWN, f"a Wan-style VAE in diffusers layout with {z} latent channels, not 16"
            )
        return Classification(
            CheckpointKind.VAE_DIFFUSERS,
            "it has encoder.down_blocks / decoder.up_blocks with RMS-norm gammas "
            "(diffusers AutoencoderKLQwenImage names)",
        )

    if {"encoder.conv1.weight", "decoder.conv1.weight", "decoder.middle.0.residual.0.gamma"} <= keys:
        if any(k.startswith("decoder.upsamples.0.upsamples.") for k in keys):
            return Classification(
                CheckpointKind.UNKNOWN,
                "it is a Wan 2.2 VAE (48 latent channels); Qwen-Image uses the 16-channel Wan 2.1-style VAE",
            )
        z = shapes.get("conv2.weight", (16,))[0]
        if z != 16:
            return Classification(
                CheckpointKind.UNKNOWN, f"a Wan-style VAE with {z} latent channels, not Qwen-Image's 16"
            )
        return Classification(
            CheckpointKind.VAE_COMFY,
            "it has encoder.downsamples / decoder.upsamples / middle / head (ComfyUI's Wan VAE names)",
        )

    sample = ", ".join(repr(k) for k in sorted(keys)[:3])
    return Classification(
        CheckpointKind.UNKNOWN,
        "its tensor names match no Qwen-Image DiT, Qwen2.5-VL text encoder, Qwen-Image VAE or LoRA "
        f"(first keys: {sample})",
    )


def _classify_text_encoder(keys: set[str], dtypes: Mapping[str, str]) -> Classification | None:
    if "model.embed_tokens.weight" in keys:
        lm, visual, layout = "model.", "visual.", "Hugging Face / ComfyUI names"
    elif "model.language_model.embed_tokens.weight" in keys:
        lm, visual, layout = "model.language_model.", "model.visual.", "transformers>=4.52 names"
    else:
        return None
    if f"{lm}layers.0.self_attn.q_norm.weight" in keys:
        return Classification(CheckpointKind.UNKNOWN, "a Qwen3-style language model (q_norm), not Qwen2.5-VL")
    if f"{lm}layers.0.self_attn.q_proj.bias" not in keys:
        return Classification(CheckpointKind.UNKNOWN, "a language model without attention biases, not Qwen2.5-VL")
    if not any(k.startswith(f"{visual}blocks.") for k in keys):
        return Classification(
            CheckpointKind.UNKNOWN,
            "a Qwen2.5 language model without the vision tower (visual.*); Qwen-Image-Edit needs Qwen2.5-VL",
        )
    scales = [k for k in keys if k.endswith(_FP8_SCALE_SUFFIXES)]
    fp8 = [k for k, d in dtypes.items() if d in FLOAT8_DTYPES and not k.endswith("scaled_fp8")]
    if "scaled_fp8" in keys or scales or fp8:
        evidence = []
        if "scaled_fp8" in keys:
            evidence.append("the scaled_fp8 marker")
        if scales:
            evidence.append(f"{len(scales)} per-tensor scales")
        if fp8:
            evidence.append(f"{len(fp8)} float8 weights")
        return Classification(
            CheckpointKind.TEXT_ENCODER_FP8_SCALED,
            f"Qwen2.5-VL language model and vision tower ({layout}) with {', '.join(evidence)}",
        )
    return Classification(CheckpointKind.TEXT_ENCODER, f"Qwen2.5-VL language model and vision tower ({layout})")


def classify_headers(headers: Iterable[SafetensorsHeader]) -> Classification:
    """Classify one checkpoint from the headers of all its shards."""
    keys: set[str] = set()
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for header in headers:
        keys |= header.keys
        shapes.update(header.shapes())
        dtypes.update(header.dtypes())
    return classify_keys(keys, shapes=shapes, dtypes=dtypes)


def expect_slot(headers: Iterable[SafetensorsHeader], slot: str, *, source: Path | None = None) -> Classification:
    """Classify and check that the checkpoint fits ``slot`` (``"dit"``, ``"text_encoder"`` or ``"vae"``).

    Args:
        headers: the validated headers of the checkpoint's shards.
        slot: the slot the user chose the file for.
        source: the path to name in the error (defaults to the first shard).

    Raises:
        CheckpointError: e.g. "qwen_image_vae.safetensors was chosen as the diffusion model (DiT) but it
            holds a VAE (ComfyUI layout); pick it in the vae slot."
    """
    headers = list(headers)
    wanted = SLOTS[slot]
    found = classify_headers(headers)
    if found.kind in wanted.accepts:
        return found
    path = source or headers[0].path
    raise CheckpointError(
        path,
        f"was chosen as {wanted.label} but it holds {found.kind.description} ({found.reason});",
        f"{_WHERE_IT_BELONGS[found.kind]}.",
    )
