"""Shared pieces of the nodes: category, the pipe type, model-folder listings, input errors."""

from __future__ import annotations

import os
from pathlib import Path

import folder_paths
from comfy_api.latest import io

from ..qwen_edit.checkpoints.safetensors_io import PICKLE_SUFFIXES

CATEGORY = "Qwen Edit Hopper"
PIPE = io.Custom("QWEN_EDIT")
"""The pipe passed between our nodes: a ``qwen_edit.plan.PipePlan`` (immutable)."""

DIFFUSERS_FOLDER_NAME = "qwen_edit"
"""ComfyUI model folder (``models/qwen_edit``) for diffusers/ModelScope pipeline folders."""
NO_FOLDER = "(none: use the three files)"


REFUSE, EMULATE = "refuse", "emulate"
WHERE_UNSUPPORTED = [REFUSE, EMULATE]
"""What a node does where this machine cannot run the kernel it was asked for."""


def where_unsupported_input() -> io.Combo.Input:
    """The ``where_unsupported`` widget of the nodes that choose fp8 kernels (Load's attention, Apply TE-FP8)."""
    return io.Combo.Input(
        "where_unsupported", options=WHERE_UNSUPPORTED, default=REFUSE, optional=True,
        tooltip="Where this machine cannot run the chosen fp8 kernel (no Hopper GPU, a package missing): refuse "
        "with the reason, or emulate: the same fp8 numerics in an fp32 reference path, without any speed, to check "
        "a workflow on another machine. The node's output says EMULATED.")


class NodeInputError(ValueError):
    """Bad input to one of our nodes; the message names the input and what to do."""


def register_model_folders() -> None:
    """Register ``models/qwen_edit`` (diffusers folders) with ComfyUI's folder_paths, once."""
    if DIFFUSERS_FOLDER_NAME not in folder_paths.folder_names_and_paths:
        folder_paths.add_model_folder_path(
            DIFFUSERS_FOLDER_NAME, os.path.join(folder_paths.models_dir, DIFFUSERS_FOLDER_NAME), is_default=True
        )


def diffusers_folders() -> list[str]:
    """Pipeline folders (holding ``transformer/``) under ``models/qwen_edit`` and ``models/diffusion_models``."""
    found = []
    for folder_name in (DIFFUSERS_FOLDER_NAME, "diffusion_models"):
        for base in folder_paths.get_folder_paths(folder_name):
            if not os.path.isdir(base):
                continue
            for entry in sorted(os.listdir(base)):
                if os.path.isdir(os.path.join(base, entry, "transformer")):
                    found.append(entry)
    return sorted(set(found))


def diffusers_folder_path(name: str) -> Path:
    """The folder chosen in the UI, resolved inside ComfyUI's model folders only."""
    if name not in diffusers_folders():
        raise NodeInputError(f"diffusers_folder '{name}' is not a pipeline folder in models/qwen_edit or "
                             "models/diffusion_models: put the folder (with transformer/, text_encoder/, vae/) there")
    for folder_name in (DIFFUSERS_FOLDER_NAME, "diffusion_models"):
        for base in folder_paths.get_folder_paths(folder_name):
            candidate = Path(base) / name
            if (candidate / "transformer").is_dir():
                return candidate
    raise NodeInputError(f"diffusers_folder '{name}' disappeared while loading")


def model_file_path(folder_name: str, name: str, input_name: str) -> Path:
    """A file chosen in the UI, resolved inside ComfyUI's ``folder_name`` folders only; pickles refused."""
    check_model_file_choice(folder_name, name, input_name)
    path = folder_paths.get_full_path(folder_name, name)
    if path is None:
        raise NodeInputError(f"{input_name} '{name}' was not found in models/{folder_name}")
    return Path(path)


def check_model_file_choice(folder_name: str, name: str, input_name: str) -> None:
    """Raise NodeInputError unless ``name`` is a safetensors file listed in ComfyUI's ``folder_name``."""
    if name not in folder_paths.get_filename_list(folder_name):
        raise NodeInputError(f"{input_name} '{name}' is not a file in models/{folder_name}: "
                             f"put the file there (or list its folder in extra_model_paths.yaml) and pick it")
    if name.lower().endswith(PICKLE_SUFFIXES):
        raise NodeInputError(f"{input_name} '{name}' is a pickle checkpoint: pickles can run arbitrary code when "
                             "loaded, so this pack reads only .safetensors; use the .safetensors release of this model")


def model_choices(folder_name: str, placeholder: str = "") -> list[str]:
    """Files of a ComfyUI model folder for a combo (never empty: the frontend needs one option)."""
    names = folder_paths.get_filename_list(folder_name)
    return names or [placeholder or f"(no files in models/{folder_name})"]
