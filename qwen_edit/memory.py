"""How the runtime tells a host (ComfyUI) about the models it holds.

The runtime never imports ComfyUI. A host installs ``MemoryHooks`` so that
its memory manager can see our models and unload them (ComfyUI's ``/free``,
or another node that needs the VRAM); unloading calls back into
``PlanRuntime.evict``. Without a host, models simply stay where they were
built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


def module_bytes(module: torch.nn.Module, device: torch.device | None = None) -> int:
    """Bytes held by a module's parameters and buffers (shared storages counted once), on ``device`` only
    when given (a model streamed from host memory holds most of its bytes there)."""
    seen: set[int] = set()
    total = 0
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor.device.type == "meta" or (device is not None and tensor.device.type != device.type):
            continue
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += tensor.untyped_storage().nbytes()
    return total


@dataclass
class Resident:
    """One model the runtime holds: its cache key, the module, its bytes on the compute device, and the host's
    handle for it. ``prepared``: for the DiT, its ``qwen_edit.fast.prepared.PreparedDit`` (what the fast forward
    keeps for it); None for the other models."""

    key: tuple
    module: torch.nn.Module
    nbytes: int
    label: str
    handle: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    prepared: Any = None


class MemoryHooks(Protocol):
    """What a host implements to manage our models' memory."""

    def register(self, resident: Resident) -> Any:
        """Called once per new model; returns the host's handle (kept in ``resident.handle``)."""

    def use(self, residents: list[Resident]) -> None:
        """Called before a stage runs: make these models resident on the compute device."""

    def forget(self, resident: Resident) -> None:
        """Called when the runtime drops a model on its own (not at the host's request)."""

    def reserve(self, nbytes: int) -> None:
        """Called before a model of about ``nbytes`` is built: make room on the compute device."""

    def available_bytes(self, device: torch.device) -> int:
        """Bytes a prompt could use on ``device``: free now plus what the host would unload for it."""


class NoHost:
    """Hooks for use without ComfyUI: nothing to register, models stay where they are."""

    def register(self, resident: Resident) -> None:
        return None

    def use(self, residents: list[Resident]) -> None:
        return None

    def forget(self, resident: Resident) -> None:
        return None

    def reserve(self, nbytes: int) -> None:
        return None

    def available_bytes(self, device: torch.device) -> int:
        """Free device memory plus what PyTorch's allocator holds unused (nothing else unloads without a host)."""
        if device.type != "cuda":
            return 1 << 62
        free, _total = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
