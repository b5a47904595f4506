"""Transformer Engine backend: ``te.Linear`` with fp8 weights, run eager.

Transformer Engine (TE, optional: ``pip install transformer_engine[pytorch]``)
is imported only when this backend is used; its absence is reported as a reason
(:func:`te_import_status`), never papered over.

What :class:`TeLinear` stores and how it runs
---------------------------------------------
* The ``te.Linear`` is built under ``te.quantized_model_init`` (``fp8_model_init``
  before TE 2.8) and under ``torch.no_grad()``, so its weight parameter is a TE
  quantized tensor holding only the row-wise fp8 copy (no bf16 master, no
  transposed copy; the forward GEMM on Hopper needs only the row-wise data).
  Bias stays in the compute dtype. Conversion checks the stored weight against
  an ideal per-tensor e4m3 quantization and raises if it is worse (catches a
  weight quantized with a unit scale).
* ``TeLinear.forward`` enters its own ``te.autocast(enabled=True, recipe=...)``
  around the TE call (outside one, TE would run bf16: that path does not exist
  here), pads tokens to a multiple of 16 (TE needs M % 8 == 0, K and N % 16 == 0)
  and slices the padding off.
* TE runs eager: ``TeLinear.forward`` is wrapped in ``torch.compiler.disable``.
  Letting dynamo trace TE modules hits dynamo's recompile limit (TE's
  per-module state is guarded per instance), so ``torch.compile`` of a model
  with TE layers compiles the code around them with a graph break at each one.

DelayedScaling calibration
--------------------------
TE updates delayed scales when the outermost ``te.autocast`` exits *with grad
enabled*; under ``torch.no_grad()`` / inference mode they stay 1.0 for ever
(measured 6e-2 to 1.1e-1 GEMM error). Hence: every ``delayed`` layer refuses to
run (:class:`~.errors.Fp8CalibrationError`) until
:func:`calibrate_delayed_scaling` ran a few representative forwards with grad
enabled (parameters are frozen, so no autograd graph or activation memory is
kept). Each layer call is its own outermost autocast, so scales update after
every layer call; use two or more forwards (e.g. a few sampler steps at
different timesteps): the first runs with unit input scales. The weight scale
of a delayed layer is set from the weight's own amax before quantizing it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from .config import TeRecipeConfig
from .errors import Fp8CalibrationError, Fp8Error, Fp8UnavailableError
from .linear import scaled_mm_shape_capability
from .quant import E4M3_MAX, EPS, dequantize, pad_rows, quantize_tensorwise, relative_error

__all__ = [
    "TE_TOKEN_MULTIPLE",
    "CalibrationReport",
    "TeLinear",
    "build_recipe",
    "calibrate_delayed_scaling",
    "import_te",
    "te_autocast",
    "te_import_status",
    "te_version",
]

logger = logging.getLogger(__name__)

TE_TOKEN_MULTIPLE = 16


@functools.lru_cache(maxsize=1)
def te_import_status() -> tuple[bool, str, str | None]:
    """(importable, reason, version) for ``transformer_engine.pytorch``; never raises. Cached."""
    version = te_version()
    if importlib.util.find_spec("transformer_engine") is None:
        return False, "Transformer Engine is not installed (pip install 'transformer_engine[pytorch]')", None
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as ex:  # TE raises ImportError, OSError, AssertionError... all are a reason here
        return False, f"Transformer Engine {version or '?'} is installed but its torch extension does not import: " \
                      f"{type(ex).__name__}: {ex}", version
    return True, f"Transformer Engine {version or '?'} imports", version


def te_version() -> str | None:
    """Installed Transformer Engine version from package metadata, or None (does not import TE)."""
    from importlib import metadata

    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def import_te():
    """Return ``transformer_engine.pytorch``; raise :class:`Fp8UnavailableError` with the reason if it cannot."""
    ok, reason, _ = te_import_status()
    if not ok:
        raise Fp8UnavailableError(reason)
    return importlib.import_module("transformer_engine.pytorch")


def build_recipe(cfg: TeRecipeConfig):
    """TE recipe object for ``cfg`` (imports TE). Raises Fp8UnavailableError if this TE lacks the recipe."""
    import_te()
    from transformer_engine.common import recipe as te_recipe

    fmt = getattr(te_recipe.Format, cfg.fp8_format)
    names = {"current": "Float8CurrentScaling", "delayed": "DelayedScaling", "block": "Float8BlockScaling",
             "mxfp8": "MXFP8BlockScaling", "nvfp4": "NVFP4BlockScaling"}
    cls = getattr(te_recipe, names[cfg.name], None)
    if cls is None:
        raise Fp8UnavailableError(f"Transformer Engine {te_version() or '?'} has no {names[cfg.name]} recipe")
    if cfg.name == "current":
        return cls(fp8_format=fmt)
    if cfg.name == "delayed":
        return cls(fp8_format=fmt, amax_history_len=cfg.amax_history_len, amax_compute_algo=cfg.amax_compute_algo)
    return cls()


def te_autocast(recipe):
    """``te.autocast(enabled=True, recipe=recipe)`` (``te.fp8_autocast`` before TE 2.8)."""
    te = import_te()
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def _te_model_init(recipe):
    te = import_te()
    if hasattr(te, "quantized_model_init"):
        return te.quantized_model_init(enabled=True, recipe=recipe)
    return te.fp8_model_init(enabled=True, recipe=recipe)


def _dequantize_te(param: torch.Tensor) -> torch.Tensor:
    if hasattr(param, "dequantize"):
        return param.dequantize(dtype=torch.float32)
    return param.float()


def _prime_delayed_weight_scale(param: torch.Tensor, weight: torch.Tensor, layer_name: str) -> None:
    """Set a delayed-scaling weight quantizer's scale to 448 / amax(weight) before quantizing into it."""
    quantizer = getattr(param, "_quantizer", None)
    scale = getattr(quantizer, "scale", None)
    if not isinstance(scale, torch.Tensor):
        raise Fp8Error(
            f"{layer_name}: cannot set the DelayedScaling weight scale in Transformer Engine {te_version() or '?'} "
            "(no quantizer scale on the fp8 weight); use te_recipe name 'current'"
        )
    amax = weight.detach().abs().amax().to(torch.float32).clamp(min=EPS)
    scale.copy_((E4M3_MAX / amax).reshape(scale.shape).to(scale.device, scale.dtype))


class TeLinear(nn.Module):
    """A ``te.Linear`` with fp8 weights, its own autocast, token padding, and eager execution.

    Input [..., in_features] (bf16 / fp16 / fp32 on CUDA) -> [..., out_features].
    ``weight`` / ``bias`` are TE's parameters (``weight`` is a TE quantized
    tensor; :meth:`dequantize_weight` gives a dense copy). ``state_dict`` is the
    inner ``te.Linear``'s (``te_linear.weight``, ``te_linear.bias``,
    ``te_linear._extra_state`` holding TE's scaling metadata).

    .. note:: K and N divisible by 16; CUDA compute capability >= 8.9.
    """

    token_multiple = TE_TOKEN_MULTIPLE

    def __init__(self, linear: nn.Linear, recipe_config: TeRecipeConfig, recipe=None, layer_name: str = ""):
        super().__init__()
        te = import_te()
        weight = linear.weight.detach()
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        self.layer_name = layer_name
        name = layer_name or "layer"
        if weight.device.type != "cuda":
            raise Fp8UnavailableError(
                f"{name}: Transformer Engine needs the layer on a CUDA device, found {weight.device}")
        shape = scaled_mm_shape_capability(self.in_features, self.out_features, "Transformer Engine")
        if not shape.ok:
            raise ValueError(f"{name}: {shape.reason}")
        self.recipe_config = recipe_config
        self.recipe = build_recipe(recipe_config) if recipe is None else recipe
        with torch.no_grad(), _te_model_init(self.recipe):
            inner = te.Linear(self.in_features, self.out_features, bias=linear.bias is not None,
                              params_dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            if recipe_config.needs_calibration:
                _prime_delayed_weight_scale(inner.weight, weight, name)
            if hasattr(inner.weight, "quantize_"):
                inner.weight.quantize_(weight)
            else:
                inner.weight.copy_(weight)
            if linear.bias is not None:
                inner.bias.copy_(linear.bias.detach())
        for p in inner.parameters():
            p.requires_grad_(False)
        self.te_linear = inner
        self._has_bias = linear.bias is not None
        self.weight_rel_error = self._check_weight(weight, name)
        self.needs_calibration = recipe_config.needs_calibration
        self.calibrated = not self.needs_calibration
        self._calibrating = False

    def _check_weight(self, weight: torch.Tensor, name: str) -> float:
        """Compare TE's stored fp8 weight with an ideal per-tensor e4m3 quantization; raise if clearly worse."""
        with torch.no_grad():
            err = relative_error(_dequantize_te(self.te_linear.weight), weight)
            ideal = relative_error(dequantize(*quantize_tensorwise(weight)), weight)
        if err > 1.25 * ideal + 1e-4:
            raise Fp8Error(f"{name}: Transformer Engine stored the weight with relative error {err:.2e}, worse than "
                           f"per-tensor e4m3 ({ideal:.2e}); its weight scale is wrong for recipe "
                           f"{self.recipe_config.describe()}")
        return err

    @property
    def weight(self) -> torch.Tensor:
        """TE's weight parameter (a TE quantized tensor holding fp8 data)."""
        return self.te_linear.weight

    @property
    def bias(self) -> torch.Tensor | None:
        """TE's bias parameter or None."""
        return self.te_linear.bias if self._has_bias else None

    def dequantize_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Dense [out, in] copy of the stored fp8 weight."""
        return _dequantize_te(self.te_linear.weight).to(dtype)

    def input_scale(self) -> float | None:
        """Delayed-scaling input scale TE currently holds, or None where this TE does not expose it."""
        try:
            return float(self.te_linear.fp8_meta["scaling_fwd"].scale[0].item())
        except (AttributeError, KeyError, IndexError, TypeError, RuntimeError):
            return None

    def extra_repr(self) -> str:
        state = "" if not self.needs_calibration else (", calibrated" if self.calibrated else ", UNCALIBRATED")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"recipe={self.recipe_config.describe()}{state}, eager (torch.compiler.disable)")

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.needs_calibration and not (self.calibrated or self._calibrating):
            raise Fp8CalibrationError(
                f"{self.layer_name or 'layer'}: DelayedScaling is uncalibrated (its scales stay 1.0 under no_grad: "
                "6e-2 to 1.1e-1 GEMM error); run calibrate_delayed_scaling(model, forwards) first or use the "
                "'current' recipe"
            )
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.layer_name or 'TeLinear'}: input has {x.shape[-1]} features, "
                             f"expected {self.in_features}")
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)
        rows = x2d.shape[0]
        x2d = pad_rows(x2d, self.token_multiple).contiguous()
        with te_autocast(self.recipe):
            y = self.te_linear(x2d)
        if y.shape[0] != rows:
            y = y[:rows]
        return y.reshape(*lead, self.out_features)


@dataclass(frozen=True)
class CalibrationReport:
    """Result of :func:`calibrate_delayed_scaling`.

    layers: qualified names calibrated; forwards: how many forwards ran;
    input_scales: (name, scale or None where TE does not expose it);
    verified: every scale was readable and none is still 1.0; reason: why not.
    """

    layers: tuple[str, ...]
    forwards: int
    input_scales: tuple[tuple[str, float | None], ...]
    verified: bool
    reason: str

    def to_text(self) -> str:
        known = [s for _, s in self.input_scales if s is not None]
        span = f"input scales {min(known):.3g}..{max(known):.3g}" if known else "input scales not readable"
        return f"DelayedScaling calibrated {len(self.layers)} layers with {self.forwards} forwards; {span}; " + (
            "verified" if self.verified else f"NOT verified: {self.reason}")


def calibrate_delayed_scaling(module: nn.Module, forwards: Iterable[Callable[[], object]]) -> CalibrationReport:
    """Fill the amax histories of every DelayedScaling :class:`TeLinear` in ``module`` and unlock them.

    ``forwards``: callables, each running one representative forward of
    ``module`` (e.g. ``[lambda: model(**inputs_t1), lambda: model(**inputs_t2)]``);
    two or more are advised (the first runs with unit scales). They run with
    grad enabled (TE only updates delayed scales then) while every parameter of
    ``module`` has ``requires_grad`` off (restored afterwards), so no autograd
    graph or activation memory is kept; inside ComfyUI's inference mode this
    stays in inference mode. Raises :class:`Fp8CalibrationError` when the module has no
    delayed layers, no forwards are given, or a layer's input scale is still 1.0
    afterwards (the layer never ran). Scales TE does not expose are reported as
    unverified (``verified=False`` with the reason), and logged.
    """
    layers = [(n, m) for n, m in module.named_modules() if isinstance(m, TeLinear) and m.needs_calibration]
    if not layers:
        raise Fp8CalibrationError(
            "calibrate_delayed_scaling: the module has no DelayedScaling Transformer Engine layers")
    calls = list(forwards)
    if not calls:
        raise Fp8CalibrationError("calibrate_delayed_scaling: no forwards given; pass one callable per forward")
    frozen = [p for p in module.parameters() if p.requires_grad]
    for p in frozen:  # grad mode on, but no autograd graph (and no saved activations) anywhere in the model
        p.requires_grad_(False)
    for _, m in layers:
        m._calibrating = True
    try:
        with torch.enable_grad():
            for call in calls:
                call()
    finally:
        for _, m in layers:
            m._calibrating = False
        for p in frozen:
            p.requires_grad_(True)
    scales = tuple((n, m.input_scale()) for n, m in layers)
    stuck = [n for n, s in scales if s == 1.0]
    if stuck:
        raise Fp8CalibrationError(
            f"DelayedScaling input scale still 1.0 after {len(calls)} calibration forwards for {len(stuck)} layers "
            f"(first: {stuck[0]}); do the forwards call these layers?"
        )
    unreadable = [n for n, s in scales if s is None]
    for _, m in layers:
        m.calibrated = True
        _drop_columnwise(m.te_linear.weight)
    reason = "" if not unreadable else (
        f"Transformer Engine {te_version() or '?'} does not expose fp8_meta scales ({len(unreadable)} layers)")
    if unreadable:
        logger.warning("DelayedScaling calibration ran but cannot be verified: %s", reason)
    report = CalibrationReport(tuple(n for n, _ in layers), len(calls), scales, not unreadable, reason)
    logger.info("%s", report.to_text())
    return report


def _drop_columnwise(param: torch.Tensor) -> None:
    """Free a transposed fp8 copy TE may have made while grad was enabled (inference needs row-wise only)."""
    update = getattr(param, "update_usage", None)
    if update is not None:
        try:
            update(rowwise_usage=True, columnwise_usage=False)
        except (TypeError, RuntimeError) as ex:  # a memory optimisation only: say so, keep going
            logger.info("could not drop TE's transposed weight copy (%s: %s); memory may include it",
                        type(ex).__name__, ex)
