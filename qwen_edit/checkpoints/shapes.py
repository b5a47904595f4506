"""DiT shapes and a weightless DiT, from headers only (for LoRA matching and fp8 planning).

Nothing here reads a tensor: node-time checks (does this LoRA fit? which
layers would fp8 convert?) cost a header read, not a 40 GB load.
"""

from __future__ import annotations

from .dit import DiTConfig, create_dit, infer_dit_config
from .layouts import ModelFiles, ValidatedFiles, read_json, validate_model_files
from .scaled_fp8 import is_scale_key


def strip_prefix(key: str, prefix: str) -> str:
    """``key`` without ``prefix`` (e.g. ``"model.diffusion_model."``) when it has it."""
    return key[len(prefix) :] if prefix and key.startswith(prefix) else key


def validated_dit_shapes(validated: ValidatedFiles) -> dict[str, tuple[int, ...]]:
    """DiT name -> shape from already validated headers (prefix stripped, fp8 scales dropped)."""
    prefix = validated.kinds["dit"].prefix
    return {strip_prefix(k, prefix): v for k, v in validated.shapes("dit").items() if not is_scale_key(k)}


def dit_weight_shapes(files: ModelFiles) -> dict[str, tuple[int, ...]]:
    """DiT tensor name -> shape, in DiffSynth / diffusers names (any prefix stripped, fp8 scales dropped).

    E.g. ``{"transformer_blocks.0.attn.to_q.weight": (3072, 3072), ...}`` for the released models.

    Raises:
        CheckpointError: the DiT files are broken or are not a DiT.
    """
    return validated_dit_shapes(validate_model_files(files, parts=("dit",)))


def dit_config(files: ModelFiles) -> DiTConfig:
    """The DiT sizes the loader will build (from headers and ``transformer/config.json``).

    Raises:
        CheckpointError: missing tensors or inconsistent sizes.
    """
    return infer_dit_config(
        dit_weight_shapes(files), source=files.source("dit"), hf_config=read_json(files.config_json("dit"))
    )


def dit_on_meta(files: ModelFiles):
    """The DiT of ``files`` at its checkpoint size with all parameters on ``meta`` (no memory, no load).

    Returns:
        A ``SizedQwenImageDiT``; module names and Linear shapes are the loaded model's.
    """
    return create_dit(dit_config(files))
