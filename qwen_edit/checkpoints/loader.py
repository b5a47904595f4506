"""Load DiT, text encoder, VAE and processor from :class:`~.layouts.ModelFiles`, every layout the same way.

Order of work: all headers are validated and classified first (cheap, fails
before any tensor is read), then each model is built on ``meta`` at the size
its checkpoint says, its tensors are read straight onto ``device``, converted
(key names, fp8 dequantization, dtype) and assigned in place.

Each part also loads alone (:func:`load_dit`, :func:`load_text_encoder`,
:func:`load_vae`, :func:`load_processor`) because the runtime caches them
separately. When loading fails, the frames that held half-built models are
cleared, so nothing half-built stays referenced by the exception.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .classify import CheckpointKind
from .dit import DiTConfig, create_dit, infer_dit_config
from .layouts import ModelFiles, ValidatedFiles, read_json, validate_model_files
from .materialize import cast_floating, finish, load_into, read_tensors
from .processor import build_processor, choose_processor_source
from .scaled_fp8 import dequantize, is_scale_key, pop_fp8_weights
from .shapes import strip_prefix, validated_dit_shapes
from .text_encoder import (
    LM_HEAD,
    TextEncoderConfig,
    canonical_key,
    create_text_encoder,
    infer_text_encoder_config,
)
from .vae import VAEConfig, comfy_to_diffusers_keys, create_vae, infer_vae_config
from .variants import VariantInfo, detect_variant

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedComponents:
    """Everything a Qwen-Image-Edit pipeline needs, loaded.

    Attributes:
        dit: ``SizedQwenImageDiT`` (a DiffSynth ``QwenImageDiT``), weights in ``dtype`` on ``device``.
        text_encoder: ``SizedQwenImageTextEncoder`` (a DiffSynth ``QwenImageTextEncoder``).
        vae: DiffSynth ``QwenImageVAE``.
        processor: ``transformers.Qwen2VLProcessor``.
        variant: the detected (or chosen) release and why; ``variant.name`` may be ``"unknown"``.
        files: the files they came from.
    """

    dit: torch.nn.Module
    text_encoder: torch.nn.Module
    vae: torch.nn.Module
    processor: Any
    variant: VariantInfo
    files: ModelFiles


@contextmanager
def _release_on_failure() -> Iterator[None]:
    """On any exception, clear the finished frames in its traceback (they hold half-built models)."""
    try:
        yield
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)
        raise


def _validated(files: ModelFiles, part: str, validated: ValidatedFiles | None) -> ValidatedFiles:
    if validated is not None and part in validated.headers and validated.files == files:
        return validated
    return validate_model_files(files, parts=(part,))


def load_dit(
    files: ModelFiles,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    validated: ValidatedFiles | None = None,
) -> torch.nn.Module:
    """Load the DiT at its checkpoint's size.

    Accepts diffusers key names with or without a prefix such as ``model.diffusion_model.``;
    fp8 weights (with or without ComfyUI scales) are dequantized to ``dtype``.

    Returns:
        A ``SizedQwenImageDiT`` in eval mode, no grads, weights ``dtype`` on ``device``.

    Raises:
        CheckpointError: wrong kind of file, missing / unexpected keys, inconsistent sizes.
    """
    with _release_on_failure():
        return _load_dit(_validated(files, "dit", validated), device=device, dtype=dtype)


def _dit_config(validated: ValidatedFiles) -> DiTConfig:
    files = validated.files
    return infer_dit_config(
        validated_dit_shapes(validated), source=files.source("dit"), hf_config=read_json(files.config_json("dit"))
    )


def _text_encoder_config(validated: ValidatedFiles) -> TextEncoderConfig:
    files = validated.files
    shapes = {canonical_key(k): v for k, v in validated.shapes("text_encoder").items() if not is_scale_key(k)}
    return infer_text_encoder_config(
        shapes, source=files.source("text_encoder"), hf_config=read_json(files.config_json("text_encoder"))
    )


def _vae_config(validated: ValidatedFiles) -> tuple[VAEConfig, dict[str, str]]:
    """The VAE's config, and the stored -> diffusers key mapping (empty for the diffusers layout)."""
    files = validated.files
    source = files.source("vae")
    shapes = validated.shapes("vae")
    mapping: dict[str, str] = {}
    if validated.kinds["vae"].kind is CheckpointKind.VAE_COMFY:
        mapping = comfy_to_diffusers_keys(shapes, source=source)
        shapes = {mapping[k]: v for k, v in shapes.items()}
    return infer_vae_config(shapes, source=source, hf_config=read_json(files.config_json("vae"))), mapping


def check_model_structure(files: ModelFiles) -> tuple[DiTConfig, TextEncoderConfig, VAEConfig]:
    """Every check that needs no tensor data, for all three parts: headers, kinds, dtypes, sizes, blocks, configs.

    Cheap (headers and config files only): run it when files are chosen, so a broken checkpoint is refused
    before anything loads.

    Returns:
        The DiT, text encoder and VAE configs the loader will build.

    Raises:
        CheckpointError: the first problem found, naming its file.
    """
    validated = validate_model_files(files)
    return _dit_config(validated), _text_encoder_config(validated), _vae_config(validated)[0]


def _load_dit(validated: ValidatedFiles, *, device: torch.device | str, dtype: torch.dtype) -> torch.nn.Module:
    files = validated.files
    source = files.source("dit")
    prefix = validated.kinds["dit"].prefix
    config = _dit_config(validated)
    logger.info("DiT from %s: %s", source.name, config)
    model = create_dit(config)
    tensors, _ = read_tensors(validated.headers["dit"], device=device, rename=lambda k: strip_prefix(k, prefix))
    dequantize(tensors, dtype=dtype, source=source)
    load_into(model, tensors, source=source, what="the Qwen-Image DiT")
    del tensors
    return finish(model, device=device, source=source)


def load_text_encoder(
    files: ModelFiles,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    validated: ValidatedFiles | None = None,
) -> torch.nn.Module:
    """Load the Qwen2.5-VL text encoder at its checkpoint's size.

    Accepts the diffusers ``text_encoder/`` layout, Comfy-Org's bf16 file and its
    ``_fp8_scaled`` variant. The fp8 linear weights of a ``_fp8_scaled`` file stay fp8
    (``fp8.WeightOnlyLinear``: the file's e4m3 weight and scale, dequantized per call as
    ``W8.float() * scale`` in ``dtype``, the values the whole-model dequantization gave),
    so the encoder takes the file's size in memory, not twice it. ``lm_head.weight`` is
    not read: DiffSynth reads hidden states only (1.09 GB saved at 7B).

    Returns:
        A ``SizedQwenImageTextEncoder`` in eval mode, no grads, on ``device``.

    Raises:
        CheckpointError: wrong kind of file, missing / unexpected keys, inconsistent sizes.
    """
    with _release_on_failure():
        return _load_text_encoder(_validated(files, "text_encoder", validated), device=device, dtype=dtype)


def _load_text_encoder(
    validated: ValidatedFiles, *, device: torch.device | str, dtype: torch.dtype
) -> torch.nn.Module:
    files = validated.files
    source = files.source("text_encoder")
    config = _text_encoder_config(validated)
    logger.info("text encoder from %s (%s): %s", source.name, validated.kinds["text_encoder"].kind.value, config)
    model = create_text_encoder(config)
    tensors, _ = read_tensors(validated.headers["text_encoder"], device=device,
                              rename=lambda k: None if canonical_key(k) == LM_HEAD else k)
    fp8_weights = pop_fp8_weights(tensors, source=source)
    dequantize(tensors, dtype=dtype, source=source)
    tensors = {canonical_key(k): v for k, v in tensors.items()}
    kept = keep_fp8_linears(model, {canonical_key(k): v for k, v in fp8_weights.items()}, tensors, dtype=dtype)
    if kept:
        logger.info("%s: %d linear layers kept in fp8 as stored (weight-only, dequantized per call)", source.name,
                    kept)
    load_into(model, tensors, source=source, what="the Qwen2.5-VL text encoder")
    del tensors
    return finish(model, device=device, source=source)


def keep_fp8_linears(model: torch.nn.Module, fp8_weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
                     tensors: dict[str, torch.Tensor], *, dtype: torch.dtype) -> int:
    """Put fp8 weights into ``fp8.WeightOnlyLinear`` layers of the meta-built ``model``.

    ``fp8_weights``: model weight name -> (float8 weight, scale). Each whose owner is an ``nn.Linear`` replaces
    that linear (bias from ``tensors``); the layer's tensors are added to ``tensors`` so the strict load that
    follows assigns them. A weight whose owner is not a linear is dequantized into ``tensors`` instead.
    Returns the number of layers kept in fp8.
    """
    from ...fp8.linear import WeightOnlyLinear

    kept = 0
    for name, (weight, scale) in fp8_weights.items():
        owner_name = name[: -len(".weight")]
        try:
            owner = model.get_submodule(owner_name)
        except AttributeError:
            owner = None
        if type(owner) is not torch.nn.Linear:
            tensors[name] = (weight.float() * scale).to(dtype)
            continue
        bias = tensors.get(owner_name + ".bias")
        layer = WeightOnlyLinear(weight, scale, bias, owner_name)
        parent_name, _, child = owner_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
        tensors[name] = layer.weight
        tensors[owner_name + ".weight_scale"] = layer.weight_scale
        if bias is not None:
            tensors[owner_name + ".bias"] = layer.bias
        kept += 1
    return kept


def load_vae(
    files: ModelFiles,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    validated: ValidatedFiles | None = None,
) -> torch.nn.Module:
    """Load the VAE (diffusers or ComfyUI key layout) at its checkpoint's size.

    Returns:
        A DiffSynth ``QwenImageVAE`` in eval mode, no grads, weights ``dtype`` on ``device``.

    Raises:
        CheckpointError: wrong kind of file, unknown or missing keys, latent size other than 16.
    """
    with _release_on_failure():
        return _load_vae(_validated(files, "vae", validated), device=device, dtype=dtype)


def _load_vae(validated: ValidatedFiles, *, device: torch.device | str, dtype: torch.dtype) -> torch.nn.Module:
    files = validated.files
    source = files.source("vae")
    config, mapping = _vae_config(validated)
    logger.info("VAE from %s (%s): %s", source.name, validated.kinds["vae"].kind.value, config)
    model = create_vae(config)
    tensors, _ = read_tensors(validated.headers["vae"], device=device, rename=lambda k: mapping.get(k, k))
    cast_floating(tensors, dtype)
    load_into(model, tensors, source=source, what="the Qwen-Image VAE")
    del tensors
    return finish(model, device=device, source=source)


def load_processor(files: ModelFiles, *, comfy_tokenizer_dir: Path | str | None = None):
    """Build the ``Qwen2VLProcessor`` offline: ``processor/``, else ``tokenizer/``, else ComfyUI's tokenizer files.

    Raises:
        CheckpointError: no tokenizer files anywhere.
    """
    return build_processor(
        processor_dir=files.processor_dir,
        tokenizer_dir=files.tokenizer_dir,
        comfy_tokenizer_dir=Path(comfy_tokenizer_dir) if comfy_tokenizer_dir is not None else None,
    )


def load_components(
    files: ModelFiles,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    comfy_tokenizer_dir: Path | str | None = None,
    variant: str | None = None,
) -> LoadedComponents:
    """Validate every header, then load processor, DiT, text encoder and VAE.

    Args:
        files: from :func:`~.layouts.resolve_diffusers_folder` or :func:`~.layouts.resolve_single_files`.
        device: where weights go (``"cpu"``, ``"cuda"``...).
        dtype: floating dtype of all weights (fp8 checkpoints are dequantized to it).
        comfy_tokenizer_dir: ComfyUI's ``comfy/text_encoders/qwen25_tokenizer``, used when ``files`` has
            neither ``processor/`` nor ``tokenizer/``.
        variant: force ``"edit"``, ``"edit_2509"`` or ``"edit_2511"``; None / ``"auto"`` detects.

    Returns:
        :class:`LoadedComponents`. ``variant.name`` may be ``"unknown"``: the caller then asks for a manual choice.

    Raises:
        CheckpointError: the first problem found, naming its file; raised before any tensor is
            loaded whenever headers, index files, kinds, dtypes, sizes, blocks, config files or
            tokenizer files are at fault. Non-finite tensors are found as they are read.
    """
    validated = validate_model_files(files)
    _dit_config(validated), _text_encoder_config(validated), _vae_config(validated)  # sizes, blocks, configs
    tokenizer_dir = Path(comfy_tokenizer_dir) if comfy_tokenizer_dir is not None else None
    choose_processor_source(
        processor_dir=files.processor_dir, tokenizer_dir=files.tokenizer_dir, comfy_tokenizer_dir=tokenizer_dir
    )
    variant_info = detect_variant(files, override=variant, dit_header=validated.headers["dit"][0])
    logger.info("variant %s: %s", variant_info.name, variant_info.reason)
    with _release_on_failure():
        return _load_all(validated, variant_info, device=device, dtype=dtype, comfy_tokenizer_dir=tokenizer_dir)


def _load_all(
    validated: ValidatedFiles,
    variant: VariantInfo,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    comfy_tokenizer_dir: Path | None,
) -> LoadedComponents:
    files = validated.files
    processor = load_processor(files, comfy_tokenizer_dir=comfy_tokenizer_dir)
    dit = _load_dit(validated, device=device, dtype=dtype)
    text_encoder = _load_text_encoder(validated, device=device, dtype=dtype)
    vae = _load_vae(validated, device=device, dtype=dtype)
    return LoadedComponents(
        dit=dit, text_encoder=text_encoder, vae=vae, processor=processor, variant=variant, files=files
    )
