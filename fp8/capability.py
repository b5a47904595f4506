"""The one capability convention of the pack: a frozen :class:`Capability` ``(ok, reason)``.

Every check that decides whether something can run here (an fp8 GEMM backend, an attention backend, a fused
kernel, CUDA graphs) returns a :class:`Capability` and never raises: ``reason`` says, in words a user can act on,
why it can run or why not (like Transformer Engine's ``is_fp8_available(return_reason=True)``). Callers that need
an error raise one with the reason; the fast forward's kernel selection collects the reasons of what it left out.

This module imports torch only, so that every kernel module can use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Capability", "cuda_capability", "gpu_description", "resolve_device", "triton_capability"]


@dataclass(frozen=True)
class Capability:
    """Whether something can run here (``ok``) and, in words, why or why not (``reason``)."""

    ok: bool
    reason: str

    @classmethod
    def yes(cls, reason: str) -> Capability:
        return cls(True, reason)

    @classmethod
    def no(cls, reason: str) -> Capability:
        return cls(False, reason)


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a ``torch.device`` with its index filled in (None: the current CUDA device, else the CPU)."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def cuda_capability(device: torch.device | str | None) -> tuple[int, int] | None:
    """The compute capability of a CUDA ``device``, or None (not CUDA, or no CUDA runtime here)."""
    dev = resolve_device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(dev))


def gpu_description(device: torch.device | str | None = None) -> str:
    """``"NVIDIA H100 80GB HBM3, compute capability 9.0"``, or ``"CPU"`` / ``"no CUDA device"``."""
    dev = resolve_device(device)
    if dev.type != "cuda":
        return "CPU" if dev.type == "cpu" else dev.type
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability(dev)
    return f"{torch.cuda.get_device_name(dev)}, compute capability {major}.{minor}"


def triton_capability() -> Capability:
    """Whether Triton is importable (it ships with CUDA builds of torch)."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return Capability.no(f"Triton is not importable ({exc})")
    return Capability.yes("Triton is importable")
