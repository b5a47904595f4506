"""A DiT prepared for the fast forward: what the forward keeps for one model, held with it.

:class:`PreparedDit` wraps one built DiffSynth ``QwenImageDiT`` and owns everything the fast forward keeps between
calls for it:

* the compile choice (:meth:`PreparedDit.compile_blocks`: one compiled block function for all blocks);
* the whole-forward CUDA graphs (:meth:`PreparedDit.enable_cuda_graphs`, :class:`.graphs.ForwardGraphs`);
* the kernel plans, one per signature (:meth:`PreparedDit.kernels`, :func:`.kernel_plan.select_kernels`);
* the modulation launch groups (:func:`.modulation.modulation_groups`; they hold the layers' weight addresses);
* RoPE tables and zero_cond_t's token selector per shape, valid text lengths per mask tensor;
* the blocks kept in page-locked host memory and copied to the GPU for each forward, when asked
  (``PreparedDit.streaming``, a :class:`...streaming.LayerStreaming`; the runtime sets it up).

Nothing of it lives anywhere else: two models never share state, and dropping the ``PreparedDit`` drops it all.
Whoever changes the model's structure (replaces a layer, a parameter or a buffer, moves the model) calls
:meth:`PreparedDit.invalidate`, or builds a new ``PreparedDit`` for a new model; values written into the same
tensors (a LoRA fused in place) need nothing: compiled graphs and CUDA graphs read the new values. CUDA graphs also
check, each call, that the model's tensors are where they were captured.

Use::

    prepared = PreparedDit(dit)
    prepared.compile_blocks()                      # optional
    pred = fast_model_fn(dit=prepared, latents=..., ...)
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .compile import CompiledBlocks, compiled_blocks
from .graphs import ForwardGraphs, cuda_graphs_capability
from .kernel_plan import DeviceFacts, ForwardShape, KernelPlan, select_kernels
from .modulation import modulation_groups
from .options import ForwardOptions
from .rope import rope_tables, target_selector
from .text import text_lengths

__all__ = ["PreparedDit"]

logger = logging.getLogger(__name__)

CACHE_ENTRIES = 16
"""Shapes (resolutions x text lengths x devices) and kernel-plan signatures remembered per model."""

TEXT_LENGTH_ENTRIES = 32
"""Mask tensors whose valid text lengths are remembered per model."""


def _remember(cache: OrderedDict, key: Any, build: Callable[[], Any], limit: int) -> Any:
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = cache[key] = build()
    while len(cache) > limit:
        cache.popitem(last=False)
    return value


class PreparedDit:
    """One DiT and what the fast forward keeps for it (see the module docstring).

    Attributes:
        module: the DiffSynth ``QwenImageDiT``.
        compiled: the compile choice, or None (eager blocks).
        graphs: the whole-forward CUDA graphs, or None (kernel by kernel).
        last_plan: the kernel plan of the last forward (for a run's summary), or None.
    """

    def __init__(self, module: torch.nn.Module, streaming: Any = None):
        self.module = module
        self.compiled: CompiledBlocks | None = None
        self.graphs: ForwardGraphs | None = None
        self._plans: OrderedDict[tuple, KernelPlan] = OrderedDict()
        self._tables: OrderedDict[tuple, Any] = OrderedDict()
        self._lengths: OrderedDict[int, tuple[weakref.ref, tuple[int, ...]]] = OrderedDict()
        self._modulation: tuple | None = None
        self.last_plan: KernelPlan | None = None
        self.streaming = streaming
        """The blocks kept in host memory (:class:`...streaming.LayerStreaming` made with ``hooks=False``), or None."""

    def __repr__(self) -> str:
        return (f"PreparedDit({type(self.module).__name__}, compiled={self.compiled is not None}, "
                f"cuda_graphs={self.graphs is not None}, plans={len(self._plans)})")

    # ----- compile and graphs ------------------------------------------------------------------
    def compile_blocks(self, mode: str | None = None, dynamic: bool | None = None, fullgraph: bool = False,
                       backend: str | Callable = "inductor") -> CompiledBlocks:
        """Run the blocks through one compiled ``fast_block`` (arguments: :func:`.compile.compiled_blocks`)."""
        self.compiled = compiled_blocks(mode, dynamic, fullgraph, backend)
        logger.info("fast forward: blocks compiled on first use (mode=%s, dynamic=%s)", mode, dynamic)
        return self.compiled

    def uncompile_blocks(self) -> None:
        """Run the blocks eagerly again."""
        self.compiled = None

    def enable_cuda_graphs(self, max_graphs: int = 4) -> ForwardGraphs:
        """Run CUDA forwards through whole-forward CUDA graphs (:mod:`.graphs`), at most ``max_graphs`` signatures.

        A model on the CPU keeps running kernel by kernel. Raises RuntimeError with
        :func:`.graphs.cuda_graphs_capability`'s reason for a CUDA model under an allocator graphs cannot work with
        (nothing is captured then).
        """
        capability = cuda_graphs_capability(self.module)
        if not capability.ok and any(t.is_cuda for t in self.module.parameters()):
            raise RuntimeError(f"CUDA graphs cannot be used: {capability.reason}")
        if self.graphs is None or self.graphs.max_graphs != max_graphs:
            self.graphs = ForwardGraphs(self.module, max_graphs)
            logger.info("fast forward: whole-forward CUDA graphs on (at most %d input signatures)", max_graphs)
        return self.graphs

    def cuda_graphs_capability(self):
        """Whether whole-forward CUDA graphs can run for this model here (:func:`.graphs.cuda_graphs_capability`,
        and no blocks streamed from host memory: their device copies move every forward)."""
        from ...fp8.capability import Capability

        if self.streaming is not None:
            return Capability.no(f"{len(self.streaming.units)} blocks are streamed from host memory (host_blocks), "
                                 "so their weights are at new addresses every forward")
        return cuda_graphs_capability(self.module)

    def disable_cuda_graphs(self) -> None:
        """Run forwards kernel by kernel again (the graphs and their memory are released)."""
        if self.graphs is not None:
            self.graphs.clear()
        self.graphs = None

    def invalidate(self) -> None:
        """Forget everything that depends on the model's structure or tensor addresses: CUDA graphs (captured again
        on the next call), modulation groups, kernel plans, RoPE tables and text lengths. The compile choice stays
        (compiled graphs guard on what they read)."""
        if self.graphs is not None:
            self.graphs = ForwardGraphs(self.module, self.graphs.max_graphs)
        self._modulation = None
        self._plans.clear()
        self.last_plan = None
        self._tables.clear()
        self._lengths.clear()

    # ----- what the forward reads ----------------------------------------------------------------
    def kernels(self, options: ForwardOptions, backend: str, shape: ForwardShape, device: torch.device) -> KernelPlan:
        """The :class:`.kernel_plan.KernelPlan` for this signature: the same object for the same signature (decided
        once by :func:`.kernel_plan.select_kernels`)."""
        key = (options, backend, shape, str(device))
        self.last_plan = _remember(self._plans, key,
                                   lambda: select_kernels(self.module, options, DeviceFacts.of(device), backend, shape),
                                   CACHE_ENTRIES)
        return self.last_plan

    def modulation_groups(self):
        """The two shared-input launch groups of the model's modulation linears (made on first use)."""
        if self._modulation is None:
            self._modulation = modulation_groups(self.module)
        return self._modulation

    def rope_tables(self, img_shapes: Sequence[tuple[int, int, int]], text_len: int, device: torch.device, *,
                    interpolation: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`.rope.rope_tables` for this model, kept per shape."""
        device = torch.device(device)
        key = ("rope", tuple(tuple(int(v) for v in s) for s in img_shapes), int(text_len), str(device), interpolation)
        return _remember(self._tables, key, lambda: rope_tables(self.module, img_shapes, text_len, device,
                                                                interpolation=interpolation), CACHE_ENTRIES)

    def target_selector(self, target_tokens: int, image_tokens: int, device: torch.device) -> torch.Tensor:
        """:func:`.rope.target_selector`, kept per shape."""
        key = ("target_selector", int(target_tokens), int(image_tokens), str(torch.device(device)))
        return _remember(self._tables, key, lambda: target_selector(target_tokens, image_tokens, device),
                         CACHE_ENTRIES)

    def text_lengths(self, mask: torch.Tensor) -> tuple[int, ...]:
        """:func:`.text.text_lengths` of ``mask``, read once per mask tensor (remembered while the tensor lives; a
        mask changed in place after its first use is not read again: pass ``txt_seq_lens`` to be explicit)."""
        entry = self._lengths.get(id(mask))
        if entry is not None and entry[0]() is mask:
            self._lengths.move_to_end(id(mask))
            return entry[1]
        lens = text_lengths(mask)
        self._lengths[id(mask)] = (weakref.ref(mask), lens)
        while len(self._lengths) > TEXT_LENGTH_ENTRIES:
            self._lengths.popitem(last=False)
        return lens
