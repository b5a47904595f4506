"""Our models inside ComfyUI's memory manager.

Each model the runtime holds is wrapped in a ``RuntimeModelPatcher`` and
loaded through ``comfy.model_management.load_models_gpu``, so ComfyUI sees
it, counts it, and can unload it (``/free``, or another node needing VRAM).
Unloading drops the model from the runtime (it is re-read from disk when a
prompt needs it again); ComfyUI never moves half of one of our modules.
"""

from __future__ import annotations

import logging
from pathlib import Path

import comfy.model_management as mm
import comfy.model_patcher
import torch

from ..qwen_edit.compute_dtype import compute_dtype
from ..qwen_edit.memory import Resident
from ..qwen_edit.runtime import PlanRuntime, get_runtime

logger = logging.getLogger(__name__)


class RuntimeModelPatcher(comfy.model_patcher.ModelPatcher):
    """A ModelPatcher for a whole, already-placed module: loads are no-ops, unloads evict it."""

    def __init__(self, resident: Resident, runtime: PlanRuntime, hooks: ComfyHooks):
        self.resident_key = resident.key
        self.runtime = runtime
        self.hooks = hooks
        self.label = resident.label
        super().__init__(resident.module, load_device=runtime.device, offload_device=torch.device("cpu"),
                         size=resident.nbytes)
        self.model.model_loaded_weight_memory = resident.nbytes

    def model_dtype(self):
        return self.runtime.dtype

    def current_loaded_device(self):
        return self.load_device

    def loaded_size(self):
        return self.size if self.model is not None else 0

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        return 0

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        return None

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        return 0

    def detach(self, unpatch_all=True):
        """``unpatch_all`` False is ComfyUI re-registering the same model (a "clone" reload): keep it."""
        if unpatch_all:
            logger.info("ComfyUI unloads %s", self.label)
            self.runtime.evict(self.resident_key)
            try:
                with torch.no_grad():
                    self.model.to("meta")  # frees the weights now; the empty shell dies outside ComfyUI's loops
            except Exception as error:  # ComfyUI unloads in its prompt worker: a raise there ends the worker
                logger.warning("unloading %s: its tensors could not be dropped at once (%s: %s); the runtime let "
                               "go of it, so they are freed when it is collected", self.label, type(error).__name__,
                               error)
            self.hooks.bury(self)
        return self.model

    def model_patches_models(self):
        return []


class ComfyHooks:
    """MemoryHooks backed by comfy.model_management.

    Unloaded patchers are kept (as weightless shells) until our next call: if
    one died inside ComfyUI's unload loop, its model finalizer would edit
    ``current_loaded_models`` while ComfyUI iterates over it by index.
    """

    def __init__(self):
        self.runtime: PlanRuntime | None = None
        self._buried: list[RuntimeModelPatcher] = []

    def bury(self, patcher: RuntimeModelPatcher) -> None:
        self._buried.append(patcher)

    def register(self, resident: Resident) -> RuntimeModelPatcher:
        self._buried.clear()
        return RuntimeModelPatcher(resident, self.runtime, self)

    def use(self, residents: list[Resident]) -> None:
        self._buried.clear()
        mm.load_models_gpu([r.handle for r in residents if r.handle is not None])

    def forget(self, resident: Resident) -> None:
        patcher = resident.handle
        for index in range(len(mm.current_loaded_models) - 1, -1, -1):
            if mm.current_loaded_models[index].model is patcher:
                mm.current_loaded_models.pop(index)

    def reserve(self, nbytes: int) -> None:
        if self.runtime.device.type != "cpu":
            mm.free_memory(nbytes * 1.1, self.runtime.device)

    def available_bytes(self, device: torch.device) -> int:
        """ComfyUI's free memory on ``device`` (its allocator's unused blocks included) plus every loaded model's
        bytes there: ComfyUI unloads models to make room when we ``reserve``."""
        unloadable = 0
        for loaded in list(mm.current_loaded_models):
            patcher = loaded.model
            if patcher is not None and torch.device(loaded.device) == torch.device(device):
                unloadable += patcher.loaded_size()
        return int(mm.get_free_memory(device)) + unloadable


def comfy_tokenizer_dir() -> Path:
    """ComfyUI's own Qwen2.5 tokenizer files (vocab.json, merges.txt, tokenizer_config.json)."""
    return Path(mm.__file__).resolve().parent / "text_encoders" / "qwen25_tokenizer"


def runtime() -> PlanRuntime:
    """The pack's process-wide runtime on ComfyUI's torch device, with ComfyUI's memory hooks."""

    def factory() -> PlanRuntime:
        hooks = ComfyHooks()
        device = mm.get_torch_device()
        rt = PlanRuntime(device, compute_dtype(device), hooks=hooks, comfy_tokenizer_dir=comfy_tokenizer_dir())
        hooks.runtime = rt
        return rt

    return get_runtime(factory)
