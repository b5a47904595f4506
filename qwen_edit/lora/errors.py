"""Errors raised while reading, parsing or fusing LoRA files.

Every message names the file (or the label given for an in-memory state dict)
and, where one is at fault, the key and the shapes involved, so the node can
show it to the user as is.
"""

from __future__ import annotations

__all__ = ["LoraError", "LoraFileError", "LoraFormatError", "LoraMatchError"]


class LoraError(ValueError):
    """Base class: anything wrong with a LoRA the user asked for."""


class LoraFileError(LoraError):
    """The file cannot be read: not .safetensors, a pickle, a corrupted header, missing."""


class LoraFormatError(LoraError):
    """The file reads but its tensors are inconsistent (rank vs alpha, shapes vs target)."""


class LoraMatchError(LoraError):
    """No key of the file maps onto the target model (a LoRA for another architecture)."""
