"""Files are classified from their tensor names, and a file in the wrong slot gets a helpful error."""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.qwen_edit.checkpoints import (
    CheckpointError,
    CheckpointKind,
    classify_headers,
    classify_keys,
    expect_slot,
    read_header,
    resolve_single_files,
)
from safetensors.torch import save_file
from test_checkpoints_support import tiny


@pytest.fixture(scope="module")
def comfy_files(tmp_path_factory):
    return tiny("comfy_single", "edit_2509", tmp_path_factory)


@pytest.fixture(scope="module")
def diffusers_files(tmp_path_factory):
    return tiny("diffusers", "edit_2509", tmp_path_factory)


def _kind(paths):
    return classify_headers([read_header(p) for p in (paths if isinstance(paths, list) else [paths])])


def test_each_tiny_file_is_recognized(comfy_files, diffusers_files):
    assert _kind(comfy_files["dit"]).kind is CheckpointKind.DIT
    assert _kind(diffusers_files["dit"]).kind is CheckpointKind.DIT
    assert _kind(comfy_files["text_encoder"]).kind is CheckpointKind.TEXT_ENCODER
    assert _kind(diffusers_files["text_encoder"]).kind is CheckpointKind.TEXT_ENCODER
    fp8 = _kind(comfy_files["text_encoder_fp8"])
    assert fp8.kind is CheckpointKind.TEXT_ENCODER_FP8_SCALED
    assert "scaled_fp8 marker" in fp8.reason and "per-tensor scales" in fp8.reason
    assert _kind(comfy_files["vae"]).kind is CheckpointKind.VAE_COMFY
    assert _kind(diffusers_files["vae"]).kind is CheckpointKind.VAE_DIFFUSERS


def test_dit_reason_counts_blocks(comfy_files):
    found = _kind(comfy_files["dit"])
    assert "2 transformer_blocks" in found.reason
    assert found.prefix == ""


def test_dit_under_a_prefix_is_found():
    names = ("img_in.weight", "txt_in.weight", "transformer_blocks.0.attn.to_q.weight")
    keys = {f"model.diffusion_model.{k}" for k in names}
    found = classify_keys(keys)
    assert found.kind is CheckpointKind.DIT
    assert found.prefix == "model.diffusion_model."


@pytest.mark.parametrize(
    "keys",
    [
        {"transformer_blocks.0.attn.to_q.lora_A.weight", "transformer_blocks.0.attn.to_q.lora_B.weight"},
        {"lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight", "lora_unet_transformer_blocks_0_attn_to_q.alpha"},
        {"diffusion_model.transformer_blocks.0.img_mlp.net.2.lora_up.weight"},
        # a LoRA that also carries the DiT's key names must still be a LoRA
        {"img_in.weight", "txt_in.weight", "transformer_blocks.0.attn.to_q.lora_A.weight"},
    ],
)
def test_lora_keys_are_a_lora(keys):
    assert classify_keys(keys).kind is CheckpointKind.LORA


def test_unknown_keys_say_what_they_saw():
    found = classify_keys({"first_stage_model.decoder.conv_in.weight", "cond_stage_model.x"})
    assert found.kind is CheckpointKind.UNKNOWN
    assert "first keys" in found.reason and "cond_stage_model.x" in found.reason


def test_wan22_vae_is_not_qwen_vae():
    keys = {
        "encoder.conv1.weight",
        "decoder.conv1.weight",
        "decoder.middle.0.residual.0.gamma",
        "decoder.upsamples.0.upsamples.0.residual.2.weight",
    }
    found = classify_keys(keys)
    assert found.kind is CheckpointKind.UNKNOWN
    assert "Wan 2.2" in found.reason


def test_text_only_language_model_is_rejected():
    keys = {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias"}
    found = classify_keys(keys)
    assert found.kind is CheckpointKind.UNKNOWN
    assert "vision tower" in found.reason


def test_qwen3_is_not_qwen25():
    keys = {"model.embed_tokens.weight", "model.layers.0.self_attn.q_norm.weight", "visual.blocks.0.x"}
    assert "Qwen3" in classify_keys(keys).reason


def test_vae_chosen_as_dit_names_file_and_slot(comfy_files):
    vae = comfy_files["vae"][0]
    with pytest.raises(CheckpointError) as info:
        expect_slot([read_header(vae)], "dit")
    message = str(info.value)
    assert message.startswith("qwen_image_vae.safetensors was chosen as the diffusion model (DiT)")
    assert "holds a VAE (ComfyUI layout)" in message
    assert "pick it in the vae slot" in message


def test_text_encoder_chosen_as_vae(comfy_files):
    with pytest.raises(CheckpointError, match=r"holds a Qwen2\.5-VL text encoder .*pick it in the text_encoder slot"):
        expect_slot([read_header(comfy_files["text_encoder"][0])], "vae")


def test_lora_chosen_as_dit(tmp_path, comfy_files):
    lora = tmp_path / "my_style_lora.safetensors"
    save_file(
        {
            "transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 64),
            "transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(64, 4),
        },
        str(lora),
    )
    with pytest.raises(CheckpointError) as info:
        resolve_single_files(lora, comfy_files["text_encoder"][0], comfy_files["vae"][0])
    message = str(info.value)
    assert "my_style_lora.safetensors was chosen as the diffusion model (DiT) but it holds a LoRA" in message
    assert "load it with the LoRA node" in message


def test_vae_given_as_dit_through_the_resolver(comfy_files):
    with pytest.raises(CheckpointError, match=r"qwen_image_vae\.safetensors was chosen as the diffusion model"):
        resolve_single_files(comfy_files["vae"][0], comfy_files["text_encoder"][0], comfy_files["vae"][0])


def test_fp8_text_encoder_is_accepted_in_text_encoder_slot(comfy_files):
    found = expect_slot([read_header(comfy_files["text_encoder_fp8"])], "text_encoder")
    assert found.kind is CheckpointKind.TEXT_ENCODER_FP8_SCALED
