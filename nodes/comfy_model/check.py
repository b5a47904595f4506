"""Which ComfyUI MODELs the fast path takes, and a message naming whatever it cannot honour.

Accepted: a ``ModelPatcher`` whose ``model.diffusion_model`` is ComfyUI's
``comfy.ldm.qwen_image.model.QwenImageTransformer2DModel`` (Qwen-Image, Qwen-Image-Edit, -2509, -2511; the zero
timestep conditioning of 2511 is ComfyUI's own forward, which keeps running), with high-precision weights
(bf16 / fp16 / fp32), weight patches of the kinds ``comfy.lora.calculate_weight`` knows, and no object patch or
weight hook inside the diffusion model. Anything else raises :class:`ComfyModelError` with what it found.
"""

from __future__ import annotations

import torch

QWEN_MODULE = "comfy.ldm.qwen_image.model"
QWEN_CLASS = "QwenImageTransformer2DModel"
HIGH_PRECISION = (torch.bfloat16, torch.float16, torch.float32)
PATCH_KINDS = ("diff", "set", "model_as_lora")
"""Tuple patch kinds ``comfy.lora.calculate_weight`` applies (besides its weight-adapter objects)."""


class ComfyModelError(ValueError):
    """The MODEL holds something the fast path cannot honour; the message names it and what to do."""


def qwen_diffusion_model(model, input_name: str = "model") -> torch.nn.Module:
    """The Qwen-Image DiT of a ComfyUI MODEL (the original one, even while a clone's object patch is applied).

    Raises ComfyModelError naming the model class for anything but ComfyUI's Qwen-Image DiT, and naming the
    object patch when something else already replaced (part of) the diffusion model.
    """
    if not hasattr(model, "get_model_object") or not hasattr(model, "model"):
        raise ComfyModelError(f"{input_name}: expected a ComfyUI MODEL (a ModelPatcher), got {type(model).__name__}")
    foreign = sorted(k for k in model.object_patches if k == "diffusion_model" or k.startswith("diffusion_model."))
    if foreign:
        raise ComfyModelError(f"{input_name}: the MODEL already carries object patch(es) {', '.join(foreign)} from "
                              "another node; connect this node directly after the loader / LoRA nodes")
    return check_qwen_class(model.get_model_object("diffusion_model"), input_name)


def check_qwen_class(module, input_name: str = "model") -> torch.nn.Module:
    """``module`` if it is ComfyUI's Qwen-Image DiT class, else ComfyModelError naming the class it is."""
    cls = type(module)
    if cls.__name__ != QWEN_CLASS or cls.__module__ != QWEN_MODULE:
        raise ComfyModelError(f"{input_name}: the MODEL holds {cls.__module__}.{cls.__name__}; these nodes know only "
                              f"ComfyUI's Qwen-Image DiT ({QWEN_MODULE}.{QWEN_CLASS}: Qwen-Image, Qwen-Image-Edit, "
                              "-2509, -2511)")
    return module


def check_weights(module: torch.nn.Module, input_name: str = "model") -> None:
    """Refuse weights that are not plain bf16 / fp16 / fp32 tensors (fp8 weight_dtype, quantized checkpoints)."""
    for name, param in module.named_parameters():
        in_block = name.endswith(".weight") and param.ndim == 2 and name.startswith("transformer_blocks.")
        if in_block and (type(param.data) is not torch.Tensor or param.dtype not in HIGH_PRECISION):
            raise ComfyModelError(
                f"{input_name}: weight {name} is {param.dtype} ({type(param.data).__name__}); FP8 is quantized from "
                "high-precision weights: load the bf16 checkpoint with UNETLoader weight_dtype 'default'")


def check_patches(model, keys: set[str], input_name: str = "model") -> None:
    """Refuse weight patches on ``keys`` (full ``diffusion_model.`` keys) that the fast path cannot apply."""
    adapter_base = _weight_adapter_base()
    for key in sorted(keys & set(model.patches)):
        for patch in model.patches[key]:
            value = patch[1]
            if adapter_base is not None and isinstance(value, adapter_base):
                continue
            if isinstance(value, tuple) and (len(value) == 1 or (len(value) == 2 and value[0] in PATCH_KINDS)):
                continue
            kind = value[0] if isinstance(value, tuple) and value else type(value).__name__
            raise ComfyModelError(f"{input_name}: weight patch of kind {kind!r} on {key} is not one this node can "
                                  "apply before FP8 quantization (known: LoRA/LoHa/LoKr/GLoRA adapters, "
                                  f"{', '.join(PATCH_KINDS)})")
        if model.weight_wrapper_patches.get(key):
            raise ComfyModelError(f"{input_name}: a weight wrapper is set on {key}; FP8 layers cannot honour it")
    if getattr(model, "hook_patches", None):
        raise ComfyModelError(f"{input_name}: the MODEL carries hook patches (scheduled / hooked LoRA); apply LoRAs "
                              "with LoraLoaderModelOnly instead")


def _weight_adapter_base():
    try:
        from comfy.weight_adapter import WeightAdapterBase
    except ImportError:
        return None
    return WeightAdapterBase
