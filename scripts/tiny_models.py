"""Write a tiny Qwen-Image-Edit model set into a ComfyUI ``models`` folder (tests and the main job).

Real key layouts and file names, a few layers, random weights: the same
loading code as the 20B model runs on them in seconds on a CPU.

- ``diffusion_models/``: the 2509 DiT (and Edit / 2511 DiTs, same weights, for variant detection)
- ``text_encoders/``: ``qwen_2.5_vl_7b.safetensors`` and its ``_fp8_scaled`` twin
- ``vae/``: ``qwen_image_vae.safetensors`` (ComfyUI layout)
- ``qwen_edit/Qwen-Image-Edit-2509-tiny/``: the diffusers/ModelScope folder layout
- ``loras/``: the Lightning 4/8-step names the workflows use, and one tiny LoRA per key format
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from comfy_server import COMFYUI_DIR
from pack import load_pack

DIFFUSERS_FOLDER = "Qwen-Image-Edit-2509-tiny"
LIGHTNING_LORAS = {
    "Qwen-Image-Edit-2509-Lightning-4steps-V1.0-bf16.safetensors": 4,
    "Qwen-Image-Edit-2509-Lightning-8steps-V1.0-bf16.safetensors": 8,
}
FORMAT_LORAS = ("peft", "peft_default", "kohya", "comfy_prefix", "transformer_prefix", "loha", "lokr")


def tokenizer_dir() -> Path:
    return COMFYUI_DIR / "comfy" / "text_encoders" / "qwen25_tokenizer"


def install_tiny_models(models_dir: Path) -> dict[str, Path]:
    """Write everything listed in the module docstring; return the main paths by role."""
    load_pack()
    from qwen_edit_hopper.qwen_edit.checkpoints.shapes import dit_weight_shapes
    from qwen_edit_hopper.qwen_edit.lora.testing import write_tiny_lora
    from qwen_edit_hopper.qwen_edit.tiny import dit_file_name, write_tiny_checkpoints

    models_dir = Path(models_dir)
    single = write_tiny_checkpoints(models_dir, "comfy_single", comfy_tokenizer_dir=tokenizer_dir(),
                                    variant="edit_2509")
    for variant in ("edit", "edit_2511"):
        with tempfile.TemporaryDirectory() as scratch:
            other = write_tiny_checkpoints(Path(scratch), "comfy_single", comfy_tokenizer_dir=tokenizer_dir(),
                                           variant=variant)
            shutil.copy(other["dit"][0], models_dir / "diffusion_models" / dit_file_name(variant))
    write_tiny_checkpoints(models_dir / "qwen_edit" / DIFFUSERS_FOLDER, "diffusers",
                           comfy_tokenizer_dir=tokenizer_dir(), variant="edit_2509")
    shapes = dit_weight_shapes(single["files"])
    loras = models_dir / "loras"
    loras.mkdir(parents=True, exist_ok=True)
    for index, name in enumerate(LIGHTNING_LORAS):
        write_tiny_lora(loras / name, "lightning", shapes, rank=4, alpha=4.0, seed=100 + index, std=0.02)
    for index, fmt in enumerate(FORMAT_LORAS):
        # LoHa/LoKr deltas are products of two factor products: larger factors give a visible effect
        std = 0.3 if fmt in ("loha", "lokr") else 0.05
        write_tiny_lora(loras / f"tiny_{fmt}.safetensors", fmt, shapes, rank=4, alpha=2.0, seed=200 + index,
                        std=std)
    return {"dit": single["dit"][0], "text_encoder": single["text_encoder"][0], "vae": single["vae"][0],
            "loras": loras, "diffusers": models_dir / "qwen_edit" / DIFFUSERS_FOLDER}
