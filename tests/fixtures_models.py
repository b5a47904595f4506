"""Tiny real checkpoints for the server fixtures (see scripts/tiny_models.py), and empty files with the full-size
names for runs that must stop before any file is read."""

from pathlib import Path

from tiny_models import DIFFUSERS_FOLDER, FORMAT_LORAS, LIGHTNING_LORAS, install_tiny_models

__all__ = ["DIFFUSERS_FOLDER", "FORMAT_LORAS", "LIGHTNING_LORAS", "empty_full_size_names", "install_tiny_models"]


def empty_full_size_names(models: Path) -> Path:
    """Empty files under ``models`` with the full-size files' names (bench/full_size_files.py: the fp8 DiT, the
    fp8_scaled text encoder, the VAE), for the product path tool's runs that end before reading a file."""
    for folder, name in (("diffusion_models", "qwen_image_edit_2509_fp8_e4m3fn.safetensors"),
                         ("text_encoders", "qwen_2.5_vl_7b_fp8_scaled.safetensors"),
                         ("vae", "qwen_image_vae.safetensors")):
        (models / folder).mkdir(parents=True, exist_ok=True)
        (models / folder / name).write_bytes(b"")
    return models
