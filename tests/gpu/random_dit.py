"""Random-weight DiTs and inputs for the GPU tests (no checkpoint needed): DiffSynth's DiT at a given size.

Init: matrices N(0, 1/fan_in) (modulation, norm_out x0.1), norms 1, biases 0 -- activations of a realistic scale
through 60 blocks.
"""

from __future__ import annotations

import math

import torch
from qwen_edit_hopper.fp8 import LayerPreset, get_preset
from qwen_edit_hopper.fp8.presets import DEFAULT_PRESET
from qwen_edit_hopper.qwen_edit.checkpoints.dit import DiTConfig, create_dit
from qwen_edit_hopper.qwen_edit.fast_forward import FUSED_QKV_PATTERN

FULL = DiTConfig(dim=3072, num_layers=60, num_heads=24, head_dim=128, text_dim=3584)
SIZE = 1024
TEXT_TOKENS = (300, 287)


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]), generator=gen)
                if "_mod." in name or "norm_out" in name:
                    p.mul_(0.1)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()


def build_random_dit(config: DiTConfig = FULL, device: str = "cuda", seed: int = 0) -> torch.nn.Module:
    """DiffSynth's DiT at ``config`` size in bf16 on ``device`` with random weights (no second copy at any time)."""
    dit = create_dit(config).to(torch.bfloat16)  # still on meta: free
    dit = dit.to_empty(device=device)
    randomize(dit, seed)
    return dit.eval()


def make_inputs(config: DiTConfig, size: int = SIZE, text_tokens: tuple[int, ...] = TEXT_TOKENS,
                device: str = "cuda", seed: int = 1) -> dict:
    """Batch-1 inputs for a ``size`` x ``size`` edit with one reference of the same size, plus ``prompts``: one
    conditioning dict per text length."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16)

    latent = size // 8
    prompts = [{"prompt_emb": randn(1, n, config.text_dim),
                "prompt_emb_mask": torch.ones(1, n, dtype=torch.long, device=device)} for n in text_tokens]
    return {
        "latents": randn(1, 16, latent, latent),
        "edit_latents": [randn(1, 16, latent, latent)],
        "timestep": torch.full((1,), 500.0, device=device, dtype=torch.bfloat16),
        "height": size,
        "width": size,
        "prompts": prompts,
    }


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def fused_preset() -> LayerPreset:
    """The default preset plus the fused Q/K/V names (harmless if the default already has them)."""
    base = get_preset(DEFAULT_PRESET)
    return LayerPreset(name=base.name + " + fused qkv", description=base.description,
                       compute=(*base.compute, FUSED_QKV_PATTERN), storage=base.storage, keep=base.keep)
