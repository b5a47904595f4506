"""Does a prompt fit the GPU? An estimate from file headers, checked before anything is loaded.

What a prompt needs on the device: the models it will hold that are not held yet (the DiT as the plan builds it,
the VAE, the text encoder's resident part), plus working memory: the DiT forward's activations at this size and
batch, and the VAE decode. What the device offers: free memory plus what the host (ComfyUI) can unload. A prompt
that cannot fit is refused with both figures and the preset that would fit, instead of failing half-way through
a 20 GB load.

The estimates are upper bounds measured against full-size runs (docs/performance/); they refuse only what
clearly cannot fit.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

GIB = 2**30
TEXT_TOKENS = 512
"""Text tokens assumed for the working-memory estimate (prompts are shorter; the template adds about 64)."""
VAE_DECODE_BYTES_PER_PIXEL = 2400
"""VAE decode working memory per output pixel (bf16; about 2.3 GiB at 1024x1024)."""
FORWARD_OVERHEAD = 1 * GIB
"""Allocator slack, cuDNN / cuBLAS workspaces and compiled kernels' scratch."""


class NotEnoughMemoryError(RuntimeError):
    """A prompt needs more device memory than is free plus what the host can unload; the message says how much."""


@dataclass
class MemoryNeed:
    """Bytes a prompt needs on the device, by part (``models``: not yet held; ``working``: transient)."""

    models: dict[str, int] = field(default_factory=dict)
    working: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.models.values()) + max(self.working.values(), default=0)

    def describe(self) -> str:
        parts = [f"{name} {size / GIB:.1f}" for name, size in {**self.models, **self.working}.items() if size]
        return f"about {self.total / GIB:.1f} GiB ({', '.join(parts)}; working memory counted once, at its peak)"


def forward_working_bytes(width: int, height: int, references: int, batch: int, dim: int,
                          element_bytes: int = 2) -> int:
    """Activations of one DiT forward: ``batch`` x tokens x (MLP hidden 4D + a few D-wide tensors), plus slack.

    Tokens = target and reference image tokens (one per 16x16 pixels; references at about the target's area)
    plus :data:`TEXT_TOKENS`.
    """
    image_tokens = math.ceil(height / 16) * math.ceil(width / 16)
    tokens = image_tokens * (1 + references) + TEXT_TOKENS
    return batch * tokens * (4 * dim + 8 * dim) * element_bytes + FORWARD_OVERHEAD


def vae_decode_bytes(width: int, height: int) -> int:
    return width * height * VAE_DECODE_BYTES_PER_PIXEL


def estimate_need(runtime: Any, plan: Any, request: Any) -> MemoryNeed:
    """What ``plan`` needs for ``request`` on ``runtime``'s device, counting only models it does not hold yet."""
    from .dit_build import estimate_bytes
    from .runtime import dit_key, stored_bytes, text_encoder_key, vae_key

    held = {resident.key: resident for resident in runtime.residents()}
    need = MemoryNeed()
    if dit_key(plan) in held:
        dim = held[dit_key(plan)].module.img_in.out_features
    else:
        source = runtime.dit_source(plan)
        dim = source.config.dim
        need.models["DiT"] = estimate_bytes(source, plan.fp8, runtime.dtype)
        if plan.host_blocks and runtime.device.type == "cuda":  # one streamed block on the device at a time
            block = estimate_bytes(source, plan.fp8, runtime.dtype, group="transformer_blocks.0.")
            need.models["DiT"] -= (min(plan.host_blocks, source.config.num_layers) - 1) * block
    if vae_key(plan) not in held:
        need.models["VAE"] = stored_bytes(plan.files.vae)
    if text_encoder_key(plan) not in held and not runtime.streams_text_encoder:
        need.models["text encoder"] = stored_bytes(plan.files.text_encoder)
    element = 2 if runtime.dtype.itemsize <= 2 else 4
    batch = 2 if request.cfg != 1.0 else 1
    need.working["DiT forward"] = forward_working_bytes(request.width, request.height, len(request.images), batch,
                                                        dim, element)
    need.working["VAE decode"] = vae_decode_bytes(request.width, request.height) * element // 2
    return need


def check_fits(runtime: Any, plan: Any, request: Any) -> MemoryNeed:
    """Raise :class:`NotEnoughMemoryError` when ``plan`` cannot fit for ``request``; return the estimate.

    Nothing is loaded or unloaded here. On a CPU device there is nothing to check.
    """
    need = estimate_need(runtime, plan, request)
    if runtime.device.type == "cpu":
        return need
    available = runtime.hooks.available_bytes(runtime.device)
    if need.total <= available:
        return need
    raise NotEnoughMemoryError(
        f"Not enough GPU memory for this prompt: it needs {need.describe()}, and {available / GIB:.1f} GiB are "
        f"free on {runtime.device} once every model ComfyUI can unload is unloaded. {_what_fits(runtime, plan, need)}")


def _what_fits(runtime: Any, plan: Any, need: MemoryNeed) -> str:
    from ..fp8 import Fp8Config
    from .dit_build import estimate_bytes

    source = runtime.dit_source(plan)
    working = max(need.working.values(), default=0)
    options = []
    if plan.fp8 is None or plan.fp8.backend not in ("weight_only",):
        low = estimate_bytes(source, Fp8Config(backend="weight_only"), runtime.dtype)
        options.append(f"the low VRAM workflow (Apply TE-FP8 backend weight_only: DiT about {low / GIB:.1f} GiB, "
                       f"{(low + working) / GIB:.1f} GiB with working memory)")
    options.append("a smaller output size (width / height) or fewer reference images")
    options.append("closing other programs that use the GPU")
    return "What fits better: " + "; ".join(options) + "."
