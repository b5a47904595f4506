"""Attention backends for the Qwen-Image-Edit DiT, including an 8-bit Triton kernel for Hopper.

``attention(q, k, v, backend)`` with q, k, v (B, H, S, D) returns (B, S, H*D);
``check_backend(name, device)`` says whether a backend can run and why not. See
:mod:`.backends` for the list and :mod:`.triton_fp8` for the kernel (imported lazily:
importing this package does not import Triton).
"""

from .backends import BACKENDS, AttentionUnavailableError, attention, available_backends, check_backend

__all__ = ["BACKENDS", "AttentionUnavailableError", "attention", "available_backends", "check_backend"]
