"""Numerics report: per-layer and whole-forward relative error of an fp8 conversion against bf16.

:func:`numerics_report` runs the caller's forward once in the original
precision with a forward hook on every linear the conversion will touch. The
hook takes the layer's real input (up to ``max_tokens`` rows, evenly spaced)
and the layer's own bf16 output for those rows, builds a temporary fp8 copy of
that one layer with the same backend (for DelayedScaling: calibrated on that
input), and records ``||y_fp8 - y_bf16|| / ||y_bf16||`` on the same input. No
activations are stored, so memory stays at one extra layer. Then the module is
converted in place (:func:`.swap.quantize_linears`), DelayedScaling layers are
calibrated with ``calibration_forwards`` calls of the forward, and the forward
runs again for the whole-forward error against the first run.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .backend_checks import require_backend
from .config import Fp8Config
from .quant import relative_error
from .swap import KEPT, ConversionReport, LayerFilter, _convert, plan_linears, quantize_linears
from .te_backend import TeLinear, build_recipe, calibrate_delayed_scaling

__all__ = ["LayerNumerics", "NumericsReport", "numerics_report", "output_relative_error"]

logger = logging.getLogger(__name__)

ForwardOutput = torch.Tensor | Sequence[torch.Tensor]


@dataclass(frozen=True)
class LayerNumerics:
    """One converted layer: relative error of its fp8 output vs its bf16 output on the same real input.

    rel_error is the worst over the layer's calls in the forward; tokens the rows compared (summed over calls).
    """

    name: str
    action: str
    backend: str | None
    rel_error: float
    tokens: int
    calls: int


@dataclass(frozen=True)
class NumericsReport:
    """Per-layer rows (model order), the whole-forward relative error, and the conversion report."""

    rows: tuple[LayerNumerics, ...]
    forward_rel_error: float
    conversion: ConversionReport

    def worst(self, n: int = 5) -> tuple[LayerNumerics, ...]:
        """The ``n`` layers with the largest relative error."""
        return tuple(sorted(self.rows, key=lambda r: -r.rel_error)[:n])

    def summary(self) -> str:
        errs = [r.rel_error for r in self.rows]
        per_layer = (f"per-layer rel. error median {statistics.median(errs):.2e}, max {max(errs):.2e} "
                     f"({len(errs)} layers)") if errs else "no converted layers"
        return f"whole forward rel. error {self.forward_rel_error:.2e}; {per_layer}"

    def to_markdown(self) -> str:
        """Summary line, then a table: layer | action | backend | rel. error | tokens | calls."""
        lines = [self.summary(), "", "| layer | action | backend | rel. error | tokens | calls |",
                 "|---|---|---|---|---|---|"]
        lines += [f"| `{r.name}` | {r.action} | {r.backend or '-'} | {r.rel_error:.3e} | {r.tokens} | {r.calls} |"
                  for r in self.rows]
        return "\n".join(lines)


def _tensors(out: ForwardOutput) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Sequence) and all(isinstance(t, torch.Tensor) for t in out):
        return list(out)
    raise TypeError(f"forward_fn must return a tensor or a sequence of tensors, got {type(out).__name__}")


def output_relative_error(out: ForwardOutput, ref: ForwardOutput) -> float:
    """Relative error over all tensors of a forward's output: sqrt(sum ||o - r||^2) / sqrt(sum ||r||^2)."""
    outs, refs = _tensors(out), _tensors(ref)
    if len(outs) != len(refs):
        raise ValueError(f"forward returned {len(outs)} tensors, the reference {len(refs)}")
    num = sum(torch.linalg.vector_norm(o.detach().double() - r.detach().double()).item() ** 2
              for o, r in zip(outs, refs, strict=True))
    den = sum(torch.linalg.vector_norm(r.detach().double()).item() ** 2 for r in refs)
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return (num / den) ** 0.5


def _sample_rows(x2d: torch.Tensor, max_tokens: int) -> torch.Tensor:
    rows = x2d.shape[0]
    if rows <= max_tokens:
        return torch.arange(rows, device=x2d.device)
    return torch.linspace(0, rows - 1, max_tokens, device=x2d.device).round().long().unique()


def numerics_report(
    module: nn.Module,
    config: Fp8Config,
    forward_fn: Callable[[], ForwardOutput],
    layer_filter: LayerFilter | None = None,
    *,
    max_tokens: int = 2048,
    calibration_forwards: int = 2,
) -> NumericsReport:
    """Convert ``module`` in place with ``config`` and measure the fp8 error against its original precision.

    forward_fn: no-argument callable running one forward of ``module`` (it is
    called again after the conversion) and returning a tensor or a sequence of
    tensors. max_tokens: rows per layer call compared (evenly spaced).
    calibration_forwards: forwards used to calibrate DelayedScaling (TE only).

    Returns a :class:`NumericsReport`. Raises what :func:`.swap.quantize_linears` raises.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} is not allowed; allowed: an int >= 1")
    decisions = [d for d in plan_linears(module, config, layer_filter) if d.action != KEPT]
    require_backend(config)
    recipe = build_recipe(config.te_recipe) if config.backend == "te" else None
    stats: dict[str, list[tuple[float, int]]] = {d.name: [] for d in decisions}

    def make_hook(decision):
        def hook(layer: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            with torch.no_grad():
                x2d = inputs[0].detach().reshape(-1, layer.in_features)
                idx = _sample_rows(x2d, max_tokens)
                x, y_ref = x2d[idx], output.detach().reshape(-1, layer.out_features)[idx]
                temp = _convert(layer, decision, config, recipe)
            if isinstance(temp, TeLinear) and temp.needs_calibration:
                calibrate_delayed_scaling(nn.Sequential(temp), [lambda: temp(x)] * max(calibration_forwards, 1))
            with torch.no_grad():
                y = temp(x)
            stats[decision.name].append((relative_error(y, y_ref), int(x.shape[0])))
        return hook

    handles = [module.get_submodule(d.name).register_forward_hook(make_hook(d)) for d in decisions]
    try:
        with torch.no_grad():
            reference = [t.detach().clone() for t in _tensors(forward_fn())]
    finally:
        for h in handles:
            h.remove()

    conversion = quantize_linears(module, config, layer_filter)
    if config.backend == "te" and config.te_recipe.needs_calibration:
        calibrate_delayed_scaling(module, [forward_fn] * max(calibration_forwards, 1))
    with torch.no_grad():
        forward_error = output_relative_error(forward_fn(), reference)

    rows = []
    for d in decisions:
        calls = stats[d.name]
        if not calls:
            logger.warning("numerics_report: %s was not called by forward_fn; no per-layer error", d.name)
            continue
        rows.append(LayerNumerics(d.name, d.action, d.backend, max(e for e, _ in calls), sum(t for _, t in calls),
                                  len(calls)))
    report = NumericsReport(tuple(rows), forward_error, conversion)
    logger.info("%s", report.summary())
    return report
