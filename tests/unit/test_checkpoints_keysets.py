"""The tiny files carry exactly the real models' tensor names (real classes built on meta, no weights).

Also: the sized builders match DiffSynth's and ComfyUI's real models at full size,
and config inference on full-size shapes gives the released configurations.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from qwen_edit_hopper.qwen_edit.checkpoints import CheckpointError, read_header
from qwen_edit_hopper.qwen_edit.checkpoints.dit import DiTConfig, create_dit, infer_dit_config
from qwen_edit_hopper.qwen_edit.checkpoints.text_encoder import (
    TextEncoderConfig,
    canonical_key,
    create_text_encoder,
    infer_text_encoder_config,
)
from qwen_edit_hopper.qwen_edit.checkpoints.vae import (
    VAEConfig,
    comfy_to_diffusers_keys,
    create_vae,
    diffusers_to_comfy_keys,
    infer_vae_config,
)
from qwen_edit_hopper.qwen_edit.tiny import TINY
from test_checkpoints_support import (
    assert_same_structure,
    comfy,
    file_shapes,
    keys_and_shapes,
    tiny,
    truncate,
)

SOURCE = Path("checkpoint.safetensors")  # only named in error messages


@pytest.fixture(scope="module")
def diffusers_files(tmp_path_factory):
    return tiny("diffusers", "edit_2509", tmp_path_factory)


@pytest.fixture(scope="module")
def comfy_files(tmp_path_factory):
    return tiny("comfy_single", "edit_2509", tmp_path_factory)


def _diffsynth_text_encoder_meta(layers: int, vision_depth: int) -> torch.nn.Module:
    from diffsynth.models.qwen_image_text_encoder import QwenImageTextEncoder

    with torch.device("meta"):
        model = QwenImageTextEncoder()
    model.model.language_model.layers = truncate(model.model.language_model.layers, layers)
    model.model.visual.blocks = truncate(model.model.visual.blocks, vision_depth)
    return model


def _comfy_text_encoder_meta(operations, layers: int, vision_depth: int) -> torch.nn.Module:
    c = comfy()
    model = c.llama.Qwen25_7BVLI({"num_hidden_layers": layers}, torch.bfloat16, "meta", operations)
    model.visual.blocks = truncate(model.visual.blocks, vision_depth)
    return model


# --------------------------------------------------------------------------- tiny == real (names)


def test_tiny_dit_has_diffsynth_key_set(diffusers_files, comfy_files):
    from diffsynth.models.qwen_image_dit import QwenImageDiT

    with torch.device("meta"):
        real = keys_and_shapes(QwenImageDiT(num_layers=TINY.dit_layers))
    assert_same_structure(real, file_shapes(comfy_files["dit"]))
    assert_same_structure(real, file_shapes(diffusers_files["dit"]))


def test_tiny_diffusers_vae_has_diffsynth_key_set(diffusers_files):
    from diffsynth.models.qwen_image_vae import QwenImageVAE

    with torch.device("meta"):
        real = keys_and_shapes(QwenImageVAE())
    assert_same_structure(real, file_shapes(diffusers_files["vae"]))


def test_tiny_comfy_text_encoder_has_comfyui_key_set(comfy_files):
    c = comfy()
    real = keys_and_shapes(_comfy_text_encoder_meta(c.ops.manual_cast, TINY.text_layers, TINY.vision_depth))
    assert "lm_head.weight" not in real
    assert_same_structure(real, file_shapes(comfy_files["text_encoder"]))


def test_tiny_fp8_text_encoder_has_comfyui_scaled_fp8_key_set(comfy_files):
    c = comfy()
    ops = c.ops.scaled_fp8_ops(override_dtype=torch.float8_e4m3fn)
    real = keys_and_shapes(_comfy_text_encoder_meta(ops, TINY.text_layers, TINY.vision_depth))
    real["scaled_fp8"] = (0,)  # the marker ComfyUI's text-encoder wrapper adds (comfy/sd1_clip.py)
    tiny_shapes = file_shapes(comfy_files["text_encoder_fp8"])
    assert_same_structure(real, tiny_shapes)
    header_dtypes = read_header(comfy_files["text_encoder_fp8"]).dtypes()
    assert header_dtypes["model.layers.0.mlp.down_proj.weight"] == "F8_E4M3"
    assert header_dtypes["model.layers.0.mlp.down_proj.scale_weight"] == "F32"
    assert header_dtypes["model.embed_tokens.weight"] == "BF16"
    assert header_dtypes["scaled_fp8"] == "F8_E4M3"


def test_tiny_comfy_vae_has_comfyui_wan_key_set(comfy_files):
    c = comfy()
    with torch.device("meta"):
        real = keys_and_shapes(c.wan_vae.WanVAE(dim=96, z_dim=16, temperal_downsample=[False, True, True]))
    assert_same_structure(real, file_shapes(comfy_files["vae"]))


def test_diffusers_text_encoder_maps_to_diffsynth_key_set(diffusers_files):
    from diffsynth.utils.state_dict_converters.qwen_image_text_encoder import QwenImageTextEncoderStateDictConverter

    stored = file_shapes(diffusers_files["text_encoder"])
    assert "lm_head.weight" in stored and "model.layers.0.self_attn.q_proj.weight" in stored
    assert "visual.blocks.0.attn.qkv.weight" in stored
    converted = QwenImageTextEncoderStateDictConverter(stored)
    real = keys_and_shapes(_diffsynth_text_encoder_meta(TINY.text_layers, TINY.vision_depth))
    assert_same_structure(real, converted)
    # our own mapping agrees with DiffSynth's converter
    assert {canonical_key(k) for k in stored} == set(converted)


# --------------------------------------------------------------------------- VAE key mapping


def test_comfy_vae_mapping_is_complete_and_shapes_agree():
    c = comfy()
    with torch.device("meta"):
        wan = keys_and_shapes(c.wan_vae.WanVAE(dim=96, z_dim=16, temperal_downsample=[False, True, True]))
        qwen = keys_and_shapes(create_vae(VAEConfig()))
    mapping = comfy_to_diffusers_keys(wan, source=SOURCE)
    assert set(mapping) == set(wan)
    assert len(set(mapping.values())) == len(mapping)
    assert set(mapping.values()) == set(qwen)
    assert all(wan[k] == qwen[v] for k, v in mapping.items())
    assert diffusers_to_comfy_keys(qwen) == {v: k for k, v in mapping.items()}
    assert mapping["decoder.upsamples.3.resample.1.weight"] == "decoder.up_blocks.0.upsamplers.0.resample.1.weight"
    assert mapping["decoder.upsamples.4.residual.0.gamma"] == "decoder.up_blocks.1.resnets.0.norm1.gamma"
    assert mapping["encoder.middle.1.to_qkv.weight"] == "encoder.mid_block.attentions.0.to_qkv.weight"
    assert mapping["conv2.weight"] == "post_quant_conv.weight"


def test_unknown_comfy_vae_key_is_an_error():
    with pytest.raises(CheckpointError, match=r"'decoder\.upsamples\.0\.residual\.9\.weight', which has no place"):
        comfy_to_diffusers_keys(["decoder.upsamples.0.residual.9.weight"], source=Path("qwen_image_vae.safetensors"))


def test_converted_comfy_vae_computes_what_comfyui_computes():
    """Same weights in ComfyUI's WanVAE and in DiffSynth's QwenImageVAE via our mapping: same outputs."""
    from qwen_edit_hopper.qwen_edit.tiny import tiny_state_dicts

    c = comfy()
    diffusers_state = {k: v.float() for k, v in tiny_state_dicts()["vae"].items()}
    wan = c.wan_vae.WanVAE(dim=TINY.vae_base_dim, z_dim=16, temperal_downsample=[False, True, True])
    mapping = diffusers_to_comfy_keys(diffusers_state)
    wan.load_state_dict({mapping[k]: v for k, v in diffusers_state.items()})
    from diffsynth.models.qwen_image_vae import QwenImageVAE

    qwen = QwenImageVAE(base_dim=TINY.vae_base_dim)
    qwen.load_state_dict(diffusers_state)
    image = torch.randn(1, 3, 1, 32, 32, generator=torch.Generator().manual_seed(0))
    latent = torch.randn(1, 16, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(wan.encode(image), qwen.quant_conv(qwen.encoder(image))[:, :16])
        torch.testing.assert_close(wan.decode(latent), qwen.decoder(qwen.post_quant_conv(latent)))


# --------------------------------------------------------------------------- sized builders at full size


def test_sized_dit_equals_diffsynth_at_full_size():
    from diffsynth.models.qwen_image_dit import QwenImageDiT

    with torch.device("meta"):
        real = keys_and_shapes(QwenImageDiT(num_layers=60))
    config = infer_dit_config(real, source=SOURCE)
    assert config == DiTConfig(dim=3072, num_layers=60, num_heads=24, head_dim=128, text_dim=3584)
    assert config.axes_dim == (16, 56, 56)
    assert keys_and_shapes(create_dit(config)) == real


def test_sized_text_encoder_equals_diffsynth_at_full_size():
    from diffsynth.models.qwen_image_text_encoder import QwenImageTextEncoder

    with torch.device("meta"):
        reference = QwenImageTextEncoder()
    real = keys_and_shapes(reference)
    config = infer_text_encoder_config(real, source=SOURCE)
    assert config == TextEncoderConfig()
    built = create_text_encoder(config)
    # the same model, without lm_head: DiffSynth's forward returns hidden states and never reads it
    assert keys_and_shapes(built) == {k: v for k, v in real.items() if k != "lm_head.weight"}
    assert built.config.text_config.rope_parameters["mrope_section"] == [16, 24, 24]
    assert built.config.vision_config.fullatt_block_indexes == [7, 15, 23, 31]


def test_comfy_full_text_encoder_infers_the_7b_config():
    c = comfy()
    full = keys_and_shapes(c.llama.Qwen25_7BVLI({}, torch.bfloat16, "meta", c.ops.manual_cast))
    config = infer_text_encoder_config({canonical_key(k): v for k, v in full.items()}, source=SOURCE)
    assert config == TextEncoderConfig()


def test_vae_config_inferred_from_full_size():
    from diffsynth.models.qwen_image_vae import QwenImageVAE

    with torch.device("meta"):
        real = keys_and_shapes(QwenImageVAE())
    assert infer_vae_config(real, source=SOURCE) == VAEConfig()
