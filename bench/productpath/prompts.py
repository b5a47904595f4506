"""The prompts bench/product_path.py queues: the shipped API workflows with the written files put in, and ComfyUI
core's own Qwen-Image-Edit graph."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workflows import CORE_SHIFT, INPUT_IMAGE, PROMPT

from .plans import MODEL_PATH, Job
from .sampling import MIB

ROOT = Path(__file__).resolve().parents[2]
API_DIR = ROOT / "example_workflows" / "api"
FULL_SIZE, FULL_STEPS = 1024, 40
TINY_SIZE, TINY_STEPS = 128, 2
CORE_CFG = 4.0
PROMPTS = (
    PROMPT,
    "Turn the sky into a clear night full of stars.",
    "Make it look like a watercolor painting.",
    "Add a red hot-air balloon high in the sky.",
    "Change the season to winter with snow on the ground.",
    "Make the sun a deep orange and lower it to the horizon.",
    "Add a small wooden house on the hill.",
    "Turn the grass golden as in late autumn.",
    "Add soft fog over the ground.",
    "Make the scene look like a pencil sketch.",
    "Add a flock of birds flying to the left.",
    "Replace the sun with a full moon.",
    "Make the colors pastel and soft.",
    "Add a rainbow across the sky.",
    "Turn it into a pixel-art scene.",
    "Add a lake reflecting the sky in the foreground.",
    "Make the sky stormy with dark clouds.",
    "Add a road leading to the horizon.",
    "Render it in the style of a vintage postcard.",
    "Add a lighthouse on the right.",
    "Make it look like a sunrise over the sea.",
)



@dataclass(frozen=True)
class ModelFiles:
    """File names ComfyUI lists for the workflows' loaders (found in the models folder)."""

    dit: str
    text_encoder: str
    vae: str
    loras: dict[int, str]

    @classmethod
    def find(cls, models: Path) -> ModelFiles:
        def first(folder: str, pattern: str, required: bool = True) -> str | None:
            found = sorted(p.name for p in (models / folder).glob(pattern))
            if not found and required:
                raise SystemExit(f"no {pattern} in {models / folder}: write the files first "
                                 "(bench/full_size_files.py)")
            return found[0] if found else None

        loras = {steps: name for steps in (4, 8)
                 if (name := first("loras", f"*Lightning-{steps}steps*.safetensors", required=False))}
        return cls(first("diffusion_models", "qwen_image_edit*.safetensors"),
                   first("text_encoders", "qwen_2.5_vl*.safetensors"), first("vae", "qwen_image_vae*.safetensors"),
                   loras)


def shipped_prompt(job: Job, files: ModelFiles, seed: int, text: str | None, tiny: bool) -> dict[str, Any]:
    """The shipped API workflow with the written files, ``seed`` and (if given) prompt ``text`` put in."""
    name = f"qwen_edit_{job.name}"
    prompt = json.loads((API_DIR / f"{name}.json").read_text())
    if job.name == MODEL_PATH and ("lora" in job.options or "strength" in job.options):
        _add_model_lora(prompt, job, files)
    for node in prompt.values():
        inputs, kind = node["inputs"], node["class_type"]
        if kind == "QwenEditHopper_Load":
            inputs.update(diffusion_model=files.dit, text_encoder=files.text_encoder, vae=files.vae)
            if "host_blocks" in job.options:
                inputs["host_blocks"] = int(job.options["host_blocks"])
        elif kind == "QwenEditHopper_FuseLoRA":
            steps = int(job.options.get("lora") or (8 if "8steps" in inputs["lora_name"] else 4))
            if steps not in files.loras:
                raise SystemExit(f"{job.label}: no {steps}-step Lightning LoRA among the written files")
            inputs["lora_name"] = files.loras[steps]
            if "strength" in job.options:
                inputs["strength"] = float(job.options["strength"])
        elif kind == "QwenEditHopper_Compile" and job.options.get("graphs") == "off":
            inputs["cuda_graphs"] = False
        elif kind == "UNETLoader":
            inputs["unet_name"] = files.dit
        elif kind == "CLIPLoader":
            inputs["clip_name"] = files.text_encoder
        elif kind == "VAELoader":
            inputs["vae_name"] = files.vae
        elif kind == "KSampler":
            inputs["seed"] = seed
            if text is not None:
                prompt[inputs["positive"][0]]["inputs"]["prompt"] = text
            if tiny:
                inputs["steps"] = min(inputs["steps"], TINY_STEPS)
        elif kind in ("QwenEditHopper_Sampler", "QwenEditHopper_Benchmark"):
            inputs["seed"] = seed
            if text is not None:
                inputs["prompt"] = text
            if tiny:
                inputs["steps"] = min(inputs["steps"], TINY_STEPS)
                inputs["width"] = inputs["height"] = TINY_SIZE
                inputs["reference_megapixels"] = round(max(0.01, TINY_SIZE * TINY_SIZE / MIB), 4)
                if kind == "QwenEditHopper_Benchmark":
                    inputs.update(warmup=0, repeats=1)
    return prompt


def _add_model_lora(prompt: dict[str, Any], job: Job, files: ModelFiles) -> None:
    """The MODEL path with a Lightning LoRA (``lora=4|8``, default 4) at ``strength`` (default 1) through ComfyUI's
    own LoraLoaderModelOnly between the UNETLoader and what reads its MODEL: what a user who adds a LoRA to that
    workflow wires. A strength change between prompts is then ComfyUI's patches on the same loaded model."""
    steps = int(job.options.get("lora") or 4)
    if steps not in files.loras:
        raise SystemExit(f"{job.label}: no {steps}-step Lightning LoRA among the written files")
    loader = next(k for k, n in prompt.items() if n["class_type"] == "UNETLoader")
    lora_id = str(max(int(k) for k in prompt) + 1)
    for node in prompt.values():
        for key, value in node["inputs"].items():
            if value == [loader, 0]:
                node["inputs"][key] = [lora_id, 0]
    strength = float(job.options.get("strength") or 1.0)
    prompt[lora_id] = {"class_type": "LoraLoaderModelOnly", "inputs": {
        "model": [loader, 0], "lora_name": files.loras[steps], "strength_model": strength}}


def core_prompt(job: Job, files: ModelFiles, seed: int, text: str, tiny: bool,
                object_info: dict[str, Any]) -> dict[str, Any]:
    """ComfyUI core's Qwen-Image-Edit-2509 graph on the same files (module docstring); inputs a version lacks
    (``resolution_steps`` before 0.33) are left out, as its /object_info says."""
    steps = TINY_STEPS if tiny else FULL_STEPS
    megapixels = round(max(0.01, TINY_SIZE * TINY_SIZE / MIB), 4) if tiny else 1.0
    scale = {"image": ["1", 0], "upscale_method": "lanczos", "megapixels": megapixels}
    scale_inputs = object_info.get("ImageScaleToTotalPixels", {}).get("input", {})
    if "resolution_steps" in {**scale_inputs.get("required", {}), **scale_inputs.get("optional", {})}:
        scale["resolution_steps"] = 1
    prompt = {
        "1": {"class_type": "LoadImage", "inputs": {"image": INPUT_IMAGE}},
        "2": {"class_type": "ImageScaleToTotalPixels", "inputs": scale},
        "3": {"class_type": "UNETLoader", "inputs": {"unet_name": files.dit, "weight_dtype": "default"}},
        "4": {"class_type": "CLIPLoader", "inputs": {"clip_name": files.text_encoder, "type": "qwen_image"}},
        "5": {"class_type": "VAELoader", "inputs": {"vae_name": files.vae}},
        "6": {"class_type": "ModelSamplingAuraFlow", "inputs": {"model": ["3", 0], "shift": CORE_SHIFT}},
        "7": {"class_type": "TextEncodeQwenImageEditPlus",
              "inputs": {"clip": ["4", 0], "prompt": text, "vae": ["5", 0], "image1": ["2", 0]}},
        "8": {"class_type": "TextEncodeQwenImageEditPlus",
              "inputs": {"clip": ["4", 0], "prompt": "", "vae": ["5", 0], "image1": ["2", 0]}},
        "9": {"class_type": "VAEEncode", "inputs": {"pixels": ["2", 0], "vae": ["5", 0]}},
        "10": {"class_type": "KSampler", "inputs": {
            "model": ["6", 0], "seed": seed, "steps": steps, "cfg": CORE_CFG, "sampler_name": "euler",
            "scheduler": "simple", "positive": ["7", 0], "negative": ["8", 0], "latent_image": ["9", 0],
            "denoise": 1.0}},
        "11": {"class_type": "VAEDecode", "inputs": {"samples": ["10", 0], "vae": ["5", 0]}},
        "12": {"class_type": "SaveImage", "inputs": {"images": ["11", 0], "filename_prefix": "core"}},
    }
    if "compile" in job.options:
        prompt["13"] = {"class_type": "TorchCompileModel", "inputs": {"model": ["3", 0], "backend": "inductor"}}
        prompt["6"]["inputs"]["model"] = ["13", 0]
    return prompt


