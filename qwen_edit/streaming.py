"""Weights kept in pinned host memory and copied to the GPU one layer at a time while the model runs.

For a model used briefly and rarely (the text encoder: once per new prompt), holding all of it on the GPU
costs memory the DiT needs. :class:`LayerStreaming` keeps the weights of a list of *units* (submodules such
as decoder layers) in page-locked host memory. A forward pre-hook copies a unit's weights to the device
right before it runs; a forward hook drops the device copy right after. Everything outside the units stays on
the device. The weights never change, so nothing is copied back.

Cost: one host-to-device copy of the units' bytes per forward (8 GB for the 7B text encoder in fp8: about
0.3 s at PCIe 5 speed); device memory: the non-unit weights plus one unit.

Host memory: one plain allocation per unit holding its tensors back to back, page-locked with
``cudaHostRegister`` (PyTorch's pinned-memory allocator rounds each block up to a power of two: up to twice the
bytes).

Hardware: needs CUDA (page-locked memory); on other devices there is nothing to gain and :func:`stream_layers`
is not used.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from .tensor_slots import aligned_bytes, carve, set_slot, tensor_slots

logger = logging.getLogger(__name__)


PIN_THREADS = 8
"""Units page-locked and copied at a time by :meth:`LayerStreaming.add_all` (``cudaHostRegister`` releases the
GIL; the 8.3 GB fp8 text encoder took 4.4 s with one thread and 3.0 s with 8 on an H200 host)."""

class HostArena:
    """One page-locked host buffer that tensors are carved from (``cudaHostRegister`` on a plain allocation).

    The registration is dropped when the arena is released; tensors carved from it stay valid (they keep the
    memory) but copy at pageable speed after that.
    """

    def __init__(self, nbytes: int):
        self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self.offset = 0
        self._registered = False
        status = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.buffer.numel(), 0)
        if int(status) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed with CUDA error {int(status)}")
        self._registered = True

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A tensor of ``like``'s shape and dtype in the arena, holding a copy of ``like``."""
        out, self.offset = carve(self.buffer, self.offset, like)
        out.copy_(like.detach().reshape(like.shape))
        return out

    def release(self) -> None:
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self._registered = False

    def __del__(self) -> None:
        self.release()


def _pinned_copy(unit: nn.Module) -> tuple[HostArena, list[tuple[nn.Module, str, bool, torch.Tensor]]]:
    """A new pinned arena holding a copy of each of ``unit``'s tensors, and where each belongs (``unit`` is not
    changed: safe on a worker thread)."""
    with torch.no_grad():
        slots = tensor_slots(unit)
        arena = HostArena(aligned_bytes([getattr(owner, name) for owner, name, _ in slots]))
        return arena, [(owner, name, is_param, arena.take(getattr(owner, name))) for owner, name, is_param in slots]


class LayerStreaming:
    """Streams units of a model from pinned host memory to ``device`` (see the module docstring).

    Units are added one at a time (:meth:`add`), each into its own page-locked arena, so a builder can send a
    unit to host memory as soon as it is made and the device never holds all of them at once;
    :meth:`place_rest` then puts everything outside the units on the device. :func:`stream_layers` does both
    for a model that already exists.

    Args:
        device: the CUDA device the model computes on.
        hooks: True: each unit is entered through its own ``forward``, and forward hooks copy it in and drop it;
            False: the caller brackets each use with :meth:`onload` / :meth:`offload` (a forward that calls a
            function on the unit's tensors instead of the unit).

    ``host_bytes`` / ``device_bytes`` say how much lives where.
    """

    def __init__(self, device: torch.device | str, hooks: bool = True):
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"layer streaming needs a CUDA device, got {self.device}")
        self.hooks = hooks
        self.units: list[nn.Module] = []
        self.arenas: list[HostArena] = []
        self._host: dict[int, list[tuple[nn.Module, str, bool, torch.Tensor]]] = {}
        self._handles = []
        self.host_bytes = 0
        self.device_bytes = 0

    @torch.no_grad()
    def add(self, unit: nn.Module) -> None:
        """Move ``unit``'s tensors (on any device) into a new pinned arena; its old storage is freed once nothing
        else refers to it."""
        if id(unit) not in self._host:
            self._attach(unit, *_pinned_copy(unit))

    @torch.no_grad()
    def add_all(self, units: Sequence[nn.Module], threads: int = PIN_THREADS) -> None:
        """:meth:`add` each of ``units`` in order, ``threads`` of them pinned and copied at a time (page-locking
        is most of the cost, and runs in parallel); at most ``threads`` copies exist beside their originals."""
        if threads < 1:
            raise ValueError(f"threads must be positive, got {threads}")
        todo = [unit for unit in dict.fromkeys(units) if id(unit) not in self._host]
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="qwen-edit-pin") as pool:
            window: deque[tuple[nn.Module, Future]] = deque()
            try:
                for unit in todo:
                    window.append((unit, pool.submit(_pinned_copy, unit)))
                    if len(window) >= threads:
                        done, future = window.popleft()
                        self._attach(done, *future.result())
                while window:
                    done, future = window.popleft()
                    self._attach(done, *future.result())
            finally:
                for _, future in window:
                    future.cancel()

    def _attach(self, unit: nn.Module, arena: HostArena, entries: list[tuple[nn.Module, str, bool, torch.Tensor]]
                ) -> None:
        for owner, name, is_param, host in entries:
            set_slot(owner, name, is_param, host)
            self.host_bytes += host.numel() * host.element_size()
        self._host[id(unit)] = entries
        self.units.append(unit)
        self.arenas.append(arena)
        if self.hooks:
            self._handles.append(unit.register_forward_pre_hook(lambda unit, _args: self.onload(unit)))
            self._handles.append(unit.register_forward_hook(lambda unit, _args, _output: self.offload(unit)))

    @torch.no_grad()
    def place_rest(self, model: nn.Module) -> None:
        """Put every tensor of ``model`` outside the units on the device (``device_bytes`` counts them)."""
        if not self.units:
            raise ValueError("layer streaming needs at least one unit")
        in_units = {id(m) for unit in self.units for m in unit.modules()}
        self.device_bytes = 0
        for owner in model.modules():
            if id(owner) in in_units:
                continue
            for name, tensor in [*owner._parameters.items(), *owner._buffers.items()]:
                if tensor is None:
                    continue
                if tensor.device != self.device:
                    set_slot(owner, name, name in owner._parameters, tensor.detach().to(self.device))
                self.device_bytes += tensor.numel() * tensor.element_size()
        logger.info("layer streaming: %d units, %.2f GiB in pinned host memory, %.2f GiB on %s", len(self.units),
                    self.host_bytes / 2**30, self.device_bytes / 2**30, self.device)

    def streams(self, unit: nn.Module) -> bool:
        """Whether ``unit`` is one of the streamed units."""
        return id(unit) in self._host

    def onload(self, unit: nn.Module) -> None:
        """Copy ``unit``'s weights to the device (asynchronously, in stream order with the work that follows)."""
        with torch.no_grad():
            for owner, name, is_param, host in self._host[id(unit)]:
                set_slot(owner, name, is_param, host.to(self.device, non_blocking=True))

    def offload(self, unit: nn.Module) -> None:
        """Point ``unit``'s weights back at their host copies; the device copies are freed in stream order."""
        for owner, name, is_param, host in self._host[id(unit)]:
            set_slot(owner, name, is_param, host)

    def remove(self) -> None:
        """Stop streaming: hooks removed, the host memory unregistered (the units' weights stay readable there)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for arena in self.arenas:
            arena.release()


def stream_layers(model: nn.Module, units: Sequence[nn.Module], device: torch.device | str,
                  hooks: bool = True) -> LayerStreaming:
    """Stream ``units`` of ``model`` (see :class:`LayerStreaming`); kept on the model as ``layer_streaming``."""
    streaming = LayerStreaming(device, hooks)
    streaming.add_all(units)
    streaming.place_rest(model)
    model.layer_streaming = streaming
    return streaming
