"""Non-finite latents are refused before the VAE decode, naming the stage and the likely cause."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from qwen_edit_hopper.qwen_edit.checkpoints import ModelFiles
from qwen_edit_hopper.qwen_edit.latents_check import NonFiniteLatentsError, check_latents
from qwen_edit_hopper.qwen_edit.plan import LoraChoice, PipePlan, Variant
from qwen_edit_hopper.qwen_edit.sampling import Conditioning

FILES = ModelFiles(layout="single_files", dit=Path("my_dit.safetensors"), text_encoder=Path("my_te.safetensors"),
                   vae=Path("my_vae.safetensors"))
PLAN = PipePlan(files=FILES, variant=Variant.EDIT_2509, variant_reason="test")


def _conditioning(prompt_value: float = 0.0, latent_value: float = 0.0) -> Conditioning:
    prompt = {"prompt_emb": torch.full((1, 4, 8), prompt_value), "prompt_emb_mask": torch.ones(1, 4, dtype=torch.long)}
    return Conditioning(positive=prompt, negative=dict(prompt), edit_latents=[torch.full((1, 16, 2, 2), latent_value)])


def _latents(value: float) -> torch.Tensor:
    latents = torch.zeros(1, 16, 4, 4, dtype=torch.bfloat16)
    latents[0, 3, 1, 1] = value
    return latents


def test_finite_latents_pass():
    check_latents(_latents(1e30), plan=PLAN, conditioning=_conditioning(), cfg=4.0)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_dit_overflow_names_the_dit_loras_and_cfg(value):
    plan = PLAN.with_lora(LoraChoice(path=Path("strong.safetensors"), strength=8.0))
    with pytest.raises(NonFiniteLatentsError) as info:
        check_latents(_latents(value), plan=plan, conditioning=_conditioning(), cfg=6.0)
    message = str(info.value)
    assert "NaN/Inf latents instead of an image (nothing was saved)" in message
    assert "the DiT my_dit.safetensors" in message and "strong.safetensors x 8" in message
    assert "true cfg 6" in message and "lower the LoRA strengths" in message and "lower cfg" in message


def test_text_encoder_overflow_is_named():
    with pytest.raises(NonFiniteLatentsError, match=r"the text encoder my_te\.safetensors overflowed"):
        check_latents(_latents(float("nan")), plan=PLAN, conditioning=_conditioning(prompt_value=float("inf")),
                      cfg=1.0)


def test_vae_encoder_overflow_is_named():
    with pytest.raises(NonFiniteLatentsError, match=r"the VAE my_vae\.safetensors overflowed"):
        check_latents(_latents(float("nan")), plan=PLAN, conditioning=_conditioning(latent_value=float("nan")),
                      cfg=1.0)


def test_one_step_of_the_default_schedule_is_refused_not_run_into_nan():
    from qwen_edit_hopper.qwen_edit.sampling import make_scheduler, steps_problem

    assert steps_problem("default", 2) is None and steps_problem("lightning", 1) is None
    with pytest.raises(ValueError, match=r"steps 1 with the default \(Qwen-Image\) schedule: it needs at least 2"):
        make_scheduler("default", 1, 64, 64)
    assert torch.isfinite(make_scheduler("default", 2, 64, 64).timesteps).all()
    assert torch.isfinite(make_scheduler("lightning", 1, 64, 64).timesteps).all()
