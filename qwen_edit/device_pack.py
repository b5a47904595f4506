"""A built group of weights moved into one allocation, so the build's short-lived tensors leave no holes behind.

Building the DiT block by block (``dit_build``) allocates large short-lived tensors (the block's file tensors, its
bf16 weights, the quantization's temporaries) between the small tensors that stay (fp8 row scales, biases, norm
weights). A memory pool gives memory back to the driver only where nothing that stays sits, and under
cudaMallocAsync (ComfyUI's default allocator where the driver supports it) ``torch.cuda.empty_cache()`` then
returned less than 1 GiB of the 5 to 8 GiB the card held above the built DiT's 19.12 GiB (decision 0016).
Copying each finished block's tensors into one buffer of their own lets every temporary page go.

Cost: one device-to-device copy of each block's bytes (0.32 GiB a block in fp8) and, for that copy, one block's
bytes more at the build's peak.
"""

from __future__ import annotations

import torch
from torch import nn

from .tensor_slots import Slot, aligned_bytes, carve, set_slot, tensor_slots


@torch.no_grad()
def pack_tensors(module: nn.Module, device: torch.device | str, *, leave: nn.Module | None = None) -> int:
    """Move every parameter and buffer under ``module`` that is on ``device`` (none under ``leave``) into one new
    uint8 buffer there, each an aligned view of it; returns the buffer's bytes (0 when nothing was moved).

    Values, shapes, dtypes and ``nn.Parameter`` objects stay; only where the data lives changes. Tensors elsewhere
    (``meta``, host memory) are left as they are, and so are tensors that share storage with another tensor (tied
    weights, views of one another), so the sharing holds.
    """
    device = torch.device(device)
    left = {id(m) for m in leave.modules()} if leave is not None else set()
    slots = [slot for slot in tensor_slots(module) if id(slot[0]) not in left
             and _same_device(getattr(slot[0], slot[1]).device, device)]
    slots = _unshared(slots)
    if not slots:
        return 0
    tensors = [getattr(owner, name) for owner, name, _ in slots]
    buffer = torch.empty(aligned_bytes(tensors), dtype=torch.uint8, device=tensors[0].device)
    offset = 0
    for (owner, name, is_param), tensor in zip(slots, tensors, strict=True):
        view, offset = carve(buffer, offset, tensor)
        view.copy_(tensor.detach())
        set_slot(owner, name, is_param, view)
    return buffer.numel()


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` name one device where the current device is 0."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def _unshared(slots: list[Slot]) -> list[Slot]:
    """The slots whose storage no other slot uses."""
    users: dict[tuple, int] = {}
    keys = []
    for owner, name, _ in slots:
        tensor = getattr(owner, name)
        key = (tensor.device, tensor.untyped_storage().data_ptr())
        keys.append(key)
        users[key] = users.get(key, 0) + 1
    return [slot for slot, key in zip(slots, keys, strict=True) if users[key] == 1]
