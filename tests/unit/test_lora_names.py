"""Name resolution: kohya underscores map back to every DiT linear, prefixes strip, clashes fail."""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.qwen_edit.lora import LoraFormatError, TargetIndex, kohya_name
from qwen_edit_hopper.qwen_edit.lora.testing import tiny_target_shapes
from torch import nn


@pytest.fixture(scope="module")
def full_dit_shapes():
    """Names and shapes of DiffSynth's 60-layer Qwen-Image DiT, built on the meta device (no memory)."""
    qwen_dit = pytest.importorskip("diffsynth.models.qwen_image_dit")
    with torch.device("meta"):
        dit = qwen_dit.QwenImageDiT(num_layers=60)
    linears = sorted(n for n, m in dit.named_modules() if isinstance(m, nn.Linear))
    return {n: tuple(p.shape) for n, p in dit.named_parameters()}, linears


def test_kohya_round_trip_for_every_dit_linear(full_dit_shapes):
    shapes, linears = full_dit_shapes
    assert len(linears) == 60 * 14 + 6  # 14 per block + img_in, txt_in, 2 timestep, norm_out, proj_out
    index = TargetIndex(shapes)
    for module in linears:
        for prefix in ("lora_unet_", "lora_transformer_", "lycoris_"):
            assert index.resolve(prefix + kohya_name(module), "x") == (module, "kohya")
        assert index.resolve(kohya_name(module), "x")[0] == module  # bare underscore name
        for prefix in ("", "transformer.", "diffusion_model.", "model.diffusion_model.", "base_model.model."):
            assert index.resolve(prefix + module, "x") == (module, "dotted")
    examples = {
        "lora_unet_transformer_blocks_59_img_mlp_net_0_proj": "transformer_blocks.59.img_mlp.net.0.proj",
        "lora_unet_transformer_blocks_0_attn_to_out_0": "transformer_blocks.0.attn.to_out.0",
        "lora_unet_transformer_blocks_3_txt_mod_1": "transformer_blocks.3.txt_mod.1",
        "lora_unet_time_text_embed_timestep_embedder_linear_2": "time_text_embed.timestep_embedder.linear_2",
        "lora_unet_norm_out_linear": "norm_out.linear",
    }
    for key, module in examples.items():
        assert index.resolve(key, "x") == (module, "kohya")


def test_tiny_shapes_mirror_diffsynth_names(full_dit_shapes):
    shapes, _ = full_dit_shapes
    tiny = tiny_target_shapes(num_layers=60)
    assert set(tiny) == set(shapes)
    for name, shape in tiny.items():
        assert len(shape) == len(shapes[name]), name


def test_unknown_names_resolve_to_nothing():
    index = TargetIndex(tiny_target_shapes(num_layers=2))
    assert index.resolve("lora_unet_transformer_blocks_2_attn_to_q", "x") == (None, "")
    assert index.resolve("transformer_blocks.0.attn.to_qq", "x") == (None, "")
    assert index.resolve("transformer.single_transformer_blocks.0.attn.to_q", "x") == (None, "")


def test_ambiguous_underscore_names_fail():
    index = TargetIndex({"a.b_c.weight": (2, 2), "a_b.c.weight": (2, 2)})
    assert index.resolve("a.b_c", "x") == ("a.b_c", "dotted")
    with pytest.raises(LoraFormatError, match=r"amb\.safetensors.*'lora_unet_a_b_c' is ambiguous.*a\.b_c and a_b\.c"):
        index.resolve("lora_unet_a_b_c", "amb.safetensors")
