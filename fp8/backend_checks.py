"""Whether an fp8 GEMM backend can run here, as a :class:`~.capability.Capability` ``(ok, reason)``; never raises.

The node's validation shows ``reason`` before any work starts. Requirements:

* fp8 compute (``scaled_mm_*``, ``te``): a CUDA GPU with compute capability
  >= 8.9 (Ada, Hopper and newer) and torch >= 2.5.
* ``scaled_mm_rowwise`` / ``scaled_mm_tensorwise``: additionally a 16x16x16
  ``torch._scaled_mm`` probe with that scaling must run on the GPU (cached per
  device); that is what tells whether this torch has the row-wise kernel there.
* ``te``: Transformer Engine >= 2.0 importable with its torch extension, and
  TE's own ``is_*_available`` check for the recipe. MXFP8 and NVFP4 need a
  Blackwell GPU (compute capability >= 10.0).
* ``weight_only``: anywhere (fp8 storage, compute in the input dtype).
"""

from __future__ import annotations

import functools
import importlib

import torch

from .capability import Capability, gpu_description, resolve_device
from .config import Fp8Config, TeRecipeConfig
from .errors import Fp8UnavailableError
from .te_backend import te_import_status

__all__ = [
    "MIN_COMPUTE_CAPABILITY",
    "MIN_TE_VERSION",
    "MIN_TORCH_VERSION",
    "check_backend",
    "fp8_compute_capability",
    "require_backend",
    "scaled_mm_capability",
    "te_capability",
]

MIN_COMPUTE_CAPABILITY = (8, 9)
MIN_TORCH_VERSION = (2, 5)
MIN_TE_VERSION = (2, 0)
BLACKWELL = (10, 0)




def _version_tuple(text: str | None) -> tuple[int, int]:
    parts = []
    for piece in (text or "0.0").split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    while len(parts) < 2:
        parts.append(0)
    return parts[0], parts[1]






def fp8_compute_capability(device: torch.device | str | None = None) -> Capability:
    """fp8 tensor-core GEMMs: CUDA GPU with compute capability >= 8.9 and torch >= 2.5."""
    need = f"needs a CUDA GPU with compute capability >= {MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]}"
    dev = resolve_device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return Capability(False, f"{need} (found: {gpu_description(dev)})")
    if torch.cuda.get_device_capability(dev) < MIN_COMPUTE_CAPABILITY:
        return Capability(False, f"{need} (found: {gpu_description(dev)})")
    if _version_tuple(torch.__version__) < MIN_TORCH_VERSION:
        return Capability(False, f"needs torch >= {MIN_TORCH_VERSION[0]}.{MIN_TORCH_VERSION[1]} for fp8 GEMMs "
                                 f"(found {torch.__version__})")
    return Capability(True, f"fp8 compute available on {gpu_description(dev)} (torch {torch.__version__})")


@functools.lru_cache(maxsize=16)
def _probe_scaled_mm(device_index: int, granularity: str) -> tuple[bool, str]:
    dev = torch.device("cuda", device_index)
    try:
        a = torch.zeros(16, 16, device=dev).to(torch.float8_e4m3fn)
        b = torch.zeros(16, 16, device=dev).to(torch.float8_e4m3fn)
        if granularity == "rowwise":
            sa, sb = torch.ones(16, 1, device=dev), torch.ones(1, 16, device=dev)
        else:
            sa = sb = torch.ones((), device=dev)
        torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        torch.cuda.synchronize(dev)
    except Exception as ex:  # the probe's purpose is to turn torch's error into a reason
        return False, f"{type(ex).__name__}: {str(ex).splitlines()[0] if str(ex) else ''}"
    return True, ""


def scaled_mm_capability(granularity: str = "rowwise", device: torch.device | str | None = None) -> Capability:
    """``torch._scaled_mm`` with ``rowwise`` or ``tensorwise`` scales on ``device``."""
    base = fp8_compute_capability(device)
    if not base.ok:
        return base
    dev = resolve_device(device)
    ok, err = _probe_scaled_mm(dev.index, granularity)
    if not ok:
        return Capability(False, f"torch {torch.__version__} cannot run {granularity} torch._scaled_mm on "
                                 f"{gpu_description(dev)}: {err}")
    return Capability(True, f"{granularity} torch._scaled_mm runs on {gpu_description(dev)} "
                            f"(torch {torch.__version__})")


def te_capability(recipe: TeRecipeConfig | None = None, device: torch.device | str | None = None) -> Capability:
    """Transformer Engine with ``recipe`` (default: current scaling) on ``device``."""
    recipe = recipe or TeRecipeConfig()
    base = fp8_compute_capability(device)
    if not base.ok:
        return base
    dev = resolve_device(device)
    cc = torch.cuda.get_device_capability(dev)
    if recipe.name in ("mxfp8", "nvfp4") and cc < BLACKWELL:
        return Capability(False, f"{recipe.name.upper()} needs a Blackwell GPU (compute capability >= 10.0; "
                                 f"found {gpu_description(dev)})")
    ok, reason, version = te_import_status()
    if not ok:
        return Capability(False, reason)
    if _version_tuple(version) < MIN_TE_VERSION:
        return Capability(False, f"needs Transformer Engine >= {MIN_TE_VERSION[0]}.{MIN_TE_VERSION[1]} "
                                 f"(found {version})")
    te = importlib.import_module("transformer_engine.pytorch")
    check_name = {"block": "is_fp8_block_scaling_available", "mxfp8": "is_mxfp8_available",
                  "nvfp4": "is_nvfp4_available"}.get(recipe.name, "is_fp8_available")
    check = getattr(te, check_name, None)
    if check is None:
        return Capability(False, f"Transformer Engine {version} has no {check_name} (recipe {recipe.name} "
                                 "unsupported by this version)")
    try:
        available, why = check(return_reason=True)
    except Exception as ex:  # TE's own check failing is a reason, not a crash
        return Capability(False, f"Transformer Engine {check_name} failed: {type(ex).__name__}: {ex}")
    if not available:
        return Capability(False, f"Transformer Engine {version}, recipe {recipe.describe()}: {why}")
    note = "; needs calibrate_delayed_scaling() before use" if recipe.needs_calibration else ""
    return Capability(True, f"Transformer Engine {version}, recipe {recipe.describe()} on "
                            f"{gpu_description(dev)}{note}")


def check_backend(config: Fp8Config | str, device: torch.device | str | None = None) -> Capability:
    """Capability of a backend (name, or a full :class:`~.config.Fp8Config`) on ``device`` (default: current)."""
    cfg = config if isinstance(config, Fp8Config) else Fp8Config(backend=config)
    if cfg.backend == "weight_only":
        return Capability(True, "weight-only fp8 storage runs on any device (compute in the input dtype; "
                                "saves memory, not time)")
    if cfg.backend == "te":
        return te_capability(cfg.te_recipe, device)
    granularity = "rowwise" if cfg.backend == "scaled_mm_rowwise" else "tensorwise"
    if cfg.emulate:
        return Capability(True, f"emulated {granularity} fp8: fp32 dequantize-and-matmul reference on any device "
                                "(slow; for tests and numerics)")
    capability = scaled_mm_capability(granularity, device)
    if capability.ok and cfg.gemm_kernel == "cublaslt":
        from .cublaslt_gemm import cublaslt_capability

        lt = cublaslt_capability(None if device is None else torch.device(device))
        if not lt.ok:
            return Capability(False, f"gemm_kernel cublaslt {lt.reason}; choose gemm_kernel torch")
    return capability


def require_backend(config: Fp8Config | str, device: torch.device | str | None = None) -> Capability:
    """:func:`check_backend`, raising :class:`~.errors.Fp8UnavailableError` (message = reason) when not ok."""
    cap = check_backend(config, device)
    if not cap.ok:
        backend = config.backend if isinstance(config, Fp8Config) else config
        raise Fp8UnavailableError(f"fp8 backend {backend}: {cap.reason}")
    return cap
