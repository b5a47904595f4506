"""Regional ``torch.compile`` of a ComfyUI Qwen-Image MODEL: an ``APPLY_MODEL`` wrapper on the clone.

Each transformer block of whatever ``diffusion_model`` runs (ComfyUI's, or the fp8 copy of :mod:`.fp8_model`) is
swapped for its ``torch.compile``-d module for the duration of one ``apply_model`` call and put back after (the
pattern of ComfyUI's ``comfy_api.torch_helpers.set_torch_compile_wrapper``, but on the blocks that run now, so an
object-patched fp8 copy is the one compiled). All blocks share one code object, so Inductor compiles one graph
for them; weights are graph inputs, so new values (a LoRA strength change) never recompile. Blocks that
:mod:`.block_replace` runs as the pack's ``fast_block`` get one compiled ``fast_block`` with the same settings
(:meth:`CompiledBlocks.compiled_function`, found through :func:`compile_wrapper`).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

WRAPPER_KEY = "qwen_edit_hopper.compile"


class CompiledBlocks:
    """APPLY_MODEL wrapper: runs ``diffusion_model.transformer_blocks`` compiled (mode, dynamic)."""

    def __init__(self, mode: str, dynamic: bool):
        self.mode = None if mode == "default" else mode
        self.dynamic = dynamic
        self.compile_kwargs: dict = {}
        self._compiled: dict[int, tuple[torch.nn.Module, torch.nn.Module]] = {}
        self._functions: dict = {}

    def compiled(self, block: torch.nn.Module) -> torch.nn.Module:
        entry = self._compiled.get(id(block))
        if entry is None or entry[0] is not block:
            entry = (block, torch.compile(block, mode=self.mode, dynamic=self.dynamic, **self.compile_kwargs))
            self._compiled[id(block)] = entry
        return entry[1]

    def compiled_function(self, fn):
        """``torch.compile(fn)`` with this wrapper's settings (made once per function)."""
        compiled = self._functions.get(fn)
        if compiled is None:
            compiled = torch.compile(fn, mode=self.mode, dynamic=self.dynamic, **self.compile_kwargs)
            self._functions[fn] = compiled
        return compiled

    def __call__(self, executor, *args, **kwargs):
        blocks = executor.class_obj.diffusion_model.transformer_blocks
        originals = list(blocks)
        try:
            for i, block in enumerate(originals):
                blocks[i] = self.compiled(block)
            return executor(*args, **kwargs)
        finally:
            for i, block in enumerate(originals):
                blocks[i] = block


def compile_wrapper(transformer_options: dict) -> CompiledBlocks | None:
    """The :class:`CompiledBlocks` wrapper of a model call's ``transformer_options`` (as ComfyUI's samplers hand them
    to the model: ``wrappers`` copied from the MODEL), or None."""
    from comfy.patcher_extension import WrappersMP

    for wrapper in transformer_options.get("wrappers", {}).get(WrappersMP.APPLY_MODEL, {}).get(WRAPPER_KEY, ()):
        if isinstance(wrapper, CompiledBlocks):
            return wrapper
    return None


def set_compile(model, mode: str, dynamic: bool) -> CompiledBlocks:
    """Add the regional-compile wrapper to ``model`` (a ComfyUI MODEL clone, changed in place)."""
    from comfy.patcher_extension import WrappersMP

    wrapper = CompiledBlocks(mode, dynamic)
    model.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY)
    model.add_wrapper_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY, wrapper)
    return wrapper
