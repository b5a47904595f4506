"""One swap function with a filter: :func:`quantize_linears` converts ``nn.Linear`` layers in place.

Per linear (qualified name from ``module.named_modules()``) the decision is:

* ``layer_filter`` given: ``layer_filter(linear, name) -> True`` selects it for
  fp8 compute (even where the preset would keep it); False leaves it to the
  preset's storage rule (fp8 storage) or keeps it, "not selected by layer_filter".
* otherwise the preset (:mod:`.presets`) decides compute / storage / keep.
* compute layers whose K or N is not divisible by 16 (scaled-mm and TE) are
  kept with that reason, or raise :class:`~.errors.Fp8ShapeError` naming the
  layer when ``config.force``. Weights that are not bf16 / fp16 / fp32 are
  kept with the reason (or raise under ``force``).
* ``backend == "weight_only"``: every selected layer becomes fp8 storage.

The backend's capability is checked first (:func:`.capability.require_backend`);
a backend that cannot run raises :class:`~.errors.Fp8UnavailableError` with the
reason. Layers are converted one at a time (peak memory: one extra layer), and
a linear registered under several names is converted once and replaced everywhere.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .backend_checks import require_backend
from .config import Fp8Config
from .errors import Fp8Error, Fp8ShapeError
from .linear import Fp8Linear, ScaledMMLinear, WeightOnlyLinear, scaled_mm_shape_capability
from .presets import ROLE_COMPUTE, ROLE_KEEP, ROLE_STORAGE
from .te_backend import TeLinear, build_recipe

__all__ = [
    "COMPUTE",
    "KEPT",
    "STORAGE",
    "ConversionReport",
    "LayerDecision",
    "LayerFilter",
    "dequantize_module",
    "merge_reports",
    "module_bytes",
    "plan_linears",
    "quantize_linears",
]

logger = logging.getLogger(__name__)

COMPUTE = "fp8 compute"
STORAGE = "fp8 storage"
KEPT = "kept"
HIGH_PRECISION = (torch.bfloat16, torch.float16, torch.float32)

LayerFilter = Callable[[nn.Module, str], bool]


@dataclass(frozen=True)
class LayerDecision:
    """What happens (or happened) to one linear: ``action`` is fp8 compute / fp8 storage / kept."""

    name: str
    action: str
    backend: str | None
    reason: str
    in_features: int
    out_features: int


def _group_name(name: str) -> str:
    return re.sub(r"(^|\.)\d+(?=\.)", r"\1N", name, count=1)


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


@dataclass(frozen=True)
class ConversionReport:
    """Result of :func:`quantize_linears`: every linear's decision, notes, and bytes before/after."""

    config: Fp8Config
    decisions: tuple[LayerDecision, ...]
    notes: tuple[str, ...]
    bytes_before: int
    bytes_after: int
    seconds: float = 0.0

    @property
    def converted(self) -> tuple[LayerDecision, ...]:
        """Layers now in fp8 (compute or storage), each with its reason."""
        return tuple(d for d in self.decisions if d.action != KEPT)

    @property
    def skipped(self) -> tuple[LayerDecision, ...]:
        """Layers kept in their original precision, each with its reason."""
        return tuple(d for d in self.decisions if d.action == KEPT)

    @property
    def counts(self) -> dict[str, int]:
        """``{"fp8 compute": n, "fp8 storage": n, "kept": n}``."""
        c = Counter(d.action for d in self.decisions)
        return {a: c.get(a, 0) for a in (COMPUTE, STORAGE, KEPT)}

    def grouped(self) -> list[tuple[str, str, str, int]]:
        """(action, name pattern with the first index as N, reason, count), in model order."""
        groups: dict[tuple[str, str, str], int] = {}
        for d in self.decisions:
            key = (d.action, _group_name(d.name), d.reason)
            groups[key] = groups.get(key, 0) + 1
        return [(a, n, r, c) for (a, n, r), c in groups.items()]

    def summary(self) -> str:
        c = self.counts
        return (f"fp8 {self.config.describe()}: {c[COMPUTE]} fp8 compute, {c[STORAGE]} fp8 storage, {c[KEPT]} kept; "
                f"module {_human_bytes(self.bytes_before)} -> {_human_bytes(self.bytes_after)}")

    def to_text(self) -> str:
        """Summary, notes, then one line per group of layers (node output text)."""
        lines = [self.summary(), *(f"note: {n}" for n in self.notes)]
        lines += [f"{a:11s} {n}{f' x{k}' if k > 1 else ''}: {r}" for a, n, r, k in self.grouped()]
        return "\n".join(lines)

    def to_markdown(self) -> str:
        """Markdown table of the grouped decisions, with the summary and notes above it."""
        lines = [self.summary(), "", *(f"- {n}" for n in self.notes), "", "| action | layers | count | reason |",
                 "|---|---|---|---|"]
        lines += [f"| {a} | `{n}` | {k} | {r} |" for a, n, r, k in self.grouped()]
        return "\n".join(lines)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds; TE quantized tensors are counted by their inner fp8 data and scales."""
    if type(t) not in (torch.Tensor, nn.Parameter):
        names = ("_data", "_transpose", "_scale_inv", "_rowwise_data", "_columnwise_data", "_rowwise_scale_inv",
                 "_columnwise_scale_inv")
        inner = [x for x in (getattr(t, a, None) for a in names) if isinstance(x, torch.Tensor)]
        if inner:
            return sum(x.numel() * x.element_size() for x in inner)
    return t.numel() * t.element_size()


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers, a tensor shared by several modules counted once (tensors that
    are views of one buffer count their own bytes)."""
    seen: set = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        plain = type(t) in (torch.Tensor, nn.Parameter) and t.device.type != "meta"
        key = (t.device, t.data_ptr(), t.numel(), t.dtype) if plain else id(t)
        if key in seen:
            continue
        seen.add(key)
        total += tensor_bytes(t)
    return total


def dequantize_module(layer: nn.Module, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dense [out, in] weight of a converted layer (or of a plain ``nn.Linear``), as ``dtype``."""
    if isinstance(layer, (Fp8Linear, TeLinear)):
        return layer.dequantize_weight(dtype)
    if isinstance(layer, nn.Linear):
        return layer.weight.detach().to(dtype)
    raise TypeError(f"dequantize_module: expected an fp8 linear or nn.Linear, got {type(layer).__name__}")


def _decide(name: str, layer: nn.Linear, config: Fp8Config, layer_filter: LayerFilter | None) -> LayerDecision:
    n_out, n_in = int(layer.weight.shape[0]), int(layer.weight.shape[1])
    preset = config.layer_preset
    role, reason = preset.classify(name)
    if layer_filter is not None:
        if layer_filter(layer, name):
            role, reason = ROLE_COMPUTE, "fp8 compute (selected by layer_filter)"
        elif role != ROLE_STORAGE:
            role, reason = ROLE_KEEP, "not selected by layer_filter"

    def kept(why: str) -> LayerDecision:
        return LayerDecision(name, KEPT, None, why, n_in, n_out)

    if role == ROLE_STORAGE and config.storage_layers == "bf16":
        return kept("storage-only layer kept bf16 (storage_layers='bf16')")
    if role not in (ROLE_COMPUTE, ROLE_STORAGE):
        return kept(reason)
    if layer.weight.dtype not in HIGH_PRECISION:
        why = f"weight dtype {layer.weight.dtype} is not bf16/fp16/fp32 (quantize from high-precision weights)"
        if config.force:
            raise Fp8ShapeError(f"{name}: {why}")
        return kept(why)
    if role == ROLE_STORAGE:
        return LayerDecision(name, STORAGE, "weight_only", reason, n_in, n_out)
    if config.backend == "weight_only":
        return LayerDecision(name, STORAGE, "weight_only", "fp8 storage, bf16 compute (backend weight_only)", n_in,
                             n_out)
    what = "Transformer Engine" if config.backend == "te" else "torch._scaled_mm"
    shape = scaled_mm_shape_capability(n_in, n_out, what)
    if not shape.ok:
        if config.force:
            raise Fp8ShapeError(f"{name}: {shape.reason}")
        return kept(shape.reason)
    return LayerDecision(name, COMPUTE, config.backend, reason, n_in, n_out)


def plan_linears(module: nn.Module, config: Fp8Config, layer_filter: LayerFilter | None = None,
                 scope: Callable[[str], bool] | None = None, prefix: str = "") -> tuple[LayerDecision, ...]:
    """Decisions :func:`quantize_linears` would take, without changing anything (no capability check).

    ``scope(qualified_name) -> bool`` limits the decisions to the linears it accepts (None: all); a model
    converted part by part (one block at a time) passes the part's names. ``prefix``: ``module`` is the submodule
    of that name in a larger model (``"transformer_blocks.7."``, the dot optional): decisions, presets and filters
    see the larger model's names, and only ``module`` is walked.
    Raises :class:`~.errors.Fp8ShapeError` under ``config.force`` for a selected layer it cannot convert.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(config, Fp8Config):
        raise TypeError(f"config must be an Fp8Config, got {type(config).__name__}")
    root = prefix.rstrip(".")
    decisions = []
    for name, layer in module.named_modules(prefix=root):
        if scope is not None and not scope(name):
            continue
        if isinstance(layer, (Fp8Linear, TeLinear)):
            decisions.append(LayerDecision(name, KEPT, None, f"already fp8 ({type(layer).__name__})",
                                           layer.in_features, layer.out_features))
        elif isinstance(layer, nn.Linear):
            if name == root:
                raise TypeError("quantize_linears converts children in place: pass the module that holds the Linear")
            decisions.append(_decide(name, layer, config, layer_filter))
    return tuple(decisions)


def _relative(name: str, prefix: str) -> str:
    """``name`` (a larger model's, see :func:`plan_linears`) relative to the submodule at ``prefix`` (with or without
    its trailing dot)."""
    root = prefix.rstrip(".")
    return name[len(root) + 1:] if root else name


def _convert(layer: nn.Linear, decision: LayerDecision, config: Fp8Config, recipe) -> nn.Module:
    if layer.weight.device.type == "meta":
        raise Fp8Error(f"{decision.name}: weights are on the meta device; load them before quantizing")
    if decision.action == STORAGE:
        return WeightOnlyLinear.from_linear(layer, decision.name)
    if config.backend == "te":
        return TeLinear(layer, config.te_recipe, recipe, decision.name)
    granularity = "rowwise" if config.backend == "scaled_mm_rowwise" else "tensorwise"
    return ScaledMMLinear.from_linear(layer, granularity, config.emulate, decision.name, config.fast_accum,
                                      config.gemm_kernel)


def _notes(config: Fp8Config, capability_reason: str) -> tuple[str, ...]:
    notes = [capability_reason]
    if config.backend == "te":
        notes.append("Transformer Engine layers run eager (torch.compiler.disable): torch.compile graph-breaks "
                     "around each one instead of recompiling per layer")
        if config.te_recipe.needs_calibration:
            notes.append("DelayedScaling: run calibrate_delayed_scaling(model, forwards) before use; "
                         "uncalibrated layers refuse to run")
    if config.backend == "weight_only":
        notes.append("weight_only: fp8 storage, bf16 compute (saves memory, not time)")
    return tuple(notes)


def quantize_linears(module: nn.Module, config: Fp8Config, layer_filter: LayerFilter | None = None,
                     scope: Callable[[str], bool] | None = None, prefix: str = "") -> ConversionReport:
    """Convert ``module``'s linears in place (the caller owns ``module``) and report every decision.

    module: any ``nn.Module`` holding ``nn.Linear`` children (weights bf16 / fp16
    / fp32 on any device for scaled-mm and weight-only; on CUDA for ``te``).
    config: :class:`~.config.Fp8Config`. layer_filter: ``(linear, qualified_name)
    -> bool``, see the module docstring. scope: ``qualified_name -> bool``, the
    linears to look at (None: all; see :func:`plan_linears`); the report's bytes
    are then those of the whole module. prefix: ``module``'s name in a larger
    model, whose names the decisions carry (see :func:`plan_linears`).

    Returns a :class:`ConversionReport`. Raises Fp8UnavailableError (backend
    cannot run here, with the reason), Fp8ShapeError (``force`` and a layer it
    cannot take), Fp8Error (meta weights; TE weight check), TypeError (bad args).
    """
    started = time.perf_counter()
    decisions = plan_linears(module, config, layer_filter, scope, prefix)
    capability = require_backend(config)
    recipe = build_recipe(config.te_recipe) if config.backend == "te" else None
    bytes_before = module_bytes(module)

    parents: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in module.modules():
        for child_name, child in parent._modules.items():
            if isinstance(child, nn.Linear):
                parents.setdefault(id(child), []).append((parent, child_name))
    with torch.no_grad():
        for decision in decisions:
            if decision.action == KEPT:
                continue
            layer = module.get_submodule(_relative(decision.name, prefix))
            new = _convert(layer, decision, config, recipe)
            for parent, child_name in parents[id(layer)]:
                setattr(parent, child_name, new)
            del layer
    report = ConversionReport(config, decisions, _notes(config, capability.reason), bytes_before,
                              module_bytes(module), time.perf_counter() - started)
    logger.debug("%s", report.summary())  # callers log the whole build once (a grouped build calls this per group)
    return report


def merge_reports(reports: list[ConversionReport], bytes_before: int, bytes_after: int) -> ConversionReport:
    """One report for a module converted part by part (:func:`quantize_linears` with ``scope``).

    Decisions in the parts' order, each note once, seconds summed; ``bytes_before`` / ``bytes_after`` are the
    caller's totals for the whole module (a part's own report counts the module as it was at that moment).
    """
    if not reports:
        raise ValueError("merge_reports: no reports")
    notes = tuple(dict.fromkeys(note for report in reports for note in report.notes))
    return ConversionReport(reports[0].config, tuple(d for report in reports for d in report.decisions), notes,
                            bytes_before, bytes_after, sum(report.seconds for report in reports))
