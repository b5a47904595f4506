"""A tiny Qwen-Image DiT with the real layer names, built from DiffSynth's own blocks.

DiffSynth's ``QwenImageDiT`` hard-codes dim 3072, but ``QwenImageTransformerBlock``
takes sizes, so this stacks real blocks at dim 64 (2 heads x 32) between the
same input/output layers the full model has (``img_in``, ``txt_in``,
``time_text_embed.*``, ``norm_out.linear``, ``proj_out``). The fp8 tests (unit
and GPU) import :func:`build_tiny_dit` from here.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

diffsynth_dit = pytest.importorskip("diffsynth.models.qwen_image_dit")
general = pytest.importorskip("diffsynth.models.general_modules")

IMG_CH = 16  # patchified latent channels (64 in the real model)
TXT_DIM = 32  # text-encoder width (3584 in the real model)


class TinyQwenDiT(nn.Module):
    """Qwen-Image DiT layout at toy size: forward(image [B, H*W, 16], text [B, T, 32], timestep [B], h, w)."""

    def __init__(self, dim: int = 64, heads: int = 2, head_dim: int = 32, layers: int = 2):
        super().__init__()
        axes = [head_dim // 8, head_dim * 7 // 16, head_dim * 7 // 16]  # [16, 56, 56] at the real head_dim 128
        self.pos_embed = diffsynth_dit.QwenEmbedRope(theta=10000, axes_dim=axes, scale_rope=True)
        self.time_text_embed = general.TimestepEmbeddings(256, dim, diffusers_compatible_format=True, scale=1000)
        self.txt_norm = general.RMSNorm(TXT_DIM, eps=1e-6)
        self.img_in = nn.Linear(IMG_CH, dim)
        self.txt_in = nn.Linear(TXT_DIM, dim)
        self.transformer_blocks = nn.ModuleList(
            [diffsynth_dit.QwenImageTransformerBlock(dim, heads, head_dim) for _ in range(layers)]
        )
        self.norm_out = general.AdaLayerNorm(dim, single=True)
        self.proj_out = nn.Linear(dim, IMG_CH)

    def forward(self, image, text, timestep, height: int, width: int):
        image = self.img_in(image)
        text = self.txt_in(self.txt_norm(text))
        temb = self.time_text_embed(timestep, image.dtype)
        rope = self.pos_embed([(1, height, width)], [text.shape[1]], device=image.device)
        for block in self.transformer_blocks:
            text, image = block(image=image, text=text, temb=temb, image_rotary_emb=rope)
        return self.proj_out(self.norm_out(image, temb))


def build_tiny_dit(dtype=torch.bfloat16, device="cpu", layers: int = 2, seed: int = 0, **sizes) -> TinyQwenDiT:
    """Seeded tiny DiT in ``dtype`` on ``device``."""
    torch.manual_seed(seed)
    return TinyQwenDiT(layers=layers, **sizes).to(device=device, dtype=dtype).eval()


def tiny_inputs(dtype=torch.bfloat16, device="cpu", height: int = 4, width: int = 4, text_tokens: int = 7,
                seed: int = 1):
    """(image, text, timestep, height, width) with an odd text length (padding paths get exercised)."""
    g = torch.Generator().manual_seed(seed)
    image = torch.randn(1, height * width, IMG_CH, generator=g).to(device=device, dtype=dtype)
    text = torch.randn(1, text_tokens, TXT_DIM, generator=g).to(device=device, dtype=dtype)
    timestep = torch.tensor([500.0], device=device, dtype=dtype)
    return image, text, timestep, height, width


def qwen_linear_names(layers: int = 2) -> dict[str, list[str]]:
    """Expected qualified linear names of the tiny DiT, by role in the default preset."""
    attn = ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"]
    compute, storage = [], []
    for i in range(layers):
        compute += [f"transformer_blocks.{i}.attn.{a}" for a in attn]
        compute += [f"transformer_blocks.{i}.{s}_mlp.net.{p}" for s in ("img", "txt") for p in ("0.proj", "2")]
        storage += [f"transformer_blocks.{i}.{s}_mod.1" for s in ("img", "txt")]
    kept = ["img_in", "txt_in", "time_text_embed.timestep_embedder.linear_1",
            "time_text_embed.timestep_embedder.linear_2", "norm_out.linear", "proj_out"]
    return {"compute": compute, "storage": storage, "kept": kept}


def test_tiny_dit_has_the_qwen_layer_names_and_runs():
    model = build_tiny_dit()
    names = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    expected = qwen_linear_names()
    assert names == set(expected["compute"]) | set(expected["storage"]) | set(expected["kept"])
    with torch.no_grad():
        out = model(*tiny_inputs())
    assert out.shape == (1, 16, IMG_CH)
    assert torch.isfinite(out.float()).all()
