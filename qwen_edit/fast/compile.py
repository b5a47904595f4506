"""Regional compilation for the fast forward: one ``torch.compile`` of :func:`.block.fast_block` for all blocks.

The fast forward calls ``fast_block(block, ...)`` with the block module as an argument instead of
calling ``block(...)``, so compiling ``block._call_impl`` (``qwen_edit.compile``) does not apply to
it. :meth:`.prepared.PreparedDit.compile_blocks` makes a model's forward use a compiled ``fast_block`` instead.
Dynamo inlines the block module (``inline_inbuilt_nn_modules``, on by default since PyTorch 2.5): its parameters
and buffers are graph inputs, so one compiled graph serves the first 59 blocks (same structure), a second one the
last block (which computes only the target tokens after its attention: ``ForwardOptions.trim_last_block``), and
changing weights in place (a LoRA strength) never recompiles. The block's fused kernels arrive as a frozen
``BlockKernels`` value, which Dynamo guards by value.

Shapes: with ``dynamic=None`` (default) the sequence dims (image tokens, text tokens) are marked
dynamic before each call (``torch._dynamo.maybe_mark_dynamic``), so a new resolution or prompt
length reuses the graph; the batch size stays static (batch 1 and batch 2 are two graphs).
``dynamic=False`` specializes on every shape; ``dynamic=True`` makes every dim dynamic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .block import fast_block

__all__ = ["CompiledBlocks", "compiled_blocks", "mark_sequence_dynamic"]


@dataclass(frozen=True)
class CompiledBlocks:
    """The block function a model's fast forward uses, and how it was compiled."""

    fn: Callable
    backend: str | Callable
    mode: str | None
    dynamic: bool | None
    fullgraph: bool

    @property
    def marks_sequence_dynamic(self) -> bool:
        return self.dynamic is None


@functools.cache
def _compiled(backend: str | Callable, mode: str | None, dynamic: bool | None, fullgraph: bool) -> Callable:
    """One ``torch.compile`` wrapper per setting: dynamo caches graphs per code object, so every model compiled with
    the same settings shares them."""
    return torch.compile(fast_block, backend=backend, mode=mode, dynamic=dynamic, fullgraph=fullgraph)


def compiled_blocks(mode: str | None = None, dynamic: bool | None = None, fullgraph: bool = False,
                    backend: str | Callable = "inductor") -> CompiledBlocks:
    """The compiled block function for these settings.

    Args:
        mode: ``torch.compile`` mode (None = default, ``"max-autotune-no-cudagraphs"``, ...).
        dynamic: None (sequence dims dynamic, batch static), False (static) or True (all dynamic).
        fullgraph: True raises on any graph break inside a block. Off by default because the
            Transformer Engine fp8 layers run eager (a graph break each); the pack's other layers
            (``nn.Linear``, ``ScaledMMLinear``, ``WeightOnlyLinear``) and the attention backends trace
            without breaks (tests/unit/test_fast_forward_compile.py checks).
        backend: ``torch.compile`` backend (``"inductor"``; tests count graphs with their own).

    Compilation itself happens on the first forward, under the recompile limit of
    ``qwen_edit.compile.dynamo_settings``.
    """
    if mode is not None and backend != "inductor":
        raise ValueError(f"mode={mode!r} applies to the inductor backend only, not {backend!r}")
    return CompiledBlocks(_compiled(backend, mode, dynamic, fullgraph), backend, mode, dynamic, fullgraph)


def mark_sequence_dynamic(*tensors_and_dims: tuple[torch.Tensor | None, int]) -> None:
    """``maybe_mark_dynamic`` each (tensor, dim) pair (None tensors are skipped)."""
    for tensor, dim in tensors_and_dims:
        if tensor is not None:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
