"""FP8 DiTs in memory: a converted copy of a bf16 DiT, and new weight values written into an fp8 DiT in place.

``build_fp8_dit`` converts a copy of a DiT already in memory (the benchmark harness builds random-weight
models that way; the runtime builds from files with ``dit_build``). The copy shares no tensor with the base:
converted linears hold fp8 weights with their scales, every other parameter is cloned.
``write_weights`` puts new values (a LoRA change) into an fp8 or bf16 DiT without replacing any tensor.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)


def _structure_sharing_tensors(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``module`` whose Parameter/buffer objects are the originals (no tensor copied)."""
    memo: dict[int, Any] = {id(t): t for t in list(module.parameters()) + list(module.buffers())}
    return copy.deepcopy(module, memo)


@torch.no_grad()
def build_fp8_dit(base_module: torch.nn.Module, fp8_config: Any,
                  fused_qkv: tuple[str, ...] | None = None) -> torch.nn.Module:
    """Convert a structural copy of ``base_module`` with ``fp8.quantize_linears``; returns the new module.

    Then the Q/K/V projections of the ``fused_qkv`` streams (default: ``fast.qkv.FP8_FUSED_STREAMS``, the
    text stream) become one row-wise fp8 layer per block where all three are row-wise ``ScaledMMLinear``
    (``fast.qkv.fuse_fp8_qkv``; numerically the three layers). The module carries the conversion report as
    ``fp8_report`` and the number of fused layers as ``fused_qkv_layers``. Raises the fp8 package's errors
    (backend unavailable, shapes it cannot take) unchanged.
    """
    from ..fp8 import quantize_linears
    from .fast.qkv import FP8_FUSED_STREAMS, fuse_fp8_qkv

    variant = _structure_sharing_tensors(base_module)
    report = quantize_linears(variant, fp8_config)
    base_storages = {t.untyped_storage().data_ptr() for t in list(base_module.parameters()) +
                     list(base_module.buffers())}

    def shared(tensor: torch.Tensor | None) -> bool:
        return tensor is not None and tensor.untyped_storage().data_ptr() in base_storages

    for owner in variant.modules():
        for name, param in list(owner._parameters.items()):
            if shared(param):
                owner._parameters[name] = torch.nn.Parameter(param.detach().clone(), requires_grad=False)
        for name, buffer in list(owner._buffers.items()):
            if shared(buffer):
                owner._buffers[name] = buffer.clone()
    variant.fused_qkv_layers = fuse_fp8_qkv(variant, FP8_FUSED_STREAMS if fused_qkv is None else fused_qkv)
    variant.fp8_report = report
    logger.info("FP8 variant: %s; %d fused Q/K/V layers", report.counts, variant.fused_qkv_layers)
    return variant


def _targets(variant: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str, Any]:
    """Where the variant keeps tensor ``name``: (owner module, attribute, the owner's rows it fills)."""
    from .fast.qkv import fused_rows

    owner_name, _, attr = name.rpartition(".")
    fused = fused_rows(variant, owner_name) if owner_name and not _has_submodule(variant, owner_name) else None
    if fused is not None:  # a Q/K/V projection fused into one layer: its rows of that layer
        return fused[0], attr, fused[1]
    return (variant.get_submodule(owner_name) if owner_name else variant), attr, ...


def can_write_in_place(variant: torch.nn.Module, names: set[str]) -> bool:
    """Whether :func:`write_weights` can update these tensors in place (not inside Transformer Engine layers)."""
    return all(type(_targets(variant, name)[0]).__name__ != "TeLinear" for name in names)


@torch.no_grad()
def write_weights(variant: torch.nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Copy high-precision ``values`` (model tensor name -> tensor) into the variant's own tensors, in place.

    Where the variant is fp8 the value is quantized as the layer's conversion did (row-wise, or tensor-wise for
    a tensor-wise ``ScaledMMLinear``); a Q/K/V projection fused into one layer fills its rows. Same tensors,
    new values: compiled graphs and captured CUDA graphs read the new values. Raises TypeError for a Transformer
    Engine layer (check :func:`can_write_in_place` first).
    """
    from ..fp8 import quantize_rowwise, quantize_tensorwise
    from ..fp8.linear import Fp8Linear, ScaledMMLinear

    owners: dict[int, torch.nn.Module] = {}
    for name in sorted(values):
        owner, attr, rows = _targets(variant, name)
        if type(owner).__name__ == "TeLinear":
            raise TypeError(f"{name}: Transformer Engine layers cannot be updated in place; rebuild the model")
        source = values[name]
        if isinstance(owner, Fp8Linear) and attr == "weight":
            tensorwise = isinstance(owner, ScaledMMLinear) and owner.granularity == "tensorwise"
            weight, scale = quantize_tensorwise(source) if tensorwise else quantize_rowwise(source)
            owner.weight[rows].copy_(weight)
            owner.weight_scale[rows].copy_(scale.reshape(owner.weight_scale[rows].shape))
        else:
            getattr(owner, attr)[rows].copy_(source)
        owners[id(owner)] = owner
    for owner in owners.values():
        if isinstance(owner, ScaledMMLinear):  # its output bound follows the new weight (fused GELU GEMM)
            owner.refresh_column_bound()


def _has_submodule(module: torch.nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True

