"""Materializes plans: base weights read once, variants derived in a fixed order, memory reported.

Order, whatever order the nodes were wired in: LoRAs fused into the bf16
weights first (exactly reversible: the touched originals are kept and copied
back), then FP8 quantization into a separate module, then compilation. Every
model the runtime holds is a ``Resident`` announced to the host's
``MemoryHooks``, so ComfyUI can unload it; unloading evicts it here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .memory import MemoryHooks, NoHost, Resident, module_bytes
from .plan import LoraChoice, PipePlan

logger = logging.getLogger(__name__)


def files_identity(paths: tuple[Path, ...] | list[Path]) -> tuple:
    """Identity of a set of files: path, size and modification time of each (a changed file reloads)."""
    out = []
    for path in paths:
        stat = Path(path).stat()
        out.append((str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns))
    return tuple(out)


def bf16_bytes_estimate(paths) -> int:
    """Bytes a set of checkpoint files takes once loaded in bf16 (fp8 files are dequantized: twice their size)."""
    total = 0
    for path in paths:
        size = Path(path).stat().st_size
        total += 2 * size if "fp8" in Path(path).name.lower() else size
    return total


@contextlib.contextmanager
def building() -> Iterator[None]:
    """Build models outside inference mode so their tensors are ordinary (calibration may need autograd)."""
    with torch.inference_mode(False), torch.no_grad():
        yield


class PlanRuntime:
    """Process-wide cache of materialized models, keyed by what they were built from.

    Args:
        device: compute device for every model (``cuda``/``cpu``).
        dtype: compute dtype of non-FP8 weights (bf16).
        hooks: the host's memory hooks (``NoHost`` without ComfyUI).
        comfy_tokenizer_dir: ComfyUI's ``comfy/text_encoders/qwen25_tokenizer``, used to build the
            processor offline when the checkpoint has no processor or tokenizer folder.
    """

    def __init__(
        self,
        device: torch.device | str,
        dtype: torch.dtype = torch.bfloat16,
        hooks: MemoryHooks | None = None,
        comfy_tokenizer_dir: Path | None = None,
    ):
        self.device = torch.device(device)
        self.dtype = dtype
        self.hooks = hooks or NoHost()
        self.comfy_tokenizer_dir = comfy_tokenizer_dir
        self._residents: dict[tuple, Resident] = {}
        self._processors: dict[tuple, Any] = {}
        self._lock = threading.RLock()

    # --- generic cache ---------------------------------------------------------------------

    def _resident(self, key: tuple, label: str, build: Callable[[], torch.nn.Module], nbytes_hint: int = 0
                  ) -> Resident:
        with self._lock:
            resident = self._residents.get(key)
            if resident is not None:
                return resident
            logger.info("loading %s", label)
            self.hooks.reserve(nbytes_hint)
            with building():
                module = build()
            module.eval().requires_grad_(False)
            resident = Resident(key=key, module=module, nbytes=module_bytes(module), label=label)
            resident.handle = self.hooks.register(resident)
            self._residents[key] = resident
            return resident

    def evict(self, key: tuple) -> None:
        """Drop a model (the host unloaded it, or a newer variant replaced it). Safe to call twice."""
        with self._lock:
            resident = self._residents.pop(key, None)
            if resident is None:
                return
            logger.info("unloaded %s (%.1f MiB)", resident.label, resident.nbytes / 2**20)
            resident.module = None
            resident.extra.clear()

    def evict_all(self) -> None:
        with self._lock:
            for key in list(self._residents):
                resident = self._residents.get(key)
                if resident is not None:
                    self.hooks.forget(resident)
                self.evict(key)
            self._processors.clear()

    def residents(self) -> list[Resident]:
        with self._lock:
            return list(self._residents.values())

    def use(self, residents: list[Resident]) -> None:
        """Ask the host to make these models resident on the compute device before a stage runs."""
        self.hooks.use(residents)

    # --- components ------------------------------------------------------------------------

    def text_encoder(self, plan: PipePlan) -> Resident:
        from .checkpoints.loader import load_text_encoder

        files = plan.files
        key = ("text_encoder", files_identity(files.text_encoder))
        return self._resident(key, f"text encoder {Path(files.text_encoder[0]).name}",
                              lambda: load_text_encoder(files, device=self.device, dtype=self.dtype),
                              bf16_bytes_estimate(files.text_encoder))

    def vae(self, plan: PipePlan) -> Resident:
        from .checkpoints.loader import load_vae

        files = plan.files
        key = ("vae", files_identity(files.vae))
        return self._resident(key, f"VAE {Path(files.vae[0]).name}",
                              lambda: load_vae(files, device=self.device, dtype=self.dtype),
                              bf16_bytes_estimate(files.vae))

    def processor(self, plan: PipePlan) -> Any:
        from .checkpoints.loader import load_processor

        files = plan.files
        key = (str(files.processor_dir), str(files.tokenizer_dir), str(self.comfy_tokenizer_dir))
        with self._lock:
            if key not in self._processors:
                self._processors[key] = load_processor(files, comfy_tokenizer_dir=self.comfy_tokenizer_dir)
            return self._processors[key]

    def base_dit(self, plan: PipePlan) -> Resident:
        from .checkpoints.loader import load_dit

        files = plan.files
        key = ("dit", files_identity(files.dit))
        return self._resident(key, f"DiT {Path(files.dit[0]).name}",
                              lambda: load_dit(files, device=self.device, dtype=self.dtype),
                              bf16_bytes_estimate(files.dit))

    def dit(self, plan: PipePlan) -> Resident:
        """The DiT as the plan wants it: LoRAs fused, then FP8, then compiled (regional).

        The bf16 base and each FP8 variant (one per recipe) are updated in place when the LoRA chain
        changes, so their parameters stay the same tensors and compiled graphs never recompile for it.
        """
        from .variants_dit import (
            apply_compile,
            chain_key,
            ensure_loras,
            fp8_variant_key,
            make_fp8_variant,
            sync_fp8_loras,
        )

        with self._lock:
            base = self.base_dit(plan)
            active_loras = tuple(lora for lora in plan.loras if lora.strength != 0)
            if plan.fp8 is None:
                ensure_loras(base, active_loras)
                target = base
            else:
                key = fp8_variant_key(base.key, plan.fp8)
                target = self._residents.get(key)
                if target is not None and not sync_fp8_loras(target, base, active_loras):
                    logger.info("rebuilding %s for the new LoRA chain (its layers cannot be re-quantized in place)",
                                target.label)
                    self.hooks.forget(target)
                    self.evict(key)
                    target = None
                if target is None:
                    ensure_loras(base, active_loras)
                    target = self._resident(key, f"DiT fp8 {plan.fp8.describe()}",
                                            lambda: make_fp8_variant(base.module, plan.fp8), base.nbytes // 2)
                    target.extra["fp8_report"] = getattr(target.module, "fp8_report", None)
                    target.extra["lora_chain"] = chain_key(active_loras)
            apply_compile(target, plan.compile)
            return target

    def lora_report(self, lora: LoraChoice, plan: PipePlan) -> Any:
        """Matched/unmatched keys of a LoRA against this plan's DiT (parsing only; nothing fused)."""
        from .variants_dit import parse_lora_for

        return parse_lora_for(self.base_dit(plan), lora)


_RUNTIME: PlanRuntime | None = None
_RUNTIME_LOCK = threading.Lock()


def get_runtime(factory: Callable[[], PlanRuntime]) -> PlanRuntime:
    """The process-wide runtime, created by ``factory`` on first use."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            _RUNTIME = factory()
        return _RUNTIME
