"""Checkpoint layouts, validation, key conversion and models built at checkpoint size.

Public API (DiffSynth and transformers are imported only when a model is built):

* :func:`resolve_diffusers_folder`, :func:`resolve_single_files` -> :class:`ModelFiles`
  (validated from headers only);
* :func:`check_model_structure`: every check that needs no tensor data (dtypes, sizes, blocks, config files);
* :func:`load_components` -> :class:`LoadedComponents`; :func:`load_dit`,
  :func:`load_text_encoder`, :func:`load_vae`, :func:`load_processor` one at a time;
* :func:`detect_variant` -> :class:`VariantInfo` (variant + reason, or ``"unknown"``);
* :func:`dit_weight_shapes`, :func:`dit_config`, :func:`dit_on_meta`: the DiT from headers only;
* :func:`classify_keys` / :func:`classify_headers` -> :class:`Classification`;
* :func:`read_header` (no tensor read), :class:`CheckpointError` (names the file and the remedy).
"""

from .classify import CheckpointKind, Classification, classify_headers, classify_keys, expect_slot
from .layouts import (
    ModelFiles,
    ValidatedFiles,
    read_index,
    resolve_diffusers_folder,
    resolve_single_files,
    validate_model_files,
)
from .loader import (
    LoadedComponents,
    check_model_structure,
    load_components,
    load_dit,
    load_processor,
    load_text_encoder,
    load_vae,
)
from .safetensors_io import CheckpointError, SafetensorsHeader, TensorInfo, check_suffix, load_tensors, read_header
from .shapes import dit_config, dit_on_meta, dit_weight_shapes
from .variants import EDIT, EDIT_2509, EDIT_2511, UNKNOWN, VARIANTS, VariantInfo, detect_variant

__all__ = [
    "EDIT",
    "EDIT_2509",
    "EDIT_2511",
    "UNKNOWN",
    "VARIANTS",
    "CheckpointError",
    "CheckpointKind",
    "Classification",
    "LoadedComponents",
    "ModelFiles",
    "SafetensorsHeader",
    "TensorInfo",
    "ValidatedFiles",
    "VariantInfo",
    "check_model_structure",
    "check_suffix",
    "classify_headers",
    "classify_keys",
    "detect_variant",
    "dit_config",
    "dit_on_meta",
    "dit_weight_shapes",
    "expect_slot",
    "load_components",
    "load_dit",
    "load_processor",
    "load_tensors",
    "load_text_encoder",
    "load_vae",
    "read_header",
    "read_index",
    "resolve_diffusers_folder",
    "resolve_single_files",
    "validate_model_files",
]
