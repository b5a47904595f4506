"""Block structure and config files against the weights: every block from 0, complete, as many as stated."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from qwen_edit_hopper.qwen_edit.checkpoints import CheckpointError
from qwen_edit_hopper.qwen_edit.checkpoints.blocks import block_keys, check_block_count, check_blocks
from qwen_edit_hopper.qwen_edit.checkpoints.config_json import check_config_agrees
from qwen_edit_hopper.qwen_edit.checkpoints.text_encoder import (
    TextEncoderConfig,
    create_text_encoder,
    infer_text_encoder_config,
)
from qwen_edit_hopper.qwen_edit.checkpoints.vae import create_vae, infer_vae_config
from qwen_edit_hopper.qwen_edit.tiny import tiny_configs
from test_checkpoints_support import keys_and_shapes

SOURCE = Path("model.safetensors")


def _stack(blocks: int, keys=("a.weight", "a.bias", "b.weight")) -> list[str]:
    return [f"layers.{i}.{k}" for i in range(blocks) for k in keys] + ["norm.weight"]


def test_complete_blocks_are_counted():
    assert check_blocks(_stack(4), prefix="layers", what="layer", source=SOURCE) == 4
    assert check_blocks(["norm.weight"], prefix="layers", what="layer", source=SOURCE) == 0
    assert block_keys(_stack(2), "layers") == {0: {"a.weight", "a.bias", "b.weight"},
                                               1: {"a.weight", "a.bias", "b.weight"}}


@pytest.mark.parametrize("gone", [[0], [3], [1, 2]])
def test_missing_blocks_anywhere_but_the_end_are_named(gone):
    keys = [k for k in _stack(5) if not any(k.startswith(f"layers.{i}.") for i in gone)]
    with pytest.raises(CheckpointError) as info:
        check_blocks(keys, prefix="layers", what="layer", source=SOURCE)
    message = str(info.value)
    assert message.startswith(f"model.safetensors lacks layers {', '.join(map(str, gone))}:")
    assert f"it holds {5 - len(gone)} layers numbered 0 to 4, with gaps" in message
    assert "download it again" in message


@pytest.mark.parametrize("block", [0, 2, 4])
def test_a_block_missing_some_keys_is_named_with_the_keys(block):
    keys = [k for k in _stack(5) if k != f"layers.{block}.a.bias"]
    with pytest.raises(CheckpointError, match=rf"has incomplete layers: layer {block} lacks 1 of its 3 tensors "
                                              r"\('a\.bias'\)"):
        check_blocks(keys, prefix="layers", what="layer", source=SOURCE)


def test_many_incomplete_blocks_are_summarized():
    keys = [k for k in _stack(6) if not k.endswith("b.weight") or k.startswith("layers.0.")]
    with pytest.raises(CheckpointError, match=r"layer 3 lacks 1 of its 3 tensors \('b\.weight'\); and 2 more "
                                              r"incomplete layers"):
        check_blocks(keys, prefix="layers", what="layer", source=SOURCE)


def test_block_count_names_both_numbers():
    check_block_count(60, 60, what="block", said_by="the config", source=SOURCE, remedy="Fix it.")
    with pytest.raises(CheckpointError, match=r"^model\.safetensors holds 59 blocks, but the config says 60\. Fix"):
        check_block_count(59, 60, what="block", said_by="the config", source=SOURCE, remedy="Fix it.")


def test_config_fields_are_compared_and_missing_ones_skipped():
    check_config_agrees({"a": [1, 2], "b": None}, {"a": (1, 2), "b": 3, "c": 4}, config_name="x.json", source=SOURCE)
    with pytest.raises(CheckpointError) as info:
        check_config_agrees({"a": 1, "b": 2}, {"a": 3, "b": 4}, config_name="x.json", source=SOURCE)
    assert "disagrees with x.json: a is 1 there but 3 in the weights; b is 2 there but 4 in the weights" in str(
        info.value
    )


# ----------------------------------------------------------------------------- text encoder


def _te_shapes(config: TextEncoderConfig | None = None):
    return keys_and_shapes(create_text_encoder(config or tiny_configs()[1]))


@pytest.mark.parametrize(("hf", "expected"), [
    ({"num_hidden_layers": 28}, "num_hidden_layers is 28 there but 2 in the weights"),
    ({"text_config": {"num_hidden_layers": 3}}, "num_hidden_layers is 3 there but 2 in the weights"),
    ({"hidden_size": 3584}, "hidden_size is 3584 there but 32 in the weights"),
    ({"vocab_size": 151936}, "vocab_size is 151936 there but 152064 in the weights"),
    ({"vision_config": {"depth": 32}}, "vision_config.depth is 32 there but 2 in the weights"),
    ({"vision_config": {"out_hidden_size": 64}}, "vision_config.out_hidden_size is 64 there but 32 in the weights"),
])
def test_text_encoder_config_json_disagreeing_with_the_weights_is_refused(hf, expected):
    with pytest.raises(CheckpointError) as info:
        infer_text_encoder_config(_te_shapes(), source=SOURCE, hf_config=hf)
    assert "disagrees with text_encoder/config.json" in str(info.value) and expected in str(info.value)


def test_text_encoder_missing_layer_is_named():
    shapes = {k: v for k, v in _te_shapes().items() if not k.startswith("model.language_model.layers.0.")}
    with pytest.raises(CheckpointError, match="lacks language-model layers 0: it holds 1 language-model layers"):
        infer_text_encoder_config(shapes, source=SOURCE)


def test_text_encoder_incomplete_vision_block_is_named():
    shapes = {k: v for k, v in _te_shapes().items() if k != "model.visual.blocks.1.norm2.weight"}
    with pytest.raises(CheckpointError, match=r"vision block 1 lacks 1 of its \d+ tensors \('norm2\.weight'\)"):
        infer_text_encoder_config(shapes, source=SOURCE)


def test_released_text_encoder_widths_need_the_released_counts():
    """At the 7B widths (hidden 3584, vision 1280) without a config: 28 layers and 32 vision blocks."""
    released = TextEncoderConfig(num_layers=28, vision_depth=32)
    config = infer_text_encoder_config(_te_shapes(released), source=SOURCE)
    assert (config.num_layers, config.vision_depth) == (28, 32)
    with pytest.raises(CheckpointError, match=r"holds 27 language-model layers, but the released Qwen2\.5-VL "
                                              r"language model at hidden size 3584 says 28"):
        infer_text_encoder_config(_te_shapes(replace(released, num_layers=27)), source=SOURCE)
    with pytest.raises(CheckpointError, match=r"holds 31 vision blocks, but the released Qwen2\.5-VL vision tower "
                                              r"at hidden size 1280 says 32"):
        infer_text_encoder_config(_te_shapes(replace(released, vision_depth=31)), source=SOURCE)
    smaller = infer_text_encoder_config(_te_shapes(replace(released, num_layers=27)), source=SOURCE,
                                        hf_config={"num_hidden_layers": 27})
    assert smaller.num_layers == 27


# ----------------------------------------------------------------------------- VAE


@pytest.mark.parametrize(("hf", "expected"), [
    ({"base_dim": 96}, "base_dim is 96 there but 16 in the weights"),
    ({"dim_mult": [1, 2, 4]}, "dim_mult is [1, 2, 4] there but (1, 2, 4, 4) in the weights"),
    ({"num_res_blocks": 3}, "num_res_blocks is 3 there but 2 in the weights"),
    ({"temperal_downsample": [True, True, True]},
     "temperal_downsample is [True, True, True] there but (False, True, True) in the weights"),
])
def test_vae_config_json_disagreeing_with_the_weights_is_refused(hf, expected):
    shapes = keys_and_shapes(create_vae(tiny_configs()[2]))
    assert infer_vae_config(shapes, source=SOURCE, hf_config={"base_dim": 16, "z_dim": 16}) == tiny_configs()[2]
    with pytest.raises(CheckpointError) as info:
        infer_vae_config(shapes, source=SOURCE, hf_config=hf)
    assert "disagrees with vae/config.json" in str(info.value) and expected in str(info.value)
