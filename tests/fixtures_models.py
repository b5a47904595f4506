"""Tiny real checkpoints for the server fixtures (see scripts/tiny_models.py)."""

from tiny_models import DIFFUSERS_FOLDER, FORMAT_LORAS, LIGHTNING_LORAS, install_tiny_models

__all__ = ["DIFFUSERS_FOLDER", "FORMAT_LORAS", "LIGHTNING_LORAS", "install_tiny_models"]
