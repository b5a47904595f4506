"""Build the Qwen2VLProcessor (tokenizer + image processor) offline, from local files only.

Sources, first found wins:

1. a diffusers ``processor/`` folder (tokenizer files + ``preprocessor_config.json``);
2. a ``tokenizer/`` folder (tokenizer files; image settings from the defaults below);
3. ComfyUI's own Qwen2.5 tokenizer files, ``comfy/text_encoders/qwen25_tokenizer``
   (``vocab.json``, ``merges.txt``, ``tokenizer_config.json``), whose folder the caller passes.

The image processor uses Qwen2.5-VL's preprocessing (14-pixel patches, 2x2
merge, CLIP mean/std, 3136..12845056 pixels) unless a ``preprocessor_config.json``
says otherwise. Nothing here takes a repo id: ``from_pretrained`` only ever sees
a local folder, with ``local_files_only=True``, so the network is never used.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .safetensors_io import CheckpointError

logger = logging.getLogger(__name__)

#: Qwen2.5-VL's image preprocessing (its preprocessor_config.json), used when no folder provides one.
QWEN25_VL_IMAGE_PROCESSOR_DEFAULTS: Mapping[str, Any] = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
_IMAGE_KEYS = tuple(QWEN25_VL_IMAGE_PROCESSOR_DEFAULTS)


@dataclass(frozen=True)
class ProcessorSource:
    """Where the processor will come from.

    Attributes:
        tokenizer_dir: folder with ``vocab.json`` + ``merges.txt`` (or ``tokenizer.json``).
        image_config: image-processor settings.
        reason: which source was chosen and why, for logs and messages.
    """

    tokenizer_dir: Path
    image_config: Mapping[str, Any]
    reason: str


def has_tokenizer_files(folder: Path | None) -> bool:
    """True if ``folder`` holds a byte-level BPE tokenizer (``vocab.json`` + ``merges.txt`` or ``tokenizer.json``)."""
    if folder is None or not folder.is_dir():
        return False
    return (folder / "tokenizer.json").is_file() or all((folder / n).is_file() for n in ("vocab.json", "merges.txt"))


def read_image_config(folder: Path) -> dict[str, Any]:
    """Qwen2.5-VL image settings from ``preprocessor_config.json`` or ``processor_config.json`` in ``folder``.

    Missing values fall back to :data:`QWEN25_VL_IMAGE_PROCESSOR_DEFAULTS`.

    Raises:
        CheckpointError: the json is unreadable.
    """
    config = dict(QWEN25_VL_IMAGE_PROCESSOR_DEFAULTS)
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(path, f"could not be read as JSON ({exc}).", "Download the folder again.") from exc
        data = dict(data.get("image_processor", data)) if isinstance(data, dict) else {}
        size = data.get("size")
        if isinstance(size, dict):  # newer files: {"shortest_edge": min_pixels, "longest_edge": max_pixels}
            data.setdefault("min_pixels", size.get("shortest_edge"))
            data.setdefault("max_pixels", size.get("longest_edge"))
        config.update({k: data[k] for k in _IMAGE_KEYS if data.get(k) is not None})
        break
    return config


def choose_processor_source(
    *,
    processor_dir: Path | None = None,
    tokenizer_dir: Path | None = None,
    comfy_tokenizer_dir: Path | None = None,
) -> ProcessorSource:
    """Pick the processor source without building anything (cheap; use it to validate early).

    Raises:
        CheckpointError: none of the folders holds tokenizer files.
    """
    if has_tokenizer_files(processor_dir):
        return ProcessorSource(
            processor_dir, read_image_config(processor_dir), f"the processor/ folder {processor_dir}"
        )
    if has_tokenizer_files(tokenizer_dir):
        image = read_image_config(processor_dir) if processor_dir is not None and processor_dir.is_dir() else None
        return ProcessorSource(
            tokenizer_dir,
            image or dict(QWEN25_VL_IMAGE_PROCESSOR_DEFAULTS),
            f"the tokenizer/ folder {tokenizer_dir} with Qwen2.5-VL's default image preprocessing",
        )
    if has_tokenizer_files(comfy_tokenizer_dir):
        return ProcessorSource(
            comfy_tokenizer_dir,
            dict(QWEN25_VL_IMAGE_PROCESSOR_DEFAULTS),
            f"ComfyUI's Qwen2.5 tokenizer files in {comfy_tokenizer_dir} with Qwen2.5-VL's default image preprocessing",
        )
    looked = [str(p) for p in (processor_dir, tokenizer_dir, comfy_tokenizer_dir) if p is not None]
    raise CheckpointError(
        Path(looked[0]) if looked else Path("qwen25_tokenizer"),
        "has no Qwen2.5 tokenizer files (vocab.json + merges.txt or tokenizer.json); "
        f"looked in: {looked or 'nothing'}.",
        "Pass ComfyUI's comfy/text_encoders/qwen25_tokenizer folder, or use a model folder with processor/.",
    )


def build_processor(
    *,
    processor_dir: Path | None = None,
    tokenizer_dir: Path | None = None,
    comfy_tokenizer_dir: Path | None = None,
):
    """Build a ``transformers.Qwen2VLProcessor`` from local files only.

    Returns:
        A ``Qwen2VLProcessor``: ``processor(text=[...], images=..., padding=True, return_tensors="pt")``
        gives ``input_ids`` / ``attention_mask`` ``[B, S]`` int64, ``pixel_values``
        ``[patches, 3 * 2 * 14 * 14]`` float32 and ``image_grid_thw`` ``[images, 3]``.

    Raises:
        CheckpointError: no tokenizer files, or they cannot be loaded.
    """
    from transformers import Qwen2Tokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    source = choose_processor_source(
        processor_dir=processor_dir, tokenizer_dir=tokenizer_dir, comfy_tokenizer_dir=comfy_tokenizer_dir
    )
    logger.info("processor from %s", source.reason)
    try:
        tokenizer = Qwen2Tokenizer.from_pretrained(str(source.tokenizer_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            source.tokenizer_dir,
            f"holds tokenizer files that transformers cannot load ({exc}).",
            "Use ComfyUI's comfy/text_encoders/qwen25_tokenizer folder or download the tokenizer again.",
        ) from exc
    image_config = dict(source.image_config)
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**image_config),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**image_config),
    )
