"""Recognising Lightning (few-step distillation) LoRAs.

lightx2v publishes them as e.g. ``Qwen-Image-Lightning-8steps-V1.1.safetensors``,
``Qwen-Image-Edit-Lightning-4steps-V1.0-bf16.safetensors``,
``Qwen-Image-Edit-2509-Lightning-8steps-V1.0-fp32.safetensors``. They need
``FlowMatchScheduler("Qwen-Image-Lightning")`` and cfg 1; the Sampler switches
to those when the user leaves scheduler and cfg on "auto".
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import PurePath

__all__ = ["METADATA_NAME_KEYS", "detect_lightning"]

METADATA_NAME_KEYS = ("modelspec.title", "ss_output_name", "name", "title", "lora_name", "model_name")
_LIGHTNING = re.compile(r"lightning", re.IGNORECASE)
_STEPS = re.compile(r"(?<![0-9])([0-9]{1,2})[ _-]?steps?(?![a-z])", re.IGNORECASE)
_MAX_STEPS = 16  # Lightning is a few-step distillation; a larger count is not one of its step counts


def _from_text(text: str, where: str) -> tuple[int | None, str] | None:
    """``(steps, reason)`` when ``text`` names a Lightning LoRA, None when it does not mention Lightning."""
    if not _LIGHTNING.search(text):
        return None
    counts = {int(m) for m in _STEPS.findall(text)}
    if len(counts) == 1 and 0 < (steps := counts.pop()) <= _MAX_STEPS:
        return steps, f"{where} '{text}' names a Lightning {steps}-step LoRA"
    if not counts:
        return None, f"{where} '{text}' mentions Lightning but gives no step count"
    return None, f"{where} '{text}' mentions Lightning but its step count is unclear"


def detect_lightning(
    name: str | os.PathLike | None, metadata: Mapping[str, str] | None = None
) -> tuple[int | None, str]:
    """Say whether a LoRA is a Lightning LoRA and for how many steps.

    ``name`` is the file name or path (only the last component is read);
    ``metadata`` the safetensors metadata, whose name-like fields
    (:data:`METADATA_NAME_KEYS`) are read when the file name says nothing.
    Returns ``(steps, reason)``: ``steps`` is the step count (4 or 8 for the
    lightx2v releases) or None when the LoRA is not (recognisably) Lightning.
    """
    checked = []
    if name is not None:
        base = PurePath(os.fspath(name)).name
        found = _from_text(base, "file name")
        if found is not None and found[0] is not None:
            return found
        checked.append(found)
    for key in METADATA_NAME_KEYS:
        value = (metadata or {}).get(key)
        if value:
            found = _from_text(str(value), f"metadata {key}")
            if found is not None and found[0] is not None:
                return found
            checked.append(found)
    for found in checked:
        if found is not None:
            return found
    return None, "not a Lightning LoRA: neither the file name nor the metadata mentions Lightning"
