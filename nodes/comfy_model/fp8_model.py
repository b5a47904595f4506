"""FP8 for a ComfyUI Qwen-Image MODEL: an object patch of ``diffusion_model`` with the pack's fp8 layers.

:func:`fp8_model` returns a clone of the MODEL whose ``diffusion_model`` object patch is an fp8 copy of ComfyUI's
DiT: the same classes and forward (ComfyUI's own, so 2511's zero-timestep conditioning, block patches and
ControlNet inputs keep working), with the selected ``nn.Linear`` layers replaced by ``fp8.linear`` layers
(``fp8.swap.quantize_linears``: row-wise scaled-mm through the pack's cuBLASLt call, the shipped recipe). Every
other tensor of the copy is its own clone. The copy is made once per base DiT and config, and shared by every
clone made from it (so a LoRA strength change reuses it: nothing is quantized again but the patched layers, and
compiled graphs stay valid because the same tensors get new values).

Memory: while ComfyUI loads the clone, the copy *is* the model's ``diffusion_model``, so ComfyUI's memory manager
moves it to the GPU and back (``model.to``) and the bf16 base stays where ComfyUI keeps unloaded models. The
clone is a plain ``ModelPatcher`` also where the MODEL came under 0.33's dynamic VRAM
(``comfy_compat.plain_clone``: the copy loads once and stays between prompts, as on 0.3.75). The fp8 layers hold
buffers, which ComfyUI never patches itself.

Weights identity: ComfyUI moves a model to its offload device and back whenever the clone it loads carries another
``patches_uuid`` than the one loaded. The clone's ``patches_uuid`` is therefore derived from the copy and from the
weight patches ComfyUI applies itself (those on layers kept high precision), not from the fp8 layers' patches,
which this module applies: two clones of one copy that differ only there (a LoRA strength change) keep the copy on
the GPU, where a fresh uuid would send its ~19 GiB to the CPU and back (moving it off took 15-24 s in a ``/free`` on
an H200). It differs from the parent's, so ComfyUI still takes the parent's weights off first.

LoRA: weight patches that ComfyUI holds on the MODEL for an fp8 layer (``LoraLoaderModelOnly``, before or after
this node) are applied by :func:`sync_patches` when ComfyUI loads the model (an ``ON_LOAD`` callback) and again
before each sampling (``ON_PRE_RUN``: a model ComfyUI finds loaded is not loaded again): base bf16
weight (to the GPU as stored) -> ``comfy.lora.calculate_weight`` in float32 there -> cast to the base dtype ->
quantized as the layer was, about 1 GiB of values at a time. A layer whose
patches are gone gets its quantized base back (bit for bit). Patches on layers kept high precision stay ComfyUI's.
"""

from __future__ import annotations

import logging
import time
import uuid
import weakref
from dataclasses import dataclass, field

import torch

from ..comfy_compat import plain_clone
from .check import ComfyModelError, check_patches, check_weights, qwen_diffusion_model

logger = logging.getLogger(__name__)

CALLBACK_KEY = "qwen_edit_hopper.fp8"
DIT_PREFIX = "diffusion_model."


@dataclass
class Fp8Dit:
    """One fp8 copy of a base DiT: ``module`` (the copy), ``base_ref`` (a weak reference to ComfyUI's DiT: the copy
    never keeps a base alive that ComfyUI let go), the config and report, and ``identity`` (this copy's own uuid,
    the root of its clones' ``patches_uuid``)."""

    module: torch.nn.Module
    base_ref: weakref.ReferenceType
    config: object
    report: object
    identity: uuid.UUID = field(default_factory=uuid.uuid4)

    @property
    def base(self) -> torch.nn.Module:
        """ComfyUI's DiT (ComfyModelError once ComfyUI has let it go)."""
        base = self.base_ref()
        if base is None:
            raise ComfyModelError("model: the DiT this FP8 copy was made from is no longer loaded; queue the "
                                  "prompt again so Apply TE-FP8 runs on the loaded model")
        return base

    def fp8_keys(self) -> set[str]:
        """Full model keys (``diffusion_model.<layer>.weight`` / ``.bias``) of the fp8 layers."""
        return {f"{DIT_PREFIX}{d.name}.{p}" for d in self.report.converted for p in ("weight", "bias")}


_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""base DiT -> Fp8Dit (the latest config only: a new config replaces the copy, so one fp8 copy per base lives).
The copy refers to its base weakly, so an entry goes when ComfyUI lets the base go."""


def fp8_dit(base: torch.nn.Module, config) -> Fp8Dit:
    """The fp8 copy of ``base`` for ``config`` (made on first use; ``qwen_edit.fp8_dit.build_fp8_dit`` without the
    fused Q/K/V layers, which ComfyUI's forward does not call)."""
    from ...qwen_edit.fp8_dit import build_fp8_dit

    held = _COPIES.get(base)
    if held is not None and held.config == config:
        return held
    module = build_fp8_dit(base, config, fused_qkv=())
    if not module.fp8_report.converted:
        raise ComfyModelError("model: no linear layer of the DiT could be converted to FP8 (" +
                              "; ".join(sorted({d.reason for d in module.fp8_report.skipped})) + ")")
    held = Fp8Dit(module=module, base_ref=weakref.ref(base), config=config, report=module.fp8_report)
    _COPIES[base] = held
    return held


def fp8_model(model, config):
    """A clone of ComfyUI MODEL ``model`` that runs ``config``'s fp8 layers; returns (clone, Fp8Dit).

    Raises ComfyModelError for a MODEL the fast path cannot honour (see :mod:`.check`), the fp8 package's errors
    for a backend that cannot run here.
    """
    import comfy.model_management
    from comfy.patcher_extension import CallbacksMP

    base = qwen_diffusion_model(model)
    check_weights(base)
    if config.backend == "te":
        raise ComfyModelError("backend: te (Transformer Engine) layers cannot take LoRA values in place; use "
                              "scaled_mm_rowwise with a ComfyUI MODEL")
    compute = getattr(model.model, "manual_cast_dtype", None) or model.model_dtype()
    if config.backend == "scaled_mm_rowwise" and not config.emulate and compute != torch.bfloat16:
        raise ComfyModelError(f"model: computes in {compute}; row-wise FP8 GEMMs take bf16 activations: load the "
                              "bf16 checkpoint with UNETLoader weight_dtype 'default' on a bf16 GPU")
    held = fp8_dit(base, config)
    check_patches(model, held.fp8_keys())
    clone = plain_clone(model)
    clone.patches_uuid = weights_uuid(held, clone)
    clone.add_object_patch("diffusion_model", held.module)
    clone.add_callback_with_key(CallbacksMP.ON_LOAD, CALLBACK_KEY, _on_load(held))
    clone.add_callback_with_key(CallbacksMP.ON_PRE_RUN, CALLBACK_KEY, _on_pre_run(held))
    base_bytes = comfy.model_management.module_size(base)
    clone.size = max(model.model_size() - base_bytes, 0) + comfy.model_management.module_size(held.module)
    return clone, held


def weights_uuid(held: Fp8Dit, patcher) -> uuid.UUID:
    """``patches_uuid`` for a clone of ``held``'s copy: one per copy and per set of weight patches ComfyUI applies
    itself (keys outside the fp8 layers, compared by strength and by the patch objects), so clones that differ
    only in their fp8 layers' patches share it, and no other model's uuid equals it."""
    fp8_keys = held.fp8_keys()
    seen = []
    for key in sorted(k for k in patcher.patches if k not in fp8_keys):
        seen.append((key, _identity(patcher.patches[key])))
    return uuid.uuid5(held.identity, repr(seen))


_TOKENS: dict[int, uuid.UUID] = {}
"""id of a live patch object (a LoRA adapter, a tensor) -> a uuid of its own; the entry goes with the object, so a
later object at the same address gets another (keyed by id: tensors compare elementwise, not as dict keys)."""


def _identity(part) -> str:
    if isinstance(part, (bool, int, float, str, type(None))):
        return repr(part)
    if isinstance(part, (tuple, list)):
        return "(" + ", ".join(_identity(item) for item in part) + ")"
    token = _TOKENS.get(id(part))
    if token is None:
        token = uuid.uuid4()
        try:
            weakref.finalize(part, _TOKENS.pop, id(part), None)
        except TypeError:  # an object that takes no weak reference: a token of this call only
            return f"{type(part).__name__}:{token}"
        _TOKENS[id(part)] = token
    return f"{type(part).__name__}:{token}"


def _on_load(held: Fp8Dit):
    def on_load(patcher, device_to, *args):
        _sync_if_ours(held, patcher, device_to)
    return on_load


def _on_pre_run(held: Fp8Dit):
    def on_pre_run(patcher):
        _sync_if_ours(held, patcher, patcher.load_device)
    return on_pre_run


def _sync_if_ours(held: Fp8Dit, patcher, device_to) -> None:
    if patcher.model.diffusion_model is not held.module:
        return  # another clone's diffusion model: not ours to sync
    check_patches(patcher, held.fp8_keys())
    _require_device(held, device_to)
    sync_patches(held, patcher)


def _require_device(held: Fp8Dit, device_to) -> None:
    if device_to is None:
        return
    device = torch.device(device_to)
    for decision in held.report.converted[:1] + held.report.converted[-1:]:
        layer = held.module.get_submodule(decision.name)
        if layer.weight.device.type != device.type:
            raise ComfyModelError(
                f"model: ComfyUI loaded the FP8 model only partly ({decision.name} stayed on {layer.weight.device}, "
                f"compute on {device}); the FP8 layers load whole: free VRAM (unload other models, or start "
                "ComfyUI with --highvram) and run again")


SYNC_CHUNK_BYTES = 1 << 30
"""High-precision values :func:`sync_patches` gathers on the GPU before it quantizes them into the fp8 layers: its
extra GPU memory stays near this (a Lightning LoRA patches every fp8 layer; gathered whole, their bf16 values took
44 GiB beside the copy on an H200)."""


@torch.no_grad()
def sync_patches(held: Fp8Dit, patcher) -> int:
    """Bring every fp8 layer's values to ``patcher``'s weight patches; returns the number of tensors written.

    A layer is written when its patches differ from the ones it holds, or when ComfyUI gave it new tensors (a
    move or dynamic-VRAM staging) while it held, or now needs, patched values. Base values come from the base
    DiT (or ComfyUI's backup of them while another clone has them patched in place), cross to the GPU in their own
    dtype (bf16: half the bytes of the float32 that ``calculate_weight`` works in, which is made there) and are
    quantized in chunks of about :data:`SYNC_CHUNK_BYTES`.
    """
    started = time.perf_counter()
    chunk: dict[str, torch.Tensor] = {}
    marks: list = []
    written = patched = moved = chunk_bytes = 0
    for key in sorted(held.fp8_keys()):
        name = key[len(DIT_PREFIX):]
        owner_name, _, attr = name.rpartition(".")
        owner = held.module.get_submodule(owner_name)
        target = getattr(owner, attr, None)
        if target is None:
            continue
        wanted = tuple(patcher.patches.get(key, ()))
        state = owner.__dict__.setdefault("_comfy_patch_state", {})
        held_ref, held_patches = state.get(attr, (None, ()))
        same_tensor = held_ref is not None and held_ref() is target
        if _same_patches(wanted, held_patches) and (same_tensor or not wanted):
            if not same_tensor and not held_patches:
                state[attr] = (weakref.ref(target), ())
            continue
        base = _base_value(held.base, key, name)
        chunk[name] = _patched_value(base, wanted, key, target.device)
        marks.append((state, attr, owner, wanted))
        moved += base.numel() * base.element_size()
        chunk_bytes += chunk[name].numel() * chunk[name].element_size()
        if chunk_bytes >= SYNC_CHUNK_BYTES:
            written, patched = written + len(chunk), patched + _write_chunk(held, chunk, marks)
            chunk_bytes = 0
    if chunk:
        written, patched = written + len(chunk), patched + _write_chunk(held, chunk, marks)
    if written:
        logger.info("FP8 MODEL: %d fp8 tensors written from the bf16 base (%d with weight patches) in %.2f s, "
                    "%.2f GiB of base values read", written, patched, time.perf_counter() - started, moved / 2**30)
    return written


def _patched_value(base: torch.Tensor, wanted: tuple, key: str, device: torch.device) -> torch.Tensor:
    """``base`` with ComfyUI weight patches ``wanted`` on ``device``, in ``base``'s dtype (a new tensor)."""
    import comfy.lora

    value = base.to(device=device, copy=True)
    if not wanted:
        return value
    return comfy.lora.calculate_weight(list(wanted), value.to(torch.float32), key).to(base.dtype)


def _write_chunk(held: Fp8Dit, chunk: dict[str, torch.Tensor], marks: list) -> int:
    """Quantize ``chunk``'s values into the copy, note the patches each layer now holds; empties both; returns how
    many of them carried patches."""
    from ...qwen_edit.fp8_dit import write_weights

    write_weights(held.module, chunk)
    for state, attr, owner, wanted in marks:
        state[attr] = (weakref.ref(getattr(owner, attr)), wanted)
    patched = sum(1 for *_, wanted in marks if wanted)
    chunk.clear()
    marks.clear()
    return patched


def _same_patches(a: tuple, b: tuple) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if len(x) != len(y) or x[1] is not y[1]:
            return False
        if any(not _equal(p, q) for p, q in zip(x[:1] + tuple(x[2:]), y[:1] + tuple(y[2:]), strict=True)):
            return False
    return True


def _equal(p, q) -> bool:
    if isinstance(p, (int, float, str, type(None))) and isinstance(q, (int, float, str, type(None))):
        return p == q
    return p is q


def _base_value(base: torch.nn.Module, key: str, name: str) -> torch.Tensor:
    owner_name, _, attr = name.rpartition(".")
    value = getattr(base.get_submodule(owner_name), attr)
    if value is None:
        raise ComfyModelError(f"model: {key} has weight patches but the base layer has no {attr}")
    return value.detach()
