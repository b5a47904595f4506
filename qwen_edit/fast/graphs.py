"""Whole-forward CUDA graphs for the fast forward: captured once per input signature, then replayed.

The compiled fp8 forward launches about 2,000 kernels (60 blocks). Issued one by one from Python, the GPU
waits on the host for part of each forward: 187.8 ms per forward against 185.2 ms for the same forward
captured in one CUDA graph (H200). With Compile Model's ``cuda_graphs``, :class:`.prepared.PreparedDit` holds a
:class:`ForwardGraphs` and ``fast_model_fn`` runs through it:

* a signature is everything the forward's host-side code branches on: each input tensor's shape, dtype
  and device, the valid text lengths (read from the mask on the host before anything is captured), size,
  zero_cond_t, attention backend, text padding mode and the kernel plan;
* a new signature: one eager forward on a side stream (it compiles, builds cuDNN plans and fills the
  RoPE and modulation caches), then one capture into the model's memory pool, then the replay: the first
  call of a signature costs about two forwards plus the capture's host time; at most ``max_graphs``
  signatures are kept (least recently used dropped);
* each call copies its inputs into the graph's input buffers, replays, and returns a copy of the output;
* the graphs read weights at fixed addresses, so every call compares the addresses of the model's parameters
  and buffers with those at capture (about 0.1 ms for 2,000 tensors) and drops every graph when one moved
  (the model moved to another device and back). Tensors replaced in a module are not seen by that check:
  whoever replaces them calls :meth:`.prepared.PreparedDit.invalidate` (the runtime does when it rebuilds a model).
  In-place changes (a LoRA fused into the same tensors) keep the graphs valid: they read the new values.

Memory: the graphs share one private pool per model that keeps one forward's intermediate tensors
reserved between calls (what the forward's peak already holds).

A capture that fails raises RuntimeError with the cause; nothing falls back silently.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...fp8.capability import Capability

__all__ = ["ForwardGraphs", "allocator_capability", "cuda_graphs_capability"]

logger = logging.getLogger(__name__)


def allocator_capability() -> Capability:
    """Whether PyTorch's CUDA allocator in this process allows CUDA graphs (the native allocator does).

    Under ``cudaMallocAsync`` (``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``, which ComfyUI sets by default
    where the driver supports it), memory allocated during a capture is a graph memory node with no device address
    until the graph is launched, so Triton kernels (Inductor's and the pack's) refuse the capture's pointers, and a
    failed capture leaves allocations the allocator cannot free later (the process aborts). Graphs need PyTorch's
    native allocator: start ComfyUI with ``--disable-cuda-malloc``.
    """
    backend = torch.cuda.get_allocator_backend()
    if backend == "native":
        return Capability.yes("PyTorch's native CUDA allocator")
    return Capability.no(f"PyTorch's CUDA allocator here is {backend} (ComfyUI's default where the driver supports "
                         "it), under which Triton kernels cannot be captured; start ComfyUI with --disable-cuda-malloc "
                         "to use CUDA graphs (measured through the server: about 1% faster per step)")


def cuda_graphs_capability(dit: torch.nn.Module) -> Capability:
    """Whether whole-forward CUDA graphs can run for ``dit`` here: on CUDA, under :func:`allocator_capability`."""
    device = next((t.device for t in dit.parameters()), torch.device("cpu"))
    if device.type != "cuda":
        return Capability.no(f"the model is on {device.type}, CUDA graphs need a CUDA device")
    return allocator_capability()


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, Any]
    output: torch.Tensor


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    return value


def _static_copy(value: Any) -> Any:
    """A contiguous copy of a tensor (or of each tensor of a list): the graph's fixed input buffer."""
    if isinstance(value, torch.Tensor):
        return value.clone(memory_format=torch.contiguous_format)
    if isinstance(value, (list, tuple)):
        return [_static_copy(v) for v in value]
    return value


def _copy_into(static: Any, value: Any) -> None:
    if isinstance(static, torch.Tensor):
        static.copy_(value)
    elif isinstance(static, list):
        for s, v in zip(static, value, strict=True):
            _copy_into(s, v)


class ForwardGraphs:
    """One model's captured forwards, by signature. ``run`` is called by ``fast_model_fn``; ``dit`` is the model
    whose tensors the graphs read (its parameters and buffers are collected here, their addresses checked per call).
    """

    def __init__(self, dit: torch.nn.Module, max_graphs: int = 4):
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[Any, _Captured] = OrderedDict()
        self._pool = None
        self._tensors: list[torch.Tensor] = [*dit.parameters(), *dit.buffers()]
        self._addresses: tuple[int, ...] | None = None
        self.captures = 0
        self.replays = 0
        self.warmups = 1
        """Eager forwards before a capture (they compile and fill the caches the capture must not build)."""

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every graph (and, once nothing else holds it, the memory pool)."""
        self._graphs.clear()
        self._pool = None

    def _weights_moved(self, dit: torch.nn.Module) -> bool:
        """Whether one of the model's tensors moved to another storage since the last look (a move to another
        device and back). Then the tensors are collected again from ``dit``."""
        addresses = tuple(map(torch.Tensor.data_ptr, self._tensors))
        moved = addresses != self._addresses
        if moved and self._addresses is not None:
            self._tensors = [*dit.parameters(), *dit.buffers()]
            addresses = tuple(map(torch.Tensor.data_ptr, self._tensors))
        self._addresses = addresses
        return moved

    def run(self, dit: torch.nn.Module, forward: Callable[..., torch.Tensor], inputs: dict[str, Any],
            options: dict[str, Any]) -> torch.Tensor:
        """``forward(dit, **inputs, **options)`` through the graph for this signature (captured on first use).

        inputs: the tensors (or lists of tensors, or None) that change between calls; options: the
        hashable host-side arguments. Returns a fresh tensor (the graph's output buffer is reused).
        """
        if self._weights_moved(dit) and self._graphs:
            logger.info("fast forward: weights moved; dropping %d CUDA graph(s)", len(self._graphs))
            self.clear()
        key = (tuple((name, _signature(v)) for name, v in inputs.items()), tuple(sorted(options.items())))
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(dit, forward, inputs, options)
            self._graphs[key] = entry
            # the warm-up forward may have moved a watched tensor (seen in the e2e benchmark: the call after the
            # first capture found one moved); the graph reads the addresses it was captured with
            self._weights_moved(dit)
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
            for name, value in inputs.items():
                _copy_into(entry.inputs[name], value)
        entry.graph.replay()
        self.replays += 1
        return entry.output.clone()

    def _capture(self, dit: torch.nn.Module, forward: Callable[..., torch.Tensor], inputs: dict[str, Any],
                 options: dict[str, Any]) -> _Captured:
        static = {name: _static_copy(value) for name, value in inputs.items()}
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(self.warmups):
                forward(dit, **static, **options)
        current.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                output = forward(dit, **static, **options)
        except Exception as exc:
            raise RuntimeError(f"CUDA graph capture of the fast forward failed ({type(exc).__name__}: {exc}); "
                               "turn cuda_graphs off in Compile Model to run kernel by kernel") from exc
        self.captures += 1
        logger.info("fast forward: captured a CUDA graph (%d kept)", len(self._graphs) + 1)
        return _Captured(graph, static, output)
