"""Fusing LoRAs into base weights, exactly and reversibly.

For each target weight ``W`` (bf16, or any float dtype but fp8) touched by the
chain ``[(lora_1, s_1), ..., (lora_n, s_n)]``::

    W' = cast_to_W_dtype( float32(W) + s_1 * scale_1 * delta_1 + ... + s_n * scale_n * delta_n )

summed in float32 on ``W``'s device in the chain order, then rounded once.
The base tensors are never written to: :func:`fused_state` returns NEW tensors
for the touched weights only, so dropping them restores the base bit for bit,
however many times LoRAs are changed. :func:`swap_weights` /
:func:`restore_weights` and :class:`LoraPatcher` do that on an ``nn.Module`` by
swapping ``param.data`` (the Parameter objects stay, so compiled graphs keep
their inputs).

.. note:: fuse before fp8 quantization; fp8 weights are refused.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .errors import LoraError
from .formats import ParsedLora
from .patches import LoraPatch

__all__ = ["LoraPatcher", "fused_state", "restore_weights", "shapes_of", "swap_weights"]

logger = logging.getLogger(__name__)


def shapes_of(weights: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """``name -> shape`` of a module's parameters or of a state dict: the ``target_shapes`` for parsing."""
    items = weights.named_parameters() if isinstance(weights, nn.Module) else weights.items()
    return {name: tuple(t.shape) for name, t in items}


def _check_base(target: str, w: torch.Tensor | None, patch: LoraPatch, source: str) -> torch.Tensor:
    if w is None:
        raise LoraError(
            f"LoRA {source}: target {target} is not among the base weights (was it parsed for another model?)"
        )
    if not w.is_floating_point() or w.element_size() < 2:
        raise LoraError(
            f"LoRA {source}: base weight {target} is {w.dtype}; LoRAs are fused into bf16/fp16/fp32 weights "
            "before fp8 quantization, not into quantized ones"
        )
    if tuple(w.shape) != patch.target_shape():
        raise LoraError(
            f"LoRA {source}: base weight {target} has shape {tuple(w.shape)}, the LoRA expects {patch.target_shape()}"
        )
    return w


@torch.no_grad()
def fused_state(
    base: Mapping[str, torch.Tensor],
    loras: Sequence[tuple[ParsedLora, float]],
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Fuse a chain of LoRAs into copies of the weights they touch.

    ``base``: target name -> weight (any float dtype but fp8, any device; never
    modified). ``loras``: ``(ParsedLora, strength)`` in the order the user
    chained them; strength 0 skips a LoRA. Returns ``{name: new tensor}`` for the
    touched names only, each with the base tensor's dtype and shape, on the
    base tensor's device, or on ``device`` when given (so a base kept on the CPU
    can be fused on the GPU: the float32 sum then runs on ``device``).
    Raises LoraError for a non-finite strength, a target missing from ``base``,
    a shape mismatch, or an fp8/int base weight.
    """
    by_target: dict[str, list[tuple[LoraPatch, float, str]]] = {}
    for lora, strength in loras:
        strength = float(strength)
        if not math.isfinite(strength):
            raise LoraError(f"LoRA {lora.source}: strength must be a finite number, got {strength}")
        if strength == 0.0:
            continue
        for patch in lora.patches:
            by_target.setdefault(patch.target, []).append((patch, strength, lora.source))
    out: dict[str, torch.Tensor] = {}
    for target in sorted(by_target):
        entries = by_target[target]
        w = _check_base(target, base.get(target), entries[0][0], entries[0][2])
        for patch, _, source in entries[1:]:
            _check_base(target, w, patch, source)
        acc = w.detach().to(device=device if device is not None else w.device, dtype=torch.float32, copy=True)
        for patch, strength, _ in entries:
            patch.add_to(acc, strength)
        out[target] = acc.to(w.dtype)
    logger.debug("fused %d LoRA(s) into %d weights", len(loras), len(out))
    return out


def _param(module: nn.Module, name: str) -> nn.Parameter:
    try:
        return module.get_parameter(name)
    except AttributeError:
        raise LoraError(f"module has no parameter {name}") from None


@torch.no_grad()
def swap_weights(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Point each named parameter's ``.data`` at the given tensor; return the tensors it held before.

    Shapes, dtypes and devices must match (LoraError otherwise). The Parameter
    objects are kept, so hooks, compiled graphs and references stay valid.
    """
    for name, t in tensors.items():
        p = _param(module, name)
        if (tuple(p.shape), p.dtype, p.device) != (tuple(t.shape), t.dtype, t.device):
            raise LoraError(
                f"cannot swap {name}: parameter is {tuple(p.shape)} {p.dtype} on {p.device}, "
                f"new tensor is {tuple(t.shape)} {t.dtype} on {t.device}"
            )
    previous = {}
    for name, t in tensors.items():
        p = _param(module, name)
        previous[name] = p.data
        p.data = t
    return previous


def restore_weights(module: nn.Module, previous: Mapping[str, torch.Tensor]) -> None:
    """Undo :func:`swap_weights` with the mapping it returned."""
    swap_weights(module, previous)


class LoraPatcher:
    """Swaps fused LoRA weights into a module and back, always derived from the base.

    Create it once the module sits on its final device and dtype: it keeps
    references (not copies) to every parameter's base tensor. ``apply(loras)``
    restores the base, then swaps in :func:`fused_state` of the new chain;
    ``clear()`` restores the base. Memory while fused: base + the fused copies
    of the touched weights. Raises LoraError when the module's weights were
    replaced behind its back (e.g. ``module.to(...)`` after creation).
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self._base: dict[str, torch.Tensor] = {n: p.data for n, p in module.named_parameters()}
        self._fused: dict[str, torch.Tensor] = {}

    @property
    def fused_names(self) -> tuple[str, ...]:
        """Names of the parameters currently holding fused copies."""
        return tuple(self._fused)

    def _check_owned(self) -> None:
        for name, p in self.module.named_parameters():
            expected = self._fused.get(name, self._base.get(name))
            if expected is None or p.data.data_ptr() != expected.data_ptr() or p.device != expected.device:
                raise LoraError(
                    f"parameter {name} was replaced since this LoraPatcher was created "
                    "(module moved or reloaded?); create a new LoraPatcher"
                )

    def apply(self, loras: Sequence[tuple[ParsedLora, float]]) -> tuple[str, ...]:
        """Fuse ``loras`` (in chain order) into the module; return the names changed."""
        self.clear()
        fused = fused_state(self._base, loras)
        swap_weights(self.module, fused)
        self._fused = fused
        return self.fused_names

    def clear(self) -> None:
        """Put every base tensor back (bit-exact: the very same tensors)."""
        self._check_owned()
        if self._fused:
            restore_weights(self.module, {n: self._base[n] for n in self._fused})
            self._fused = {}
