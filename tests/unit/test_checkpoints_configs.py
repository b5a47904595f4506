"""Sizes are inferred from shapes; impossible shapes fail naming the file; the processor is built offline."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from qwen_edit_hopper.qwen_edit.checkpoints import CheckpointError
from qwen_edit_hopper.qwen_edit.checkpoints.dit import DiTConfig, create_dit, infer_dit_config, scaled_axes_dim
from qwen_edit_hopper.qwen_edit.checkpoints.processor import (
    QWEN25_VL_IMAGE_PROCESSOR_DEFAULTS,
    build_processor,
    choose_processor_source,
    read_image_config,
)
from qwen_edit_hopper.qwen_edit.checkpoints.text_encoder import (
    TextEncoderConfig,
    canonical_key,
    hf_key,
    infer_text_encoder_config,
    scaled_mrope_section,
)
from qwen_edit_hopper.qwen_edit.checkpoints.vae import VAEConfig, create_vae, infer_vae_config
from qwen_edit_hopper.qwen_edit.tiny import tiny_configs
from test_checkpoints_support import COMFY_TOKENIZER_DIR, keys_and_shapes

SOURCE = Path("model.safetensors")


@pytest.mark.parametrize(
    ("head_dim", "axes"), [(128, (16, 56, 56)), (64, (8, 28, 28)), (32, (4, 14, 14)), (16, (2, 6, 8))]
)
def test_scaled_axes_dim(head_dim, axes):
    assert scaled_axes_dim(head_dim) == axes
    assert sum(axes) == head_dim and all(a % 2 == 0 for a in axes)


@pytest.mark.parametrize(("head_dim", "section"), [(128, (16, 24, 24)), (16, (2, 3, 3)), (64, (8, 12, 12))])
def test_scaled_mrope_section(head_dim, section):
    assert scaled_mrope_section(head_dim) == section


def _dit_shapes(config: DiTConfig | None = None):
    return keys_and_shapes(create_dit(config or tiny_configs()[0]))


def test_dit_config_round_trips():
    config = DiTConfig(dim=96, num_layers=3, num_heads=3, head_dim=32, text_dim=48, axes_dim=(4, 14, 14))
    assert infer_dit_config(_dit_shapes(config), source=SOURCE) == config


def test_dit_config_json_rope_axes_are_used():
    config = infer_dit_config(_dit_shapes(), source=SOURCE, hf_config={"axes_dims_rope": [8, 12, 12], "num_layers": 2})
    assert config.axes_dim == (8, 12, 12) and config.num_layers == 2


@pytest.mark.parametrize(("field", "declared", "actual"), [
    ("num_layers", 60, 2),
    ("attention_head_dim", 128, 32),
    ("num_attention_heads", 24, 2),
    ("joint_attention_dim", 3584, 32),
])
def test_dit_config_json_disagreeing_with_the_weights_is_refused(field, declared, actual):
    with pytest.raises(CheckpointError) as info:
        infer_dit_config(_dit_shapes(), source=SOURCE, hf_config={field: declared})
    message = str(info.value)
    assert message.startswith("model.safetensors disagrees with transformer/config.json")
    assert f"{field} is {declared} there but {actual} in the weights" in message
    assert "download the whole folder again" in message


def test_dit_missing_tensor():
    shapes = _dit_shapes()
    del shapes["txt_in.weight"]
    with pytest.raises(CheckpointError, match=r"^model\.safetensors lacks 'txt_in\.weight'"):
        infer_dit_config(shapes, source=SOURCE)


def test_dit_block_gap_is_named():
    shapes = {k.replace("transformer_blocks.1.", "transformer_blocks.2."): v for k, v in _dit_shapes().items()}
    with pytest.raises(CheckpointError, match=r"lacks transformer blocks 1: it holds 2 transformer blocks numbered "
                                              r"0 to 2, with gaps"):
        infer_dit_config(shapes, source=SOURCE)


def test_dit_incomplete_block_names_block_and_keys():
    shapes = {k: v for k, v in _dit_shapes().items() if not k.startswith("transformer_blocks.1.attn.to_q")}
    with pytest.raises(CheckpointError, match=r"has incomplete transformer blocks: transformer block 1 lacks 2 of "
                                              r"its \d+ tensors \('attn\.to_q\.bias', 'attn\.to_q\.weight'\)"):
        infer_dit_config(shapes, source=SOURCE)


def test_dit_wrong_mlp_width():
    shapes = _dit_shapes()
    shapes["transformer_blocks.0.img_mlp.net.0.proj.weight"] = (128, 64)
    with pytest.raises(CheckpointError, match=r"DiffSynth's blocks need 4 \* dim = 256"):
        infer_dit_config(shapes, source=SOURCE)


def test_released_width_without_config_needs_the_released_block_count():
    full = keys_and_shapes(create_dit(DiTConfig(dim=3072, num_layers=60, num_heads=24, head_dim=128, text_dim=3584)))
    assert infer_dit_config(full, source=SOURCE).num_layers == 60
    short = {k: v for k, v in full.items() if not re.match(r"transformer_blocks\.(5[2-9])\.", k)}
    with pytest.raises(CheckpointError) as info:
        infer_dit_config(short, source=SOURCE)
    assert "holds 52 transformer blocks, but the released Qwen-Image DiT at dim 3072 says 60" in str(info.value)
    # a config stating the count is the way to load a deliberately smaller model
    assert infer_dit_config(short, source=SOURCE, hf_config={"num_layers": 52}).num_layers == 52


def test_dit_config_rejects_bad_values():
    with pytest.raises(ValueError, match="num_heads"):
        DiTConfig(dim=64, num_layers=1, num_heads=3, head_dim=32, text_dim=8, axes_dim=(4, 14, 14))
    with pytest.raises(ValueError, match="axes_dim"):
        DiTConfig(dim=64, num_layers=1, num_heads=2, head_dim=32, text_dim=8, axes_dim=(4, 14, 12))


def test_text_encoder_keys_round_trip():
    for stored in ("model.layers.3.mlp.up_proj.weight", "visual.blocks.0.attn.qkv.bias", "lm_head.weight"):
        assert hf_key(canonical_key(stored)) == stored
    assert canonical_key("model.norm.weight") == "model.language_model.norm.weight"
    assert canonical_key("model.visual.merger.mlp.0.weight") == "model.visual.merger.mlp.0.weight"


def _te_shapes():
    from qwen_edit_hopper.qwen_edit.checkpoints.text_encoder import create_text_encoder

    return keys_and_shapes(create_text_encoder(tiny_configs()[1]))


def test_text_encoder_config_from_config_json_heads():
    shapes = _te_shapes()
    hf = {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_scaling": {"mrope_section": [1, 1, 2]},
        "vision_config": {"num_heads": 4, "fullatt_block_indexes": [0]},
    }
    config = infer_text_encoder_config(shapes, source=SOURCE, hf_config=hf)
    assert (config.num_heads, config.num_kv_heads, config.vision_num_heads) == (4, 2, 4)
    assert config.mrope_section == (1, 1, 2) and config.vision_fullatt_block_indexes == (0,)


def test_text_encoder_inconsistent_kv_heads():
    hf = {"num_attention_heads": 2, "num_key_value_heads": 2}
    with pytest.raises(CheckpointError, match="not 2 kv heads of 16"):
        infer_text_encoder_config(_te_shapes(), source=SOURCE, hf_config=hf)


def test_text_encoder_missing_vision_tensor_is_named_in_stored_form():
    shapes = _te_shapes()
    del shapes["model.visual.merger.mlp.2.weight"]
    with pytest.raises(CheckpointError, match=r"lacks 'visual\.merger\.mlp\.2\.weight'"):
        infer_text_encoder_config(shapes, source=SOURCE)


def test_text_encoder_config_defaults_are_the_7b():
    config = TextEncoderConfig()
    assert config.head_dim == 128 and sum(config.mrope_section) == 64
    with pytest.raises(ValueError, match="vision output"):
        TextEncoderConfig(vision_out_hidden_size=1)


def test_vae_config_round_trip_and_z_dim():
    config = VAEConfig(base_dim=8, dim_mult=(1, 2, 2), num_res_blocks=1, temperal_downsample=(True, False))
    assert infer_vae_config(keys_and_shapes(create_vae(config)), source=SOURCE) == config
    shapes = keys_and_shapes(create_vae(VAEConfig(base_dim=8)))
    shapes["post_quant_conv.weight"] = (48, 48, 1, 1, 1)
    with pytest.raises(CheckpointError, match="48 latent channels; Qwen-Image's VAE has 16"):
        infer_vae_config(shapes, source=SOURCE)


def test_processor_from_comfy_tokenizer_files():
    source = choose_processor_source(processor_dir=None, tokenizer_dir=None, comfy_tokenizer_dir=COMFY_TOKENIZER_DIR)
    assert "ComfyUI's Qwen2.5 tokenizer files" in source.reason
    assert dict(source.image_config) == dict(QWEN25_VL_IMAGE_PROCESSOR_DEFAULTS)
    processor = build_processor(comfy_tokenizer_dir=COMFY_TOKENIZER_DIR)
    assert processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == 151655
    from PIL import Image

    out = processor(
        text=["<|vision_start|><|image_pad|><|vision_end|>hi"],
        images=Image.new("RGB", (56, 56)),
        padding=True,
        return_tensors="pt",
    )
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert out["pixel_values"].shape == (16, 3 * 2 * 14 * 14)
    assert (out["input_ids"] == 151655).sum() == 4


def test_processor_folder_settings_win(tmp_path):
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((COMFY_TOKENIZER_DIR / name).read_bytes())
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"size": {"shortest_edge": 100, "longest_edge": 200000}, "merge_size": 2})
    )
    config = read_image_config(tmp_path)
    assert config["min_pixels"] == 100 and config["max_pixels"] == 200000
    source = choose_processor_source(processor_dir=tmp_path, comfy_tokenizer_dir=COMFY_TOKENIZER_DIR)
    assert source.tokenizer_dir == tmp_path and "processor/ folder" in source.reason


def test_no_tokenizer_anywhere(tmp_path):
    with pytest.raises(CheckpointError, match="looked in") as info:
        choose_processor_source(processor_dir=tmp_path / "processor", tokenizer_dir=tmp_path)
    assert "comfy/text_encoders/qwen25_tokenizer" in str(info.value)


def test_create_functions_allocate_nothing():
    from qwen_edit_hopper.qwen_edit.checkpoints.materialize import find_meta_tensors

    dit = create_dit(DiTConfig(dim=3072, num_layers=60, num_heads=24, head_dim=128, text_dim=3584))
    assert all(p.is_meta for p in dit.parameters())
    assert not dit.pos_embed.pos_freqs.is_meta  # RoPE tables are real
    vae = create_vae(VAEConfig())
    assert all(p.is_meta for p in vae.parameters()) and not vae.mean.is_meta
    leftovers = set(find_meta_tensors(vae))
    assert leftovers == {n for n, _ in vae.named_parameters()}
    assert torch.equal(vae.std, create_vae(VAEConfig(base_dim=8)).std)
