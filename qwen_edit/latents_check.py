"""The denoised latents must be finite before the VAE decodes them.

Every weight is checked finite when it is read, so NaN or Inf latents come from arithmetic that
overflowed: the DiT's activations (a fused LoRA at a high strength, fp8 scales, an extreme cfg, a
checkpoint whose weights are finite but far out of range), or the conditioning (the text encoder or the
VAE encoder overflowing on this input). Decoding them would save a black image with a success message;
:func:`check_latents` raises instead, naming the stage where the first non-finite value appears and
what in the plan is the likely cause.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from .plan import PipePlan

logger = logging.getLogger(__name__)


class NonFiniteLatentsError(RuntimeError):
    """Denoising produced NaN or Inf; the message names the likely cause and what to change."""


def _finite(tensors: Iterable[torch.Tensor | None]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point())


def check_latents(latents: torch.Tensor, *, plan: PipePlan, conditioning, cfg: float) -> None:
    """Refuse non-finite latents ``(1, 16, H/8, W/8)`` before the VAE decode (one host sync when finite).

    Args:
        latents: the denoised latents.
        plan: the pipe that produced them (its files, LoRAs and fp8 recipe are named in the message).
        conditioning: the ``sampling.Conditioning`` used (checked only on failure, to find the stage).
        cfg: the true-CFG scale used.

    Raises:
        NonFiniteLatentsError: naming the stage (text encoder, VAE encoder or DiT), the likely causes in
            this plan, and what to change.
    """
    if bool(torch.isfinite(latents).all()):
        return
    files = plan.files
    prompts = [conditioning.positive, conditioning.negative or {}]
    if not _finite(t for prompt in prompts for t in prompt.values()):
        raise NonFiniteLatentsError(
            f"the edit produced NaN/Inf instead of an image: the text encoder {files.text_encoder[0].name} "
            "overflowed while encoding this prompt and image (its weights are finite). Try the bf16 text "
            "encoder instead of an fp8 one, or another prompt; nothing was saved."
        )
    if not _finite(conditioning.edit_latents):
        raise NonFiniteLatentsError(
            f"the edit produced NaN/Inf instead of an image: the VAE {files.vae[0].name} overflowed while "
            "encoding the reference image (its weights are finite). Check the image, or pick the released "
            "qwen_image_vae.safetensors; nothing was saved."
        )
    causes = [f"the DiT {files.dit[0].name} (its weights are finite, so its activations overflowed)"]
    changes = []
    active = plan.active_loras
    if active:
        causes.append("the fused LoRAs " + ", ".join(f"{lora.name} x {lora.strength:g}" for lora in active))
        changes.append("lower the LoRA strengths or remove a LoRA")
    if plan.fp8 is not None:
        causes.append(f"fp8 {plan.fp8.describe()}")
        changes.append("run without Apply TE-FP8 to see whether fp8 is the cause")
    if cfg > 1:
        causes.append(f"true cfg {cfg:g}")
        changes.append("lower cfg")
    changes.append("check the DiT file against its source (a checkpoint with out-of-range weights does this)")
    raise NonFiniteLatentsError(
        "the edit produced NaN/Inf latents instead of an image (nothing was saved); the denoising went "
        f"non-finite. Likely causes: {'; '.join(causes)}. What to do: {'; '.join(changes)}."
    )
