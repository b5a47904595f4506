"""Where a module's tensors live, and how to point a slot at another tensor: shared by the host-memory streaming
and the device packing of built weights."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

ALIGN = 256
"""Byte alignment of each tensor carved from a shared buffer (enough for any dtype, Inductor's 16-byte input
alignment and fast copies)."""

Slot = tuple[nn.Module, str, bool]
"""``(owner, name, is_parameter)``: one parameter or buffer, by the module that owns it."""


def tensor_slots(module: nn.Module) -> list[Slot]:
    """Every parameter and buffer under ``module`` (each owner's own, None entries left out)."""
    slots: list[Slot] = []
    for owner in module.modules():
        slots += [(owner, name, True) for name, t in owner._parameters.items() if t is not None]
        slots += [(owner, name, False) for name, t in owner._buffers.items() if t is not None]
    return slots


def aligned_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of a buffer that holds ``tensors`` back to back, each starting at a multiple of :data:`ALIGN`."""
    return sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors) + ALIGN


def carve(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A view of ``buffer`` (1-D uint8) with ``like``'s shape and dtype at the first aligned offset from ``offset``,
    and the offset after it. Raises RuntimeError when it does not fit (a sizing bug)."""
    size = like.numel() * like.element_size()
    start = -(-offset // ALIGN) * ALIGN
    if start + size > buffer.numel():
        raise RuntimeError("tensor buffer overflow (a builder bug: sizes were counted before)")
    return buffer[start:start + size].view(like.dtype).view(like.shape), start + size


def set_slot(owner: nn.Module, name: str, is_param: bool, value: torch.Tensor) -> None:
    """Point a slot at ``value`` (a parameter keeps its ``nn.Parameter`` object and takes ``value`` as data)."""
    if is_param:
        owner._parameters[name].data = value
    else:
        owner._buffers[name] = value
