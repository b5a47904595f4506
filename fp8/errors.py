"""Exceptions raised by the fp8 toolkit.

Every error names what failed and why, so a node can show it as is. There is
no quiet fallback anywhere in ``fp8/``: a backend that cannot run raises one of
these (or reports a skip with a reason), it never drops to bf16 on its own.
"""

from __future__ import annotations

__all__ = ["AttentionUnavailableError", "Fp8CalibrationError", "Fp8Error", "Fp8ShapeError", "Fp8UnavailableError"]


class Fp8Error(RuntimeError):
    """Base class of every error raised by ``fp8/``."""


class Fp8UnavailableError(Fp8Error):
    """The requested backend cannot run here; the message is the capability reason."""


class Fp8ShapeError(Fp8Error, ValueError):
    """A layer forced into fp8 has a shape the backend cannot take (names the layer)."""


class Fp8CalibrationError(Fp8Error):
    """DelayedScaling layers used before (or without a working) calibration pass."""


class AttentionUnavailableError(Fp8UnavailableError):
    """The requested attention backend cannot run here; the message carries the capability reason."""
