"""Write tiny but real Qwen-Image-Edit checkpoints, in every layout users have.

The files carry the real tensor names and the real block structure (DiffSynth's
and ComfyUI's modules at a few layers and small widths), random weights scaled
so a forward pass stays finite and decodes to a non-constant image. They load
through exactly the code real checkpoints load through, so tests of layouts,
conversions, variants and the sampling loop run on CPU in seconds.

Layouts:

* ``"diffusers"``: ``transformer/`` (2 shards + index + config.json),
  ``text_encoder/`` (2 shards + index + config.json), ``vae/``, ``processor/``,
  ``tokenizer/``, ``model_index.json``;
* ``"comfy_single"``: ``diffusion_models/qwen_image_edit[_2509|_2511]_bf16.safetensors`` and its
  ``_fp8_e4m3fn`` twin, ``text_encoders/qwen_2.5_vl_7b.safetensors`` and ``qwen_2.5_vl_7b_fp8_scaled.safetensors``,
  ``vae/qwen_image_vae.safetensors`` (ComfyUI's Wan VAE key names).

Sizes (:data:`TINY`): DiT dim 64 (2 heads of 32), 2 layers; text encoder hidden 32
(2 heads of 16, 1 kv head), 2 layers, the real 152064-token vocabulary (so the
real tokenizer's ids fit), vision tower depth 2, width 32; VAE base_dim 16 with
the real 16 latent channels. About 30 MB per layout, deterministic for a seed.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpoints.dit import DiTConfig, create_dit, scaled_axes_dim
from .checkpoints.layouts import LAYOUT_DIFFUSERS, LAYOUT_SINGLE_FILES, ModelFiles
from .checkpoints.processor import QWEN25_VL_IMAGE_PROCESSOR_DEFAULTS
from .checkpoints.scaled_fp8 import MARKER_KEY
from .checkpoints.text_encoder import (
    LM_HEAD,
    TextEncoderConfig,
    create_text_encoder,
    hf_key,
    scaled_mrope_section,
)
from .checkpoints.vae import VAEConfig, create_vae, diffusers_to_comfy_keys
from .checkpoints.variants import EDIT, EDIT_2509, EDIT_2511, VARIANTS

logger = logging.getLogger(__name__)

LAYOUTS = ("diffusers", "comfy_single")
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")
FP8_MAX = 448.0  # largest float8_e4m3fn value


@dataclass(frozen=True)
class TinySizes:
    """Sizes of the tiny checkpoints."""

    dit_dim: int = 64
    dit_heads: int = 2
    dit_layers: int = 2
    text_hidden: int = 32
    text_layers: int = 2
    text_heads: int = 2
    text_kv_heads: int = 1
    text_intermediate: int = 64
    vocab: int = 152064
    vision_depth: int = 2
    vision_hidden: int = 32
    vision_heads: int = 2
    vision_intermediate: int = 64
    vae_base_dim: int = 16


TINY = TinySizes()


def tiny_configs(sizes: TinySizes = TINY) -> tuple[DiTConfig, TextEncoderConfig, VAEConfig]:
    """The model configs the tiny files are written at (and that the loader must infer back)."""
    head_dim = sizes.dit_dim // sizes.dit_heads
    dit = DiTConfig(
        dim=sizes.dit_dim,
        num_layers=sizes.dit_layers,
        num_heads=sizes.dit_heads,
        head_dim=head_dim,
        text_dim=sizes.text_hidden,
        axes_dim=scaled_axes_dim(head_dim),
    )
    text = TextEncoderConfig(
        hidden_size=sizes.text_hidden,
        num_layers=sizes.text_layers,
        num_heads=sizes.text_heads,
        num_kv_heads=sizes.text_kv_heads,
        intermediate_size=sizes.text_intermediate,
        vocab_size=sizes.vocab,
        mrope_section=scaled_mrope_section(sizes.text_hidden // sizes.text_heads),
        vision_depth=sizes.vision_depth,
        vision_hidden_size=sizes.vision_hidden,
        vision_num_heads=sizes.vision_heads,
        vision_intermediate_size=sizes.vision_intermediate,
        vision_out_hidden_size=sizes.text_hidden,
        vision_fullatt_block_indexes=(sizes.vision_depth - 1,),
    )
    vae = VAEConfig(base_dim=sizes.vae_base_dim)
    return dit, text, vae


# ----------------------------------------------------------------------------- tensors


def _random_state(
    shapes: Mapping[str, tuple[int, ...]],
    *,
    seed: int,
    init: Callable[[str, tuple[int, ...], torch.Generator], torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {key: init(key, shapes[key], generator).to(dtype).contiguous() for key in sorted(shapes)}


def _is_norm(key: str, shape: tuple[int, ...]) -> bool:
    return key.endswith(".gamma") or (len(shape) == 1 and "norm" in key and key.endswith(".weight"))


def _transformer_init(key: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Norms 1, everything else N(0, 0.02)."""
    if _is_norm(key, shape):
        return torch.ones(shape)
    return torch.randn(shape, generator=generator) * 0.02


def _conv_init(key: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Norm gammas 1, biases 0, conv weights N(0, 1/fan_in): deep conv stacks need fan-in scaling to stay lively."""
    if key.endswith(".gamma"):
        return torch.ones(shape)
    if len(shape) == 1:
        return torch.zeros(shape)
    fan_in = 1
    for size in shape[1:]:
        fan_in *= size
    return torch.randn(shape, generator=generator) / fan_in**0.5


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()}


def tiny_state_dicts(*, seed: int = 0, sizes: TinySizes = TINY) -> dict[str, dict[str, torch.Tensor]]:
    """Tiny weights in DiffSynth names: ``{"dit", "text_encoder", "vae"}`` -> name -> bf16 tensor.

    Shapes come from DiffSynth's own modules built on ``meta`` at the tiny sizes; the text encoder also gets
    ``lm_head.weight`` (vocab x hidden), which released diffusers files hold and the loader does not read.
    """
    dit_config, text_config, vae_config = tiny_configs(sizes)
    text_shapes = {**_shapes(create_text_encoder(text_config)),
                   LM_HEAD: (text_config.vocab_size, text_config.hidden_size)}
    return {
        "dit": _random_state(_shapes(create_dit(dit_config)), seed=seed, init=_transformer_init),
        "text_encoder": _random_state(text_shapes, seed=seed + 1, init=_transformer_init),
        "vae": _random_state(_shapes(create_vae(vae_config)), seed=seed + 2, init=_conv_init),
    }


def quantize_scaled_fp8(tensors: Mapping[str, torch.Tensor], linear_weights: set[str]) -> dict[str, torch.Tensor]:
    """ComfyUI fp8_scaled form: each listed weight -> float8_e4m3fn + float32 ``scale_weight``; plus the marker.

    ``scale = amax / 448`` per tensor, ``W8 = (W / scale).to(float8_e4m3fn)``; others unchanged.
    """
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if key in linear_weights:
            scale = tensor.float().abs().amax().clamp(min=1e-12) / FP8_MAX
            out[key] = (tensor.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            out[key[: -len("weight")] + "scale_weight"] = scale.reshape(())
        else:
            out[key] = tensor
    out[MARKER_KEY] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out


def cast_fp8_e4m3fn(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Comfy-Org's ``*_fp8_e4m3fn`` DiT form: every 2-D weight cast to float8_e4m3fn (no scale), the rest as is."""
    return {k: v.to(torch.float8_e4m3fn) if v.ndim == 2 and k.endswith(".weight") else v for k, v in tensors.items()}


def comfy_linear_weights(state: Mapping[str, torch.Tensor]) -> set[str]:
    """Weights of the layers ComfyUI builds as ``ops.Linear`` (2-D ``.weight`` except the token embedding)."""
    return {k for k, v in state.items() if k.endswith(".weight") and v.ndim == 2 and "embed_tokens" not in k}


# ----------------------------------------------------------------------------- writing


def _save(tensors: Mapping[str, torch.Tensor], path: Path) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(dict(tensors), str(path), metadata={"format": "pt"})
    return path


def _save_sharded(tensors: Mapping[str, torch.Tensor], folder: Path, stem: str, shards: int = 2) -> list[Path]:
    """Write ``<stem>-0000i-of-0000n.safetensors`` and ``<stem>.safetensors.index.json``."""
    keys = sorted(tensors)
    per_shard = -(-len(keys) // shards)
    paths, weight_map, total = [], {}, 0
    for i in range(shards):
        part = keys[i * per_shard : (i + 1) * per_shard]
        name = f"{stem}-{i + 1:05d}-of-{shards:05d}.safetensors"
        paths.append(_save({k: tensors[k] for k in part}, folder / name))
        weight_map.update(dict.fromkeys(part, name))
        total += sum(tensors[k].numel() * tensors[k].element_size() for k in part)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(folder / f"{stem}.safetensors.index.json", index)
    return paths


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _copy_tokenizer(source: Path, target: Path) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(source / name, target / name)
    return target


def _dit_json(config: DiTConfig, variant: str) -> dict[str, Any]:
    data = {
        "_class_name": "QwenImageTransformer2DModel",
        "_diffusers_version": "0.36.0",
        "attention_head_dim": config.head_dim,
        "axes_dims_rope": list(config.axes_dim),
        "guidance_embeds": False,
        "in_channels": config.in_channels,
        "joint_attention_dim": config.text_dim,
        "num_attention_heads": config.num_heads,
        "num_layers": config.num_layers,
        "out_channels": config.out_channels // 4,
        "patch_size": 2,
    }
    if variant == EDIT_2511:
        data["zero_cond_t"] = True
    return data


def _text_encoder_json(config: TextEncoderConfig) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        **config.hf_text_sizes(),
        "tie_word_embeddings": False,
        "vision_config": config.hf_vision_sizes(),
    }


def _vae_json(config: VAEConfig) -> dict[str, Any]:
    return {
        "_class_name": "AutoencoderKLQwenImage",
        "attn_scales": [],
        "base_dim": config.base_dim,
        "dim_mult": list(config.dim_mult),
        "dropout": 0.0,
        "num_res_blocks": config.num_res_blocks,
        "temperal_downsample": list(config.temperal_downsample),
        "z_dim": config.z_dim,
    }


def _model_index(variant: str) -> dict[str, Any]:
    pipeline = "QwenImageEditPipeline" if variant == EDIT else "QwenImageEditPlusPipeline"
    return {
        "_class_name": pipeline,
        "_diffusers_version": "0.36.0",
        "processor": ["transformers", "Qwen2VLProcessor"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
    }


def dit_file_name(variant: str) -> str:
    """Comfy-Org's DiT file name for ``variant``."""
    return {
        EDIT: "qwen_image_edit_bf16.safetensors",
        EDIT_2509: "qwen_image_edit_2509_bf16.safetensors",
        EDIT_2511: "qwen_image_edit_2511_bf16.safetensors",
    }[variant]


def write_tiny_checkpoints(
    root: Path | str,
    layout: str,
    *,
    comfy_tokenizer_dir: Path | str,
    variant: str = EDIT_2509,
    seed: int = 0,
) -> dict[str, Any]:
    """Write tiny real checkpoints of ``layout`` under ``root``.

    Args:
        root: output folder (created); for ``"diffusers"`` it *is* the model folder.
        layout: ``"diffusers"`` or ``"comfy_single"``.
        comfy_tokenizer_dir: ComfyUI's ``comfy/text_encoders/qwen25_tokenizer`` (copied into
            ``processor/`` and ``tokenizer/`` for the diffusers layout).
        variant: ``"edit"``, ``"edit_2509"`` or ``"edit_2511"``; decides model_index.json,
            ``zero_cond_t`` in transformer/config.json and the Comfy DiT file name.
        seed: weights are a deterministic function of the seed.

    Returns:
        A dict: ``"layout"``, ``"root"``, ``"variant"``, ``"files"`` (a :class:`ModelFiles`, not yet
        validated; for comfy_single it uses the bf16 text encoder), ``"dit"``, ``"text_encoder"``,
        ``"vae"`` (lists of paths), ``"text_encoder_fp8"`` and ``"dit_fp8"`` (comfy_single only), ``"processor_dir"``
        and ``"tokenizer_dir"`` (diffusers only, else None), ``"configs"`` (the DiT / text encoder /
        VAE configs written), ``"total_bytes"``.

    Raises:
        ValueError: unknown layout or variant.
        FileNotFoundError: tokenizer files missing from ``comfy_tokenizer_dir``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    root = Path(root)
    comfy_tokenizer_dir = Path(comfy_tokenizer_dir)
    missing = [n for n in TOKENIZER_FILES if not (comfy_tokenizer_dir / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{comfy_tokenizer_dir} lacks {missing}; pass comfy/text_encoders/qwen25_tokenizer")

    dit_config, text_config, vae_config = tiny_configs()
    states = tiny_state_dicts(seed=seed)
    text_hf = {hf_key(k): v for k, v in states["text_encoder"].items()}
    result: dict[str, Any] = {
        "layout": layout,
        "root": root,
        "variant": variant,
        "configs": {"dit": dit_config, "text_encoder": text_config, "vae": vae_config},
        "processor_dir": None,
        "tokenizer_dir": None,
    }
    if layout == "diffusers":
        result["dit"] = _save_sharded(states["dit"], root / "transformer", "diffusion_pytorch_model")
        result["text_encoder"] = _save_sharded(text_hf, root / "text_encoder", "model")
        result["vae"] = [_save(states["vae"], root / "vae" / "diffusion_pytorch_model.safetensors")]
        _write_json(root / "transformer" / "config.json", _dit_json(dit_config, variant))
        _write_json(root / "text_encoder" / "config.json", _text_encoder_json(text_config))
        _write_json(root / "vae" / "config.json", _vae_json(vae_config))
        _write_json(root / "model_index.json", _model_index(variant))
        processor_dir = _copy_tokenizer(comfy_tokenizer_dir, root / "processor")
        _write_json(
            processor_dir / "preprocessor_config.json",
            {
                **QWEN25_VL_IMAGE_PROCESSOR_DEFAULTS,
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": "Qwen2VLProcessor",
            },
        )
        result["processor_dir"] = processor_dir
        result["tokenizer_dir"] = _copy_tokenizer(comfy_tokenizer_dir, root / "tokenizer")
        result["files"] = ModelFiles(
            layout=LAYOUT_DIFFUSERS,
            dit=tuple(result["dit"]),
            text_encoder=tuple(result["text_encoder"]),
            vae=tuple(result["vae"]),
            processor_dir=result["processor_dir"],
            tokenizer_dir=result["tokenizer_dir"],
            root=root,
        )
    else:
        comfy_text = {k: v for k, v in text_hf.items() if k != LM_HEAD}
        comfy_vae = {new: states["vae"][old] for old, new in diffusers_to_comfy_keys(states["vae"]).items()}
        result["dit"] = [_save(states["dit"], root / "diffusion_models" / dit_file_name(variant))]
        result["dit_fp8"] = _save(cast_fp8_e4m3fn(states["dit"]),
                                  root / "diffusion_models" / dit_file_name(variant).replace("_bf16", "_fp8_e4m3fn"))
        result["text_encoder"] = [_save(comfy_text, root / "text_encoders" / "qwen_2.5_vl_7b.safetensors")]
        result["text_encoder_fp8"] = _save(
            quantize_scaled_fp8(comfy_text, comfy_linear_weights(comfy_text)),
            root / "text_encoders" / "qwen_2.5_vl_7b_fp8_scaled.safetensors",
        )
        result["vae"] = [_save(comfy_vae, root / "vae" / "qwen_image_vae.safetensors")]
        result["files"] = ModelFiles(
            layout=LAYOUT_SINGLE_FILES,
            dit=tuple(result["dit"]),
            text_encoder=tuple(result["text_encoder"]),
            vae=tuple(result["vae"]),
        )
    result["total_bytes"] = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    logger.info("wrote tiny %s checkpoints (%s, %d bytes) to %s", layout, variant, result["total_bytes"], root)
    return result


def describe(result: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON-friendly summary of :func:`write_tiny_checkpoints`'s result (paths as strings)."""

    def plain(value: Any) -> Any:
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if hasattr(value, "__dataclass_fields__"):
            return plain(asdict(value))
        return value

    return {k: plain(v) for k, v in result.items()}
