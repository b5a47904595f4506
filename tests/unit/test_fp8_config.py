"""Fp8Config / TeRecipeConfig validation and the layer presets."""

from __future__ import annotations

import dataclasses

import pytest
from qwen_edit_hopper.fp8.config import Fp8Config, TeRecipeConfig
from qwen_edit_hopper.fp8.presets import DEFAULT_PRESET, PRESETS, LayerPreset, get_preset, preset_names


def test_defaults_are_the_documented_fast_path():
    cfg = Fp8Config()
    assert (cfg.backend, cfg.preset, cfg.storage_layers, cfg.force, cfg.emulate) == (
        "scaled_mm_rowwise", "attn+mlp", "fp8", False, False)
    assert cfg.te_recipe == TeRecipeConfig(name="current", fp8_format="E4M3")
    assert cfg.describe() == "scaled_mm_rowwise, preset attn+mlp, storage layers fp8"
    assert Fp8Config(backend="te", te_recipe=TeRecipeConfig("delayed", "HYBRID", 8, "most_recent")).describe() == (
        "te, recipe delayed (HYBRID, amax history 8, most_recent), preset attn+mlp, storage layers fp8")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"backend": "fp8_fast"}, ValueError,
         "backend='fp8_fast' is not allowed; allowed values: te, scaled_mm_rowwise, scaled_mm_tensorwise, weight_only"),
        ({"preset": "everything"}, ValueError, "preset='everything' is not allowed; allowed values: attn+mlp, "),
        ({"preset": 3}, TypeError, "preset must be a preset name or a LayerPreset"),
        ({"storage_layers": "fp16"}, ValueError, "storage_layers='fp16' is not allowed; allowed values: fp8, bf16"),
        ({"te_recipe": "delayed"}, TypeError, "te_recipe must be a TeRecipeConfig"),
        ({"force": "yes"}, TypeError, "force must be a bool"),
        ({"emulate": 1}, TypeError, "emulate must be a bool"),
        ({"backend": "te", "emulate": True}, ValueError,
         "emulate=True is not allowed with backend='te'; allowed backends: scaled_mm_rowwise, scaled_mm_tensorwise"),
        ({"backend": "weight_only", "emulate": True}, ValueError, "emulate=True is not allowed with backend="),
    ],
)
def test_config_errors_name_the_field_and_allowed_values(kwargs, error, message):
    with pytest.raises(error) as info:
        Fp8Config(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"name": "mx"}, ValueError, "te_recipe.name='mx' is not allowed; allowed values: current, delayed, block, "
                                     "mxfp8, nvfp4"),
        ({"fp8_format": "E5M2"}, ValueError, "te_recipe.fp8_format='E5M2' is not allowed; allowed values: E4M3, "
                                             "HYBRID"),
        ({"name": "block", "fp8_format": "HYBRID"}, ValueError, "not allowed with name='block'; allowed: E4M3"),
        ({"amax_history_len": 0}, ValueError, "te_recipe.amax_history_len=0 is not allowed; allowed: an int >= 1"),
        ({"amax_history_len": 2.0}, TypeError, "te_recipe.amax_history_len must be an int >= 1"),
        ({"amax_history_len": True}, TypeError, "te_recipe.amax_history_len must be an int >= 1"),
        ({"amax_compute_algo": "mean"}, ValueError,
         "te_recipe.amax_compute_algo='mean' is not allowed; allowed values: max, most_recent"),
    ],
)
def test_te_recipe_errors_name_the_field_and_allowed_values(kwargs, error, message):
    with pytest.raises(error) as info:
        TeRecipeConfig(**kwargs)
    assert message in str(info.value)


def test_configs_are_frozen_and_hashable():
    cfg = Fp8Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.backend = "te"
    assert hash(cfg) == hash(Fp8Config())
    assert TeRecipeConfig("delayed").needs_calibration and not TeRecipeConfig().needs_calibration


def test_presets_are_named_and_default_first():
    assert preset_names()[0] == DEFAULT_PRESET == "attn+mlp"
    assert set(preset_names()) == {"attn+mlp", "attn+mlp+mod compute", "mlp only", "all linears in blocks"}
    assert all(p.description for p in PRESETS.values())


@pytest.mark.parametrize(
    ("name", "role_prefix"),
    [
        ("transformer_blocks.0.attn.to_q", "compute"),
        ("transformer_blocks.59.attn.to_out.0", "compute"),
        ("transformer_blocks.12.attn.to_add_out", "compute"),
        ("transformer_blocks.3.txt_mlp.net.0.proj", "compute"),
        ("transformer_blocks.3.img_mlp.net.2", "compute"),
        ("transformer_blocks.3.img_mod.1", "storage"),
        ("transformer_blocks.3.txt_mod.1", "storage"),
        ("diffusion_model.transformer_blocks.0.attn.add_k_proj", "compute"),  # any prefix at a dot boundary
        ("img_in", "keep"),
        ("txt_in", "keep"),
        ("time_text_embed.timestep_embedder.linear_1", "keep"),
        ("norm_out.linear", "keep"),
        ("proj_out", "keep"),
        ("my_proj_out", "keep"),  # not a dot boundary: unmatched, kept as not selected
    ],
)
def test_default_preset_classifies_qwen_names(name, role_prefix):
    role, reason = get_preset("attn+mlp").classify(name)
    assert role == role_prefix
    assert reason


def test_preset_reasons_and_other_presets():
    default = get_preset("attn+mlp")
    assert default.classify("proj_out") == ("keep", "output projection kept bf16")
    assert default.classify("time_text_embed.timestep_embedder.linear_2")[1] == "timestep embedding kept bf16"
    assert default.classify("something.else") == ("keep", "not selected by preset 'attn+mlp'")
    assert get_preset("attn+mlp+mod compute").classify("transformer_blocks.0.img_mod.1")[0] == "compute"
    assert get_preset("mlp only").classify("transformer_blocks.0.attn.to_q")[0] == "keep"
    assert get_preset("all linears in blocks").classify("transformer_blocks.0.txt_mod.1")[0] == "compute"
    assert get_preset("all linears in blocks").classify("proj_out")[0] == "keep"


def test_custom_layer_preset_validates_and_is_accepted_by_the_config():
    custom = LayerPreset("ffn", "feed-forward only", compute=(r"blocks\.\d+\.ff\.\w+",), keep=((r"head", "head"),))
    cfg = Fp8Config(preset=custom)
    assert cfg.layer_preset is custom and "preset ffn" in cfg.describe()
    assert custom.classify("model.blocks.2.ff.up")[0] == "compute"
    with pytest.raises(ValueError, match="not a valid regular expression"):
        LayerPreset("bad", "", compute=("blocks.(",))
    with pytest.raises(TypeError, match=r"\(pattern, reason\) pairs"):
        LayerPreset("bad", "", compute=(), keep=("head",))
