"""Which Qwen-Image-Edit release a set of files is: Edit, Edit-2509 or Edit-2511.

The three releases share one DiT key layout, so the weights cannot tell them
apart. Evidence, strongest first:

1. ``transformer/config.json`` with ``"zero_cond_t": true`` -> Edit-2511;
2. ``model_index.json`` ``_class_name``: ``QwenImageEditPlusPipeline`` (2509 or
   2511, multi-image) or ``QwenImageEditPipeline`` (Edit);
3. a safetensors metadata field of the DiT naming the release;
4. the DiT file name (Comfy-Org: ``qwen_image_edit_2509_bf16.safetensors``) or
   the folder name (``Qwen-Image-Edit-2511``).

:func:`detect_variant` returns the variant and the reason, or ``"unknown"``
with the reason so the caller can ask for a manual choice.

Pure Python: no torch, no DiffSynth.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from .layouts import ModelFiles, read_json
from .safetensors_io import SafetensorsHeader, read_header

logger = logging.getLogger(__name__)

EDIT = "edit"
EDIT_2509 = "edit_2509"
EDIT_2511 = "edit_2511"
UNKNOWN = "unknown"
VARIANTS = (EDIT, EDIT_2509, EDIT_2511)



@dataclass(frozen=True)
class ReleaseFacts:
    """What the pack knows of one Qwen-Image-Edit release (the one table of these facts).

    Attributes:
        name: the checkpoint-side name (``"edit"``, ``"edit_2509"``, ``"edit_2511"``).
        plan_value: the value of ``qwen_edit.plan.Variant`` (and the Load node's widget) for this release.
        label: the release's published name.
        max_images: reference images it accepts.
        zero_cond_t: reference-image tokens modulated with timestep 0 (DiffSynth's ``zero_cond_t``).
        multi_image_prompt: prompts with "Picture N:" image slots (DiffSynth's multi-image template).
    """

    name: str
    plan_value: str
    label: str
    max_images: int
    zero_cond_t: bool
    multi_image_prompt: bool


RELEASES: dict[str, ReleaseFacts] = {
    EDIT: ReleaseFacts(EDIT, "qwen-image-edit", "Qwen-Image-Edit", 1, False, False),
    EDIT_2509: ReleaseFacts(EDIT_2509, "qwen-image-edit-2509", "Qwen-Image-Edit-2509", 3, False, True),
    EDIT_2511: ReleaseFacts(EDIT_2511, "qwen-image-edit-2511", "Qwen-Image-Edit-2511", 3, True, True),
}
RELEASE_BY_PLAN_VALUE: dict[str, ReleaseFacts] = {facts.plan_value: facts for facts in RELEASES.values()}

#: safetensors ``__metadata__`` fields searched for a release name, in order.
METADATA_FIELDS = ("qwen_edit.variant", "modelspec.title", "modelspec.architecture", "modelspec.description", "name")


@dataclass(frozen=True)
class VariantInfo:
    """A detected (or chosen) release and why.

    Attributes:
        name: ``"edit"``, ``"edit_2509"``, ``"edit_2511"`` or ``"unknown"``.
        reason: the evidence that decided it (or why nothing did).
    """

    name: str
    reason: str

    def __post_init__(self) -> None:
        if self.name not in (*VARIANTS, UNKNOWN):
            raise ValueError(f"variant must be one of {(*VARIANTS, UNKNOWN)}, got {self.name!r}")

    @property
    def known(self) -> bool:
        return self.name != UNKNOWN

    @property
    def max_images(self) -> int | None:
        """Reference images the release accepts (1 for Edit, 3 for 2509/2511); None if unknown."""
        facts = RELEASES.get(self.name)
        return facts.max_images if facts else None

    @property
    def zero_cond_t(self) -> bool:
        """Whether sampling must pass ``zero_cond_t=True`` (Edit-2511)."""
        facts = RELEASES.get(self.name)
        return facts.zero_cond_t if facts else False

    @property
    def label(self) -> str:
        facts = RELEASES.get(self.name)
        return facts.label if facts else "unknown Qwen-Image-Edit release"


def variant_from_text(text: str) -> str | None:
    """Map a file name, folder name or metadata value to a variant, or None."""
    lowered = text.lower()
    if re.search(r"(?<!\d)2511(?!\d)", lowered):
        return EDIT_2511
    if re.search(r"(?<!\d)2509(?!\d)", lowered):
        return EDIT_2509
    if "edit" in lowered:
        return EDIT
    return None


def _from_configs(files: ModelFiles) -> tuple[str | None, str, bool]:
    """Evidence from model_index.json / transformer/config.json: (variant, reason, decisive)."""
    if files.root is None:
        return None, "", False
    transformer_config = read_json(files.root / "transformer" / "config.json")
    if transformer_config is not None and transformer_config.get("zero_cond_t") is True:
        return EDIT_2511, "transformer/config.json sets zero_cond_t=true (Edit-2511)", True
    model_index = read_json(files.root / "model_index.json")
    pipeline = (model_index or {}).get("_class_name")
    if pipeline == "QwenImageEditPlusPipeline":
        if transformer_config is not None:
            return (
                EDIT_2509,
                "model_index.json names QwenImageEditPlusPipeline (multi-image) and transformer/config.json "
                "has no zero_cond_t=true, so Edit-2509",
                True,
            )
        return (
            EDIT_2509,
            "model_index.json names QwenImageEditPlusPipeline (2509 or 2511; no transformer config)",
            False,
        )
    if pipeline == "QwenImageEditPipeline":
        return EDIT, "model_index.json names QwenImageEditPipeline (single-image Edit)", True
    if isinstance(pipeline, str):
        return UNKNOWN, f"model_index.json names {pipeline}, which is not a Qwen-Image-Edit pipeline", True
    return None, "", False


def _from_metadata(header: SafetensorsHeader) -> tuple[str | None, str]:
    for key in METADATA_FIELDS:
        value = header.metadata.get(key)
        if value and (variant := variant_from_text(value)) is not None:
            return variant, f"safetensors metadata {key}={value!r} of {header.path.name}"
    return None, ""


def _from_names(files: ModelFiles) -> tuple[str | None, str]:
    name = files.dit[0].name if files.root is None else files.root.name
    what = "DiT file name" if files.root is None else "folder name"
    variant = variant_from_text(name)
    if variant is None:
        return None, ""
    return variant, f"the {what} {name!r} contains {'edit' if variant == EDIT else variant.split('_')[1]!r}"


def detect_variant(
    files: ModelFiles,
    *,
    override: str | None = None,
    dit_header: SafetensorsHeader | None = None,
) -> VariantInfo:
    """Detect the release of ``files`` and say why.

    Args:
        files: the model's files.
        override: a variant chosen by the user (``"edit"``, ``"edit_2509"``, ``"edit_2511"``); ``None`` or
            ``"auto"`` detects.
        dit_header: the DiT's first shard header, if already read.

    Returns:
        A :class:`VariantInfo`; ``name == "unknown"`` when nothing decides, with the reason.

    Raises:
        ValueError: ``override`` is not a known variant.
        CheckpointError: a config json is unreadable.
    """
    if override not in (None, "auto"):
        if override not in VARIANTS:
            raise ValueError(f"variant override must be one of {VARIANTS} or 'auto', got {override!r}")
        return VariantInfo(override, "chosen by hand")

    candidates: list[tuple[str, str]] = []
    variant, reason, decisive = _from_configs(files)
    if variant is not None:
        candidates.append((variant, reason))
    if not decisive:
        header = dit_header or read_header(files.dit[0])
        for found in (_from_metadata(header), _from_names(files)):
            if found[0] is not None:
                candidates.append(found)
        if variant == EDIT_2509:
            # "EditPlus" without a transformer config: a name saying 2511 refines it.
            refined = [c for c in candidates[1:] if c[0] in (EDIT_2509, EDIT_2511)]
            if refined:
                candidates = [(refined[0][0], f"{reason}; {refined[0][1]}"), *candidates[1:]]

    if not candidates:
        return VariantInfo(
            UNKNOWN,
            "no model_index.json, transformer config, metadata or file name tells which Qwen-Image-Edit "
            "release this is; choose the variant by hand",
        )
    chosen, why = candidates[0]
    disagreeing = [f"{r} suggests {v}" for v, r in candidates[1:] if v != chosen]
    if disagreeing:
        logger.warning("variant %s (%s) although %s", chosen, why, "; ".join(disagreeing))
        why = f"{why} (although {'; '.join(disagreeing)})"
    return VariantInfo(chosen, why)
