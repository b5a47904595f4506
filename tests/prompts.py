"""API-format prompts for the tests, built like the shipped workflows (same node ids and inputs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

NO_FOLDER = "(none: use the three files)"
DIT = "qwen_image_edit_2509_bf16.safetensors"
TEXT_ENCODER = "qwen_2.5_vl_7b.safetensors"
TEXT_ENCODER_FP8 = "qwen_2.5_vl_7b_fp8_scaled.safetensors"
VAE = "qwen_image_vae.safetensors"


def write_image(path: Path, width: int = 96, height: int = 64, seed: int = 0, mode: str = "RGB") -> str:
    """A deterministic test picture; returns its file name (for LoadImage)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / width, y / height, 0.5 + 0 * x], axis=-1) * 200 + rng.integers(0, 40, (height, width, 3))
    channels = base.astype("uint8")
    if mode == "RGBA":
        alpha = (255 * (x > width // 2)).astype("uint8")[..., None]
        channels = np.concatenate([channels, alpha], axis=-1)
    Image.fromarray(channels, mode).save(path)
    return path.name


def loader(dit: str = DIT, text_encoder: str = TEXT_ENCODER, vae: str = VAE, folder: str = NO_FOLDER,
           variant: str = "auto", attention: str = "auto") -> dict[str, Any]:
    return {"class_type": "QwenEditHopper_Load", "inputs": {
        "diffusion_model": dit, "text_encoder": text_encoder, "vae": vae, "diffusers_folder": folder,
        "variant": variant, "attention": attention}}


def sampler(pipe: list, image: list, *, prompt: str = "make it red", seed: int = 1, steps: int = 2,
            cfg: float = 4.0, width: int = 64, height: int = 48, scheduler: str = "auto",
            reference_megapixels: float = 0.01, **extra: Any) -> dict[str, Any]:
    inputs = {"pipe": pipe, "image": image, "prompt": prompt, "negative_prompt": " ", "seed": seed, "steps": steps,
              "cfg": cfg, "width": width, "height": height, "scheduler": scheduler,
              "reference_megapixels": reference_megapixels, **extra}
    return {"class_type": "QwenEditHopper_Sampler", "inputs": inputs}


def edit_prompt(image_name: str, *, load: dict | None = None, chain: list[dict] | None = None, prefix: str = "t",
                **sampler_kwargs: Any) -> dict[str, Any]:
    """LoadImage -> Load Qwen Edit -> (chain nodes, each taking the previous pipe) -> Sampler -> SaveImage."""
    prompt: dict[str, Any] = {
        "1": {"class_type": "LoadImage", "inputs": {"image": image_name}},
        "2": load or loader(),
    }
    pipe = ["2", 0]
    for index, node in enumerate(chain or [], start=10):
        node = {"class_type": node["class_type"], "inputs": {**node["inputs"], "pipe": pipe}}
        prompt[str(index)] = node
        pipe = [str(index), 0]
    prompt["3"] = sampler(pipe, ["1", 0], **sampler_kwargs)
    prompt["4"] = {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": prefix}}
    return prompt


def fuse_lora(name: str, strength: float = 1.0) -> dict[str, Any]:
    return {"class_type": "QwenEditHopper_FuseLoRA", "inputs": {"lora_name": name, "strength": strength}}


def apply_fp8(backend: str = "weight_only", **overrides: Any) -> dict[str, Any]:
    inputs = {"backend": backend, "te_recipe": "current", "fp8_format": "E4M3", "amax_history_len": 16,
              "amax_compute_algo": "max", "layers": "attn+mlp", "modulation": "fp8 storage", "fast_accum": True,
              **overrides}
    return {"class_type": "QwenEditHopper_ApplyFP8", "inputs": inputs}


def compile_model(mode: str = "default", dynamic: bool = True, warmup: bool = False,
                  warmup_size: int = 64) -> dict[str, Any]:
    return {"class_type": "QwenEditHopper_Compile",
            "inputs": {"mode": mode, "dynamic": dynamic, "warmup": warmup, "warmup_size": warmup_size}}


def read_image(path: Path):
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"))


EMULATING_NODES = ("QwenEditHopper_Load", "QwenEditHopper_ApplyFP8")
RUN_ON_FULL_WIDTH_FILES = {"qwen_edit_comfy_model_fp8": "ComfyUI's own Qwen-Image loaders build the released sizes "
                           "whatever the file holds, so the tiny files cannot run it; it runs through the server on "
                           "full-width one-block files in tests/integration/test_comfy_model_workflow.py"}
"""Shipped workflows the tests built on the tiny files open and check but do not run, with the reason."""


def emulating(prompt: dict[str, Any]) -> dict[str, Any]:
    """``prompt`` with ``where_unsupported: emulate`` on every node that has it: fp8 kernels this CPU cannot run
    become their fp32 reference paths (the nodes say EMULATED), as a user checking a workflow on a CPU sets it."""
    out = {node_id: {**node, "inputs": dict(node["inputs"])} for node_id, node in prompt.items()}
    for node in out.values():
        if node["class_type"] in EMULATING_NODES:
            node["inputs"]["where_unsupported"] = "emulate"
    return out
