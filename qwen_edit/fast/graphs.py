"""Whole-forward CUDA graphs for the fast forward: captured once per input signature, then replayed.

The compiled fp8 forward launches about 2,000 kernels (60 blocks). Issued one by one from Python, the GPU
waits on the host for part of each forward: 187.8 ms per forward against 185.2 ms for the same forward
captured in one CUDA graph (H200, ``bench/cfg_batch_bench.py``, docs/benchmarks.md). With
:func:`enable_cuda_graphs` (Compile Model's ``cuda_graphs``), ``fast_model_fn`` runs through
:class:`ForwardGraphs`:

* a signature is everything the forward's host-side code branches on: each input tensor's shape, dtype
  and device, the valid text lengths (read from the mask on the host before anything is captured), size,
  zero_cond_t, attention backend, text padding mode;
* a new signature: one eager forward on a side stream (it compiles, builds cuDNN plans and fills the
  RoPE and modulation caches), then one capture into the model's memory pool, then the replay: the first
  call of a signature costs about two forwards plus the capture's host time; at most ``max_graphs``
  signatures are kept (least recently used dropped);
* each call copies its inputs into the graph's input buffers, replays, and returns a copy of the output;
* the graphs read weights at fixed addresses, so every call compares the addresses of all parameters
  and buffers with those at capture (about 0.1 ms for 2,000 tensors) and drops every graph when one moved
  (a LoRA swapped in, the model offloaded and back). Tensors replaced in a module are caught by
  module/parameter/buffer registration hooks. In-place changes (a LoRA fused into the same tensors) keep
  the graphs valid: they read the new values.

Memory: the graphs share one private pool per model that keeps one forward's intermediate tensors
reserved between calls (what the forward's peak already holds).

A capture that fails raises RuntimeError with the cause; nothing falls back silently.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ForwardGraphs", "cuda_graphs_enabled", "disable_cuda_graphs", "enable_cuda_graphs", "forward_graphs"]

logger = logging.getLogger(__name__)

_REGISTRY: weakref.WeakKeyDictionary[torch.nn.Module, ForwardGraphs] = weakref.WeakKeyDictionary()
_GENERATION = [0]
"""Bumped whenever any module registers a parameter, buffer or submodule (hooks installed on first use)."""
_TOUCHED: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()
"""The generation at which each module last registered a parameter, buffer or submodule."""
_HOOKS: list = []


def _bump(module: torch.nn.Module, *_args) -> None:
    _GENERATION[0] += 1
    _TOUCHED[module] = _GENERATION[0]


def _install_hooks() -> None:
    if not _HOOKS:
        module = torch.nn.modules.module
        _HOOKS.extend([module.register_module_parameter_registration_hook(_bump),
                       module.register_module_buffer_registration_hook(_bump),
                       module.register_module_module_registration_hook(_bump)])  # fmt: skip


def enable_cuda_graphs(dit: torch.nn.Module, max_graphs: int = 4) -> ForwardGraphs:
    """Run ``dit``'s fast forwards on CUDA through whole-forward CUDA graphs (kept: see the module docstring)."""
    if max_graphs < 1:
        raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
    _install_hooks()
    graphs = _REGISTRY.get(dit)
    if graphs is None or graphs.max_graphs != max_graphs:
        graphs = _REGISTRY[dit] = ForwardGraphs(max_graphs)
        logger.info("fast forward: whole-forward CUDA graphs on (at most %d input signatures)", max_graphs)
    return graphs


def disable_cuda_graphs(dit: torch.nn.Module) -> None:
    """Run ``dit``'s fast forwards kernel by kernel again (its graphs and their memory are released)."""
    graphs = _REGISTRY.pop(dit, None)
    if graphs is not None:
        graphs.clear()


def forward_graphs(dit: torch.nn.Module) -> ForwardGraphs | None:
    return _REGISTRY.get(dit)


def cuda_graphs_enabled(dit: torch.nn.Module) -> bool:
    return dit in _REGISTRY


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
    """One model's captured forwards, by signature. ``run`` is called by ``fast_model_fn``."""

    def __init__(self, max_graphs: int = 4):
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[Any, _Captured] = OrderedDict()
        self._pool = None
        self._tensors: list[torch.Tensor] = []
        self._generation = -1
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
        """Whether ``dit`` changed since the last look: one of its modules registered a parameter, buffer or
        submodule (a replaced layer, even one holding the same tensors), or a tensor's storage moved.

        The registration hooks are process-wide: a module built elsewhere (a text encoder, a VAE) bumps the
        generation too, and must not drop this model's graphs. So a bump makes this look at ``dit``'s own
        modules, and collect and compare its tensors again."""
        if self._generation != _GENERATION[0]:
            since = self._generation
            self._tensors = [*dit.parameters(), *dit.buffers()]
            self._generation = _GENERATION[0]
            if any(_TOUCHED.get(module, -1) > since for module in dit.modules()):
                self._addresses = None
        addresses = tuple(map(torch.Tensor.data_ptr, self._tensors))
        moved = addresses != self._addresses
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
