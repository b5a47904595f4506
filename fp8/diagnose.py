"""``diagnose()``: what this machine can do for fp8 Qwen-Image-Edit, as (name, value, reason) lines.

Reports GPU and compute capability, fp8 compute availability (and why not),
torch / CUDA / cuDNN versions and, on a GPU, which cuDNN library the process
actually loaded (from /proc/self/maps after a cuDNN convolution), Transformer
Engine (installed, version, torch extension importable, fp8 available),
flash-attn and FlashAttention-3 presence, which backend SDPA picks at
Qwen-Image attention shapes (1 x 24 heads x 8492 tokens x 128, bf16) on a GPU,
the host's own lines first (inside ComfyUI: its version), and a recommendation:

* ``fastest``: fp8 row-wise ``torch._scaled_mm``, compiled (compute capability
  >= 9.0 and the row-wise kernel runs);
* ``low VRAM``: weight-only fp8 storage, bf16 compute (other CUDA GPUs);
* ``bf16``: no CUDA GPU.

It never raises: a probe that fails becomes a line saying so.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import NamedTuple

import torch

from .backend_checks import fp8_compute_capability, scaled_mm_capability, te_capability
from .capability import gpu_description, resolve_device
from .config import Fp8Config
from .te_backend import te_import_status

__all__ = ["QWEN_ATTENTION_SHAPE", "Diagnosis", "DiagnosticLine", "diagnose"]

logger = logging.getLogger(__name__)

QWEN_ATTENTION_SHAPE = (1, 24, 8492, 128)  # batch, heads, tokens (4096 + 4096 image + 300 text), head dim


class DiagnosticLine(NamedTuple):
    """One fact: ``name``, its ``value``, and the ``reason`` / evidence behind it."""

    name: str
    value: str
    reason: str


@dataclass(frozen=True)
class Diagnosis:
    """Result of :func:`diagnose`: the lines, the recommended preset and its fp8 config (None = bf16)."""

    lines: tuple[DiagnosticLine, ...]
    recommendation: str
    recommendation_reason: str
    recommended_config: Fp8Config | None

    def to_text(self) -> str:
        """Aligned ``name: value (reason)`` lines."""
        width = max(len(line.name) for line in self.lines)
        return "\n".join(f"{line.name:<{width}}  {line.value}" + (f"  ({line.reason})" if line.reason else "")
                         for line in self.lines)

    def value(self, name: str) -> str | None:
        """The value of the first line called ``name``, or None."""
        return next((line.value for line in self.lines if line.name == name), None)


def _safe(lines: list[DiagnosticLine], name: str, probe: Callable[[], tuple[str, str]]) -> None:
    try:
        value, reason = probe()
    except Exception as ex:  # diagnose() must never raise; the failure itself is the finding
        value, reason = "error", f"probe failed: {type(ex).__name__}: {ex}"
        logger.debug("diagnose probe %s failed", name, exc_info=True)
    lines.append(DiagnosticLine(name, value, reason))


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _loaded_cudnn(dev: torch.device) -> tuple[str, str]:
    x = torch.randn(1, 8, 16, 16, device=dev)
    w = torch.randn(8, 8, 3, 3, device=dev)
    with torch.backends.cudnn.flags(enabled=True):
        torch.nn.functional.conv2d(x, w)
    torch.cuda.synchronize(dev)
    with open("/proc/self/maps", encoding="utf-8") as fh:
        paths = sorted({line.split()[-1] for line in fh if "libcudnn" in line and "/" in line})
    if not paths:
        return "none found", "no libcudnn mapped after a cuDNN convolution"
    main = [p for p in paths if "/libcudnn.so" in p] or paths
    return ", ".join(main), f"{len(paths)} cuDNN libraries mapped after a cuDNN convolution"


def _sdpa_choice(dev: torch.device) -> tuple[str, str]:
    from torch.nn.attention import SDPBackend

    q, k, v = (torch.randn(QWEN_ATTENTION_SHAPE, device=dev, dtype=torch.bfloat16) for _ in range(3))
    choice = torch._fused_sdp_choice(q, k, v)
    name = SDPBackend(choice).name
    return name, f"torch._fused_sdp_choice at {'x'.join(map(str, QWEN_ATTENTION_SHAPE))} bf16, no mask"


def _te_line() -> tuple[str, str]:
    ok, reason, version = te_import_status()
    if version is None and not ok:
        return "not installed", reason
    return (version or "?") + ("" if ok else " (extension broken)"), reason


def _recommend(dev: torch.device, row_ok: bool, row_reason: str) -> tuple[str, str, Fp8Config | None]:
    if dev.type != "cuda" or not torch.cuda.is_available():
        return "bf16", "no CUDA GPU: fp8 compute needs compute capability >= 8.9; run bf16", None
    cc = torch.cuda.get_device_capability(dev)
    if cc >= (9, 0) and row_ok:
        return ("fastest", f"compute capability {cc[0]}.{cc[1]} with row-wise torch._scaled_mm: fp8 row-wise, "
                "compiled (1.66x over bf16 eager measured on H200)", Fp8Config(backend="scaled_mm_rowwise"))
    why = row_reason if not row_ok else f"compute capability {cc[0]}.{cc[1]} < 9.0 (fp8 speed measured on Hopper only)"
    return "low VRAM", f"{why}: weight-only fp8 storage halves weight memory, bf16 compute", Fp8Config(
        backend="weight_only")


def diagnose(device: torch.device | str | None = None, host_lines: Sequence[DiagnosticLine] = ()) -> Diagnosis:
    """Probe ``device`` (default: the current CUDA device, else CPU); never raises.

    ``host_lines`` come first: what the host program knows about itself (the ComfyUI glue passes ComfyUI's
    version and memory mode, ``nodes.comfy_compat.diagnosis_lines``).
    """
    lines: list[DiagnosticLine] = list(host_lines)
    try:
        dev = resolve_device(device)
    except Exception as ex:  # a bad device string is reported, not raised
        lines.append(DiagnosticLine("device", str(device), f"cannot resolve: {type(ex).__name__}: {ex}"))
        dev = torch.device("cpu")
    on_gpu = dev.type == "cuda" and torch.cuda.is_available()

    def gpu() -> tuple[str, str]:
        if on_gpu:
            return torch.cuda.get_device_name(dev), f"{torch.cuda.device_count()} CUDA device(s) visible"
        if torch.cuda.is_available():
            return "no GPU", f"device {dev} requested (CUDA devices are visible)"
        build = f"torch built with CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only torch build"
        return "no GPU", f"torch.cuda.is_available() is False; {build}"

    _safe(lines, "gpu", gpu)
    _safe(lines, "compute capability",
          lambda: (("{}.{}".format(*torch.cuda.get_device_capability(dev))), gpu_description(dev)) if on_gpu
          else ("n/a", "no GPU"))
    _safe(lines, "fp8 compute", lambda: _cap_line(fp8_compute_capability(dev), "available", "unavailable"))
    row_ok: list[bool] = []

    def row() -> tuple[str, str]:
        cap = scaled_mm_capability("rowwise", dev)
        row_ok.append(cap.ok)
        return _cap_line(cap)

    _safe(lines, "scaled_mm row-wise", row)
    _safe(lines, "torch", lambda: (torch.__version__, ""))
    _safe(lines, "CUDA", lambda: (torch.version.cuda or "none",
                                  "torch's CUDA build version" if torch.version.cuda else "CPU-only torch build"))
    _safe(lines, "cuDNN", lambda: (str(torch.backends.cudnn.version()), "torch.backends.cudnn.version()")
          if torch.backends.cudnn.is_available() else ("none", "torch.backends.cudnn.is_available() is False"))
    if on_gpu:
        _safe(lines, "cuDNN loaded", lambda: _loaded_cudnn(dev))
    else:
        lines.append(DiagnosticLine("cuDNN loaded", "not checked", "no GPU"))
    _safe(lines, "Transformer Engine", _te_line)
    _safe(lines, "Transformer Engine fp8", lambda: _cap_line(te_capability(device=dev)))
    _safe(lines, "flash-attn", lambda: (
        (_dist_version("flash_attn", "flash-attn") or "?", "flash_attn importable")
        if importlib.util.find_spec("flash_attn") else ("not installed", "no flash_attn module")))
    _safe(lines, "FlashAttention-3", lambda: (
        (_dist_version("flash_attn_3", "flash-attn-3", "flashattn-hopper") or "installed",
         "flash_attn_interface found (DiffSynth uses FA3 when it imports)")
        if importlib.util.find_spec("flash_attn_interface") else ("not installed", "no flash_attn_interface module")))
    _safe(lines, "cuDNN FP8 attention", lambda: _cudnn_fp8_line(dev))
    if on_gpu:
        _safe(lines, "SDPA backend (Qwen-Image)", lambda: _sdpa_choice(dev))
    else:
        lines.append(DiagnosticLine("SDPA backend (Qwen-Image)", "not checked", "no GPU"))
    try:
        name, reason, config = _recommend(dev, bool(row_ok and row_ok[0]), _line_reason(lines, "scaled_mm row-wise"))
    except Exception as ex:  # never raise: recommend the safe choice and say why
        name, reason, config = "bf16", f"recommendation failed: {type(ex).__name__}: {ex}", None
    lines.append(DiagnosticLine("recommendation", name, reason))
    return Diagnosis(tuple(lines), name, reason, config)


def _cudnn_fp8_line(dev: torch.device) -> tuple[str, str]:
    """Whether ``attention: cudnn_fp8`` (the fastest preset's attention) can run here, and why not."""
    from .attention import attention_capability

    return _cap_line(attention_capability("cudnn_fp8", dev))


def _cap_line(cap, yes: str = "ok", no: str = "no") -> tuple[str, str]:
    return (yes if cap.ok else no), cap.reason


def _line_reason(lines: list[DiagnosticLine], name: str) -> str:
    """Reason of the first line called ``name`` (empty if none)."""
    return next((line.reason for line in lines if line.name == name), "")
