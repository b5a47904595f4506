"""Frozen, self-validating configuration of an fp8 conversion.

``Fp8Config`` says which backend computes the selected linears, which layers
are selected (a named preset from :mod:`.presets` or a custom
:class:`~.presets.LayerPreset`), and, for Transformer Engine, which recipe.

Backends (see :mod:`.linear` and :mod:`.te_backend`):

* ``scaled_mm_rowwise``: ``torch._scaled_mm`` with per-token activation scales
  and per-output-channel weight scales (float8_e4m3fn, float32 scales). Needs
  CUDA compute capability >= 8.9 and a torch whose row-wise kernel runs there;
  the default, fastest under ``torch.compile`` on Hopper.
* ``scaled_mm_tensorwise``: ``torch._scaled_mm`` with one scale per tensor.
* ``te``: Transformer Engine ``te.Linear`` holding fp8 weights, run eager.
* ``weight_only``: fp8 weight storage with per-channel scales, bf16 compute.
  Saves memory, not time; runs on any device.

``gemm_kernel`` (``scaled_mm_rowwise`` only) picks who runs the GEMM: ``torch``
(``torch._scaled_mm``) or ``cublaslt`` (the pack's workspace-free cuBLASLt call,
:mod:`.cublaslt_gemm`: the same cuBLASLt kernel without the memset before it).

``emulate=True`` (scaled-mm backends only) runs the same quantization through
a dequantize-and-matmul fp32 reference instead of ``torch._scaled_mm``: any
device, slow, for tests and numerics studies. It is never chosen implicitly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .presets import DEFAULT_PRESET, LayerPreset, get_preset

__all__ = [
    "AMAX_ALGOS",
    "BACKENDS",
    "FP8_FORMATS",
    "GEMM_KERNELS",
    "SCALED_MM_BACKENDS",
    "STORAGE_LAYER_MODES",
    "TE_RECIPES",
    "Fp8Config",
    "TeRecipeConfig",
]

BACKENDS = ("te", "scaled_mm_rowwise", "scaled_mm_tensorwise", "weight_only")
SCALED_MM_BACKENDS = ("scaled_mm_rowwise", "scaled_mm_tensorwise")
TE_RECIPES = ("current", "delayed", "block", "mxfp8", "nvfp4")
FP8_FORMATS = ("E4M3", "HYBRID")
AMAX_ALGOS = ("max", "most_recent")
STORAGE_LAYER_MODES = ("fp8", "bf16")
GEMM_KERNELS = ("torch", "cublaslt")
"""``torch``: ``torch._scaled_mm``; ``cublaslt``: the pack's workspace-free cuBLASLt call (:mod:`.cublaslt_gemm`,
row-wise only). Also what :class:`.linear.ScaledMMLinear` accepts."""


def _choice(field_name: str, value: object, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{field_name}={value!r} is not allowed; allowed values: {', '.join(allowed)}")


def _flag(field_name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{field_name} must be a bool (True or False), got {value!r}")


@dataclass(frozen=True)
class TeRecipeConfig:
    """Transformer Engine recipe, built lazily by :func:`.te_backend.build_recipe`.

    name:
        ``current`` (Float8CurrentScaling, per-tensor scales computed from each
        tensor; the default on Hopper), ``delayed`` (DelayedScaling: scales from
        an amax history; needs :func:`.te_backend.calibrate_delayed_scaling`
        before use, uncalibrated layers refuse to run), ``block``
        (Float8BlockScaling, 1x128 / 128x128 blocks; compute capability >= 9.0
        and CUDA >= 12.9), ``mxfp8`` / ``nvfp4`` (Blackwell only, compute
        capability >= 10.0).
    fp8_format:
        ``E4M3`` or ``HYBRID`` (E4M3 forward, E5M2 backward; identical for
        inference). Used by ``current`` and ``delayed``; ``block`` is E4M3.
    amax_history_len, amax_compute_algo:
        DelayedScaling only: history length (>= 1) and ``max`` / ``most_recent``.
    """

    name: str = "current"
    fp8_format: str = "E4M3"
    amax_history_len: int = 16
    amax_compute_algo: str = "max"

    def __post_init__(self) -> None:
        _choice("te_recipe.name", self.name, TE_RECIPES)
        _choice("te_recipe.fp8_format", self.fp8_format, FP8_FORMATS)
        if self.name == "block" and self.fp8_format != "E4M3":
            raise ValueError(
                f"te_recipe.fp8_format={self.fp8_format!r} is not allowed with name='block'; allowed: E4M3")
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int):
            raise TypeError(f"te_recipe.amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if self.amax_history_len < 1:
            raise ValueError(f"te_recipe.amax_history_len={self.amax_history_len} is not allowed; allowed: an int >= 1")
        _choice("te_recipe.amax_compute_algo", self.amax_compute_algo, AMAX_ALGOS)

    @property
    def needs_calibration(self) -> bool:
        """True for DelayedScaling: its scales stay 1.0 until a calibration pass runs."""
        return self.name == "delayed"

    def describe(self) -> str:
        """One line, e.g. ``delayed (HYBRID, amax history 16, max)``."""
        if self.name == "delayed":
            return f"delayed ({self.fp8_format}, amax history {self.amax_history_len}, {self.amax_compute_algo})"
        if self.name == "current":
            return f"current ({self.fp8_format})"
        return self.name


@dataclass(frozen=True)
class Fp8Config:
    """What :func:`.swap.quantize_linears` converts, and how.

    backend:
        One of :data:`BACKENDS` (module docstring).
    preset:
        Name of a registered layer preset (:data:`.presets.PRESETS`) or a
        :class:`~.presets.LayerPreset`. Default ``"attn+mlp"``: attention
        projections and MLP linears of both streams in fp8 compute, modulation
        linears stored fp8 (bf16 compute), embeddings / norms / output kept bf16.
    storage_layers:
        ``fp8`` stores the preset's storage-only layers (Qwen-Image: modulation)
        as fp8 weights with per-channel scales and bf16 compute; ``bf16`` keeps
        them untouched.
    te_recipe:
        Transformer Engine recipe; only read when ``backend == "te"``.
    force:
        False: a selected layer whose shape the backend cannot take (K or N not
        divisible by 16) is skipped and reported. True: that raises
        :class:`~.errors.Fp8ShapeError` naming the layer.
    emulate:
        Scaled-mm backends only: compute through the fp32 dequantize-and-matmul
        reference instead of ``torch._scaled_mm`` (any device; tests/numerics).
    fast_accum:
        Scaled-mm backends only: ``torch._scaled_mm(use_fast_accum=True)``, cuBLASLt's
        fp8 fast accumulation on Hopper (what torchao's float8 uses by default): faster
        GEMMs, accumulation promoted to fp32 less often.
    gemm_kernel:
        ``scaled_mm_rowwise`` only: ``torch`` (``torch._scaled_mm``) or ``cublaslt`` (the pack's
        workspace-free cuBLASLt call; compute capability >= 9.0, cuBLASLt >= 12.9; bit-identical
        output, no memset before each large GEMM).
    """

    backend: str = "scaled_mm_rowwise"
    preset: str | LayerPreset = DEFAULT_PRESET
    storage_layers: str = "fp8"
    te_recipe: TeRecipeConfig = field(default_factory=TeRecipeConfig)
    force: bool = False
    emulate: bool = False
    fast_accum: bool = False
    gemm_kernel: str = "torch"

    def __post_init__(self) -> None:
        _choice("backend", self.backend, BACKENDS)
        if not isinstance(self.preset, (str, LayerPreset)):
            raise TypeError(f"preset must be a preset name or a LayerPreset, got {type(self.preset).__name__}")
        if isinstance(self.preset, str):
            get_preset(self.preset)  # raises ValueError naming the allowed presets
        _choice("storage_layers", self.storage_layers, STORAGE_LAYER_MODES)
        if not isinstance(self.te_recipe, TeRecipeConfig):
            raise TypeError(f"te_recipe must be a TeRecipeConfig, got {type(self.te_recipe).__name__}")
        _flag("force", self.force)
        _flag("emulate", self.emulate)
        _flag("fast_accum", self.fast_accum)
        _choice("gemm_kernel", self.gemm_kernel, GEMM_KERNELS)
        if self.gemm_kernel != "torch" and self.backend != "scaled_mm_rowwise":
            raise ValueError(f"gemm_kernel={self.gemm_kernel!r} is not allowed with backend={self.backend!r}; "
                             "allowed backend: scaled_mm_rowwise (or gemm_kernel='torch')")
        if self.emulate and self.backend not in SCALED_MM_BACKENDS:
            raise ValueError(
                f"emulate=True is not allowed with backend={self.backend!r}; allowed backends: "
                + ", ".join(SCALED_MM_BACKENDS)
            )

    @property
    def layer_preset(self) -> LayerPreset:
        """The resolved :class:`~.presets.LayerPreset`."""
        return self.preset if isinstance(self.preset, LayerPreset) else get_preset(self.preset)

    def describe(self) -> str:
        """One line for node output, e.g. ``scaled_mm_rowwise, preset attn+mlp, storage layers fp8``."""
        parts = [self.backend + (" (emulated)" if self.emulate else "")]
        if self.backend == "te":
            parts.append(f"recipe {self.te_recipe.describe()}")
        parts.append(f"preset {self.layer_preset.name}")
        parts.append(f"storage layers {self.storage_layers}")
        if self.force:
            parts.append("force")
        if self.fast_accum and self.backend in SCALED_MM_BACKENDS:
            parts.append("fast accumulation")
        if self.gemm_kernel != "torch":
            parts.append(f"GEMM {self.gemm_kernel}" + (" (not used: emulated)" if self.emulate else ""))
        return ", ".join(parts)
