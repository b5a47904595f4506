"""Materializes plans: base weights read once, variants derived in a fixed order, memory reported.

Order, whatever order the nodes were wired in: LoRAs fused into the bf16
weights first, then FP8 quantization, then compilation (``dit_build`` does the
first two per block, straight from the file). Every model the runtime holds is a
``Resident`` announced to the host's ``MemoryHooks``, so ComfyUI can unload it;
unloading evicts it here.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .memory import MemoryHooks, NoHost, Resident, module_bytes
from .plan import LoraChoice, PipePlan
from .sampling import ConditioningCache

logger = logging.getLogger(__name__)


def files_identity(paths: tuple[Path, ...] | list[Path]) -> tuple:
    """Identity of a set of files: path, size and modification time of each (a changed file reloads)."""
    out = []
    for path in paths:
        stat = Path(path).stat()
        out.append((str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns))
    return tuple(out)


def stored_bytes(paths) -> int:
    """Bytes a set of checkpoint files holds (a model kept as stored takes about this much)."""
    return sum(Path(path).stat().st_size for path in paths)


@contextlib.contextmanager
def building() -> Iterator[None]:
    """Build models outside inference mode so their tensors are ordinary (calibration may need autograd)."""
    with torch.inference_mode(False), torch.no_grad():
        yield


class PlanRuntime:
    """Process-wide cache of materialized models, keyed by what they were built from.

    Args:
        device: compute device for every model (``cuda``/``cpu``).
        dtype: compute dtype of non-FP8 weights (bf16 on GPUs; float32 on the CPU, where bf16 convolutions and
            matmuls are many times slower).
        hooks: the host's memory hooks (``NoHost`` without ComfyUI).
        comfy_tokenizer_dir: ComfyUI's ``comfy/text_encoders/qwen25_tokenizer``, used to build the
            processor offline when the checkpoint has no processor or tokenizer folder.

    Where the weights live (CUDA): the DiT and the VAE on the GPU, built straight from their files (an fp8 DiT
    never exists in bf16 as a whole: ``dit_build``); the text encoder's layers in pinned host memory, streamed to
    the GPU one at a time while a prompt is encoded (``streaming``), fp8 as stored when its file is fp8.
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
        self._sources: dict[tuple, Any] = {}
        self._loras: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.RLock()
        self.loads: list[tuple[str, float]] = []
        """``(kind, seconds)`` of each model built, in order (kind: ``"text encoder"``, ``"VAE"``, ``"DiT"``), since
        the current edit began (``edit.run_edit`` clears it: at most one entry per model kind and LoRA set)."""
        self.conditioning = ConditioningCache()
        """Encoded prompts and reference latents (on the device), dropped with the encoders that made them."""

    @property
    def streams_text_encoder(self) -> bool:
        """Whether the text encoder's layers live in host memory between uses (on CUDA devices)."""
        return self.device.type == "cuda"

    # --- generic cache ---------------------------------------------------------------------

    def _resident(self, key: tuple, label: str, build: Callable[[], torch.nn.Module], nbytes_hint: int = 0
                  ) -> Resident:
        with self._lock:
            resident = self._residents.get(key)
            if resident is not None:
                return resident
            self.hooks.reserve(nbytes_hint)
            module, seconds = self._built(label, build)
            return self._hold(key, label, module, seconds)

    def _built(self, label: str, build: Callable[[], torch.nn.Module]) -> tuple[torch.nn.Module, float]:
        """Run ``build`` (on any thread; it must not call the host): the module in eval mode without gradients,
        the build's transients back to the card, and the seconds it took. A failed build leaves nothing held."""
        logger.info("loading %s", label)
        started = time.perf_counter()
        with building(), released_on_failure(self.device):
            module = build()
        module.eval().requires_grad_(False)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the build's transients (a block in bf16): back to the card
        return module, time.perf_counter() - started

    def _hold(self, key: tuple, label: str, module: torch.nn.Module, seconds: float) -> Resident:
        """Keep a built module under ``key`` and register it with the host (the caller's thread)."""
        with self._lock:
            self.loads.append((LOAD_KINDS.get(key[0], str(key[0])), seconds))
            resident = Resident(key=key, module=module, nbytes=module_bytes(module, self.device), label=label)
            resident.handle = self.hooks.register(resident)
            self._residents[key] = resident
            return resident

    def adopt(self, key: tuple, module: torch.nn.Module, label: str) -> Resident:
        """Hold a model built elsewhere under ``key`` (see :func:`dit_key` and its twins), as if built here.

        The benchmark harness hands in random-weight models this way; a model already held under ``key`` is
        returned unchanged.
        """
        resident = self._resident(key, label, lambda: module)
        resident.extra.setdefault("lora_chain", ())
        return resident

    def evict(self, key: tuple) -> None:
        """Drop a model (the host unloaded it, or a newer variant replaced it). Safe to call twice."""
        with self._lock:
            resident = self._residents.pop(key, None)
            if resident is None:
                return
            logger.info("unloaded %s (%.1f MiB)", resident.label, resident.nbytes / 2**20)
            if key[0] in ("text_encoder", "vae"):
                self.conditioning.clear()
            streaming = getattr(resident.module, "layer_streaming", None)
            if streaming is not None:
                streaming.remove()
            resident.module = None
            resident.prepared = None
            resident.extra.clear()

    def evict_all(self) -> None:
        with self._lock:
            for key in list(self._residents):
                resident = self._residents.get(key)
                if resident is not None:
                    self.hooks.forget(resident)
                self.evict(key)
            self._processors.clear()
            self._loras.clear()
            self.conditioning.clear()

    def residents(self) -> list[Resident]:
        with self._lock:
            return list(self._residents.values())

    def use(self, residents: list[Resident]) -> None:
        """Ask the host to make these models resident on the compute device before a stage runs."""
        self.hooks.use(residents)

    # --- components ------------------------------------------------------------------------

    def text_encoder(self, plan: PipePlan) -> Resident:
        from .checkpoints.loader import load_text_encoder
        from .streaming import stream_layers

        files = plan.files
        key = text_encoder_key(plan)

        def build() -> torch.nn.Module:
            if not self.streams_text_encoder:
                return load_text_encoder(files, device=self.device, dtype=self.dtype)
            model = load_text_encoder(files, device="cpu", dtype=self.dtype)
            stream_layers(model, text_encoder_units(model), self.device)
            return model

        return self._resident(key, f"text encoder {Path(files.text_encoder[0]).name}", build,
                              0 if self.streams_text_encoder else stored_bytes(files.text_encoder))

    def vae(self, plan: PipePlan) -> Resident:
        from .checkpoints.loader import load_vae

        files = plan.files
        key = vae_key(plan)
        return self._resident(key, f"VAE {Path(files.vae[0]).name}",
                              lambda: load_vae(files, device=self.device, dtype=self.dtype),
                              stored_bytes(files.vae))

    def processor(self, plan: PipePlan) -> Any:
        from .checkpoints.loader import load_processor

        files = plan.files
        key = (str(files.processor_dir), str(files.tokenizer_dir), str(self.comfy_tokenizer_dir))
        with self._lock:
            if key not in self._processors:
                self._processors[key] = load_processor(files, comfy_tokenizer_dir=self.comfy_tokenizer_dir)
            return self._processors[key]

    def dit_source(self, plan: PipePlan) -> Any:
        """The plan's DiT checkpoint (``dit_build.DitSource``: headers and sizes, no tensor read), cached."""
        from .dit_build import DitSource

        identity = files_identity(plan.files.dit)
        with self._lock:
            if identity not in self._sources:
                self._sources[identity] = DitSource(plan.files)
            return self._sources[identity]

    def parsed_lora(self, lora: LoraChoice, plan: PipePlan) -> Any:
        """The LoRA parsed against the plan's DiT names and shapes (from headers); the last few are cached."""
        from .lora import load_lora

        key = (files_identity([lora.path]), files_identity(plan.files.dit))
        with self._lock:
            if key not in self._loras:
                self._loras[key] = load_lora(lora.path, self.dit_source(plan).shapes)
                while len(self._loras) > LORA_CACHE:
                    self._loras.popitem(last=False)
            self._loras.move_to_end(key)
            return self._loras[key]

    def start_dit(self, plan: PipePlan) -> PendingDit | None:
        """Begin building the plan's DiT on a worker thread (:class:`~.background_build.BackgroundBuild`), when no
        model for it is held; None when one is (:meth:`dit` applies a LoRA change to it in place).

        The host is asked for the model's room here, on the caller's thread; :meth:`dit` with the returned
        :class:`PendingDit` waits for the build and registers the model. A caller that gives up before then calls
        ``pending.cancel()``.
        """
        from .background_build import BackgroundBuild
        from .dit_build import estimate_bytes

        with self._lock:
            key = dit_key(plan)
            if key in self._residents:
                return None
            active = plan.active_loras
            source = self.dit_source(plan)
            chain = self.parsed_chain(active, plan)
            label = self._dit_label(plan, source)
            self.hooks.reserve(estimate_bytes(source, plan.fp8, self.dtype))

            def build(check_cancelled: Callable[[], None]) -> tuple[torch.nn.Module, float]:
                return self._built(label, lambda: self._build_dit(plan, source, chain, check_cancelled))

            thread = BackgroundBuild(label, build, self.device).start()
            return PendingDit(key=key, label=label, lora_chain=chain_identity(active), chain=chain, build=thread)

    def parsed_chain(self, loras: tuple[LoraChoice, ...], plan: PipePlan) -> list:
        """``(ParsedLora, strength)`` for each of ``loras`` against the plan's DiT (:meth:`parsed_lora`)."""
        return [(self.parsed_lora(lora, plan), lora.strength) for lora in loras]

    def dit(self, plan: PipePlan, pending: PendingDit | None = None,
            check_interrupt: Callable[[], None] = lambda: None) -> Resident:
        """The DiT as the plan wants it: LoRAs fused, then FP8, then compiled (regional).

        Built from the files group by group (``dit_build``); one model per file and fp8 recipe (or bf16). A
        LoRA or strength change re-reads the weights the old and new chain touch and writes them in place, so
        the parameters stay the same tensors and compiled graphs (and CUDA graphs) stay valid; Transformer Engine
        layers cannot be written in place, so that model is rebuilt (the log says so). ``resident.prepared`` is
        the model's :class:`~.fast.prepared.PreparedDit`, made for each built model (a rebuilt model gets a new
        one). With ``pending`` (from :meth:`start_dit`), the model its thread builds is waited for (calling
        ``check_interrupt`` meanwhile) instead of built here.
        """
        from .compile import set_regional_compile
        from .dit_build import estimate_bytes, lora_targets, refresh_weights

        if pending is not None:
            module, seconds = pending.build.result(check_interrupt)
            with self._lock:
                target = self._residents.get(pending.key)
                if target is None:
                    target = self._hold(pending.key, pending.label, module, seconds)
                    _note_lora_chain(target, pending.lora_chain, pending.chain)
                del module
        with self._lock:
            active = plan.active_loras
            wanted = chain_identity(active)
            key = dit_key(plan)
            target = self._residents.get(key)
            if target is None or target.extra.get("lora_chain") != wanted:
                source = self.dit_source(plan)
                chain = self.parsed_chain(active, plan)
            if target is not None and target.extra.get("lora_chain") != wanted:
                names = target.extra.get("lora_targets", set()) | lora_targets(chain)
                if refresh_weights(target.module, source, names, chain, device=self.device, dtype=self.dtype):
                    target.extra.update(lora_chain=wanted, lora_targets=lora_targets(chain))
                else:
                    logger.info("rebuilding %s for the new LoRA chain (its layers cannot be updated in place)",
                                target.label)
                    self.hooks.forget(target)
                    self.evict(key)
                    target = None
            if target is None:
                label = self._dit_label(plan, source)
                target = self._resident(key, label, lambda: self._build_dit(plan, source, chain),
                                        estimate_bytes(source, plan.fp8, self.dtype))
                _note_lora_chain(target, wanted, chain)
            if target.prepared is None:  # built here, or adopted
                from .fast.prepared import PreparedDit

                target.prepared = PreparedDit(target.module, getattr(target.module, "layer_streaming", None))
            set_regional_compile(target, plan.compile)
            return target

    def _dit_label(self, plan: PipePlan, source: Any) -> str:
        return f"DiT {source.path.name}" + (f" fp8 {plan.fp8.describe()}" if plan.fp8 is not None else "")

    def _build_dit(self, plan: PipePlan, source: Any, chain: list, check_interrupt: Callable[[], None] = lambda: None
                   ) -> torch.nn.Module:
        from .dit_build import build_dit

        host_blocks = plan.host_blocks if self.device.type == "cuda" else 0
        return build_dit(source, device=self.device, dtype=self.dtype, loras=chain, fp8_config=plan.fp8,
                         host_blocks=host_blocks, check_interrupt=check_interrupt).module

    def lora_report(self, lora: LoraChoice, plan: PipePlan) -> Any:
        """Matched/unmatched keys of a LoRA against this plan's DiT (headers and the LoRA file only)."""
        return self.parsed_lora(lora, plan)


def dit_key(plan: PipePlan) -> tuple:
    """The runtime's key for the plan's DiT: its files, fp8 recipe (None: bf16) and blocks kept in host memory.
    LoRAs change it in place."""
    return ("dit", files_identity(plan.files.dit), plan.fp8, plan.host_blocks)


def text_encoder_key(plan: PipePlan) -> tuple:
    return ("text_encoder", files_identity(plan.files.text_encoder))


def vae_key(plan: PipePlan) -> tuple:
    return ("vae", files_identity(plan.files.vae))


@dataclass
class PendingDit:
    """A DiT being built on a worker thread (:meth:`PlanRuntime.start_dit`): its runtime key, label, LoRA chain
    (identity, and the parsed chain) and the :class:`~.background_build.BackgroundBuild` running it."""

    key: tuple
    label: str
    lora_chain: tuple
    chain: list
    build: Any

    def cancel(self) -> None:
        """Stop the build and drop what it built (the caller failed or was interrupted before using it)."""
        self.build.cancel()


LOAD_KINDS = {"text_encoder": "text encoder", "vae": "VAE", "dit": "DiT"}
"""What :attr:`PlanRuntime.loads` calls each kind of model."""

LORA_CACHE = 4
"""Parsed LoRAs kept (their factors live in host memory: about 1.2 GB for a rank-64 Lightning LoRA)."""


def _note_lora_chain(target: Resident, identity: tuple, chain: list) -> None:
    """Note on a just-built DiT the LoRA chain it holds (``identity``: :func:`chain_identity`; the weights it
    touched) and its fp8 report."""
    from .dit_build import lora_targets

    target.extra.update(lora_chain=identity, lora_targets=lora_targets(chain),
                        fp8_report=getattr(target.module, "fp8_report", None))


def chain_identity(loras: tuple[LoraChoice, ...]) -> tuple:
    """What a LoRA chain is, for deciding whether a model holds it: each file's identity and strength."""
    return tuple((files_identity([lora.path]), float(lora.strength)) for lora in loras)


def text_encoder_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The text encoder's streamed units: the token embedding, the decoder layers and the vision blocks (the rest,
    norms, patch embedding, merger and rotary tables, stays on the device: a few MB)."""
    inner = model.model
    return [inner.language_model.embed_tokens, *inner.language_model.layers, *inner.visual.blocks]


@contextlib.contextmanager
def released_on_failure(device: torch.device) -> Iterator[None]:
    """On any exception, drop what the failed build held: its frames' locals, then the allocator's free blocks."""
    try:
        yield
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        raise


_RUNTIME: PlanRuntime | None = None
_RUNTIME_LOCK = threading.Lock()


def get_runtime(factory: Callable[[], PlanRuntime]) -> PlanRuntime:
    """The process-wide runtime, created by ``factory`` on first use."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            _RUNTIME = factory()
        return _RUNTIME
