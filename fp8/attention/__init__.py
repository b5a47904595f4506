"""Attention backends for the Qwen-Image-Edit DiT, including an 8-bit Triton kernel for Hopper.

``attention(q, k, v, backend)`` with q, k, v (B, H, S, D) returns (B, S, H*D);
``attention_capability(name, device)`` says whether a backend can run and why not (a
:class:`~..capability.Capability`). See :mod:`.backends` for the list and :mod:`.triton_fp8` for the kernel
(imported lazily: importing this package does not import Triton).
"""

from ..errors import AttentionUnavailableError
from .backends import BACKENDS, attention, attention_capability, available_backends

__all__ = ["BACKENDS", "AttentionUnavailableError", "attention", "attention_capability", "available_backends"]
