"""Model-agnostic FP8 toolkit for Hopper: configs, capability checks, Linear swaps, numerics.

Imports torch only; Transformer Engine is imported when the ``te`` backend is
used (its absence is a reported reason). Nothing here imports ComfyUI or the
Qwen pipeline; the Qwen-Image layer names live in :mod:`.presets` as patterns.

Typical use::

    from .fp8 import Fp8Config, check_backend, quantize_linears

    cfg = Fp8Config(backend="scaled_mm_rowwise")          # preset "attn+mlp"
    cap = check_backend(cfg)                              # Capability(ok, reason)
    report = quantize_linears(dit, cfg)                   # in place; ConversionReport
    print(report.to_text())

Modules: :mod:`.config` (Fp8Config, TeRecipeConfig), :mod:`.presets`,
:mod:`.capability` (the ``Capability`` value every check returns), :mod:`.backend_checks`,
:mod:`.quant` (quantization math), :mod:`.linear` (ScaledMMLinear, WeightOnlyLinear),
:mod:`.gelu_quant` / :mod:`.norm_quant` (fused quantization kernels), :mod:`.te_backend` (TeLinear, calibration),
:mod:`.swap` (quantize_linears), :mod:`.numerics`, :mod:`.diagnose`.
"""

from .backend_checks import check_backend, require_backend, scaled_mm_capability, te_capability
from .capability import Capability
from .config import BACKENDS, TE_RECIPES, Fp8Config, TeRecipeConfig
from .diagnose import Diagnosis, DiagnosticLine, diagnose
from .errors import Fp8CalibrationError, Fp8Error, Fp8ShapeError, Fp8UnavailableError
from .linear import Fp8Linear, ScaledMMLinear, WeightOnlyLinear
from .numerics import LayerNumerics, NumericsReport, numerics_report
from .presets import DEFAULT_PRESET, PRESETS, LayerPreset, get_preset, preset_names
from .quant import dequantize, quantize_rowwise, quantize_tensorwise, reference_scaled_mm
from .swap import ConversionReport, LayerDecision, dequantize_module, module_bytes, plan_linears, quantize_linears
from .te_backend import CalibrationReport, TeLinear, calibrate_delayed_scaling

__all__ = [
    "BACKENDS",
    "DEFAULT_PRESET",
    "PRESETS",
    "TE_RECIPES",
    "CalibrationReport",
    "Capability",
    "ConversionReport",
    "Diagnosis",
    "DiagnosticLine",
    "Fp8CalibrationError",
    "Fp8Config",
    "Fp8Error",
    "Fp8Linear",
    "Fp8ShapeError",
    "Fp8UnavailableError",
    "LayerDecision",
    "LayerNumerics",
    "LayerPreset",
    "NumericsReport",
    "ScaledMMLinear",
    "TeLinear",
    "TeRecipeConfig",
    "WeightOnlyLinear",
    "calibrate_delayed_scaling",
    "check_backend",
    "dequantize",
    "dequantize_module",
    "diagnose",
    "get_preset",
    "module_bytes",
    "numerics_report",
    "plan_linears",
    "preset_names",
    "quantize_linears",
    "quantize_rowwise",
    "quantize_tensorwise",
    "reference_scaled_mm",
    "require_backend",
    "scaled_mm_capability",
    "te_capability",
]
