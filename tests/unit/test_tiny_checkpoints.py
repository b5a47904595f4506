"""The tiny checkpoint writer: real file names, small, deterministic."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from qwen_edit_hopper.qwen_edit.checkpoints import read_header
from qwen_edit_hopper.qwen_edit.tiny import TINY, tiny_state_dicts, write_tiny_checkpoints
from safetensors.torch import load_file
from test_checkpoints_support import COMFY_TOKENIZER_DIR, tiny

MAX_BYTES = 50_000_000


def _digest(root) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_diffusers_layout_mirrors_real_folder(tmp_path_factory):
    result = tiny("diffusers", "edit_2509", tmp_path_factory)
    root = result["root"]
    names = set(_digest(root))
    assert {
        "model_index.json",
        "transformer/config.json",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
        "text_encoder/config.json",
        "text_encoder/model.safetensors.index.json",
        "text_encoder/model-00001-of-00002.safetensors",
        "text_encoder/model-00002-of-00002.safetensors",
        "vae/config.json",
        "vae/diffusion_pytorch_model.safetensors",
        "processor/preprocessor_config.json",
        "processor/vocab.json",
        "processor/merges.txt",
        "processor/tokenizer_config.json",
        "tokenizer/vocab.json",
        "tokenizer/merges.txt",
        "tokenizer/tokenizer_config.json",
    } <= names
    assert json.loads((root / "model_index.json").read_text())["_class_name"] == "QwenImageEditPlusPipeline"
    assert "zero_cond_t" not in json.loads((root / "transformer" / "config.json").read_text())
    assert result["total_bytes"] < MAX_BYTES


def test_comfy_layout_mirrors_real_file_names(tmp_path_factory):
    result = tiny("comfy_single", "edit_2509", tmp_path_factory)
    names = set(_digest(result["root"]))
    assert names == {
        "diffusion_models/qwen_image_edit_2509_bf16.safetensors",
        "diffusion_models/qwen_image_edit_2509_fp8_e4m3fn.safetensors",
        "text_encoders/qwen_2.5_vl_7b.safetensors",
        "text_encoders/qwen_2.5_vl_7b_fp8_scaled.safetensors",
        "vae/qwen_image_vae.safetensors",
    }
    assert result["total_bytes"] < MAX_BYTES


def test_2511_sets_zero_cond_t(tmp_path_factory):
    root = tiny("diffusers", "edit_2511", tmp_path_factory)["root"]
    assert json.loads((root / "transformer" / "config.json").read_text())["zero_cond_t"] is True


@pytest.mark.parametrize("layout", ["diffusers", "comfy_single"])
def test_deterministic_for_a_seed(tmp_path, tmp_path_factory, layout):
    seed0 = _digest(tiny(layout, "edit_2509", tmp_path_factory)["root"])
    again = write_tiny_checkpoints(tmp_path / "a", layout, comfy_tokenizer_dir=COMFY_TOKENIZER_DIR, seed=0)
    assert _digest(again["root"]) == seed0
    other = write_tiny_checkpoints(tmp_path / "b", layout, comfy_tokenizer_dir=COMFY_TOKENIZER_DIR, seed=1)
    other = _digest(other["root"])
    changed = {k for k, v in other.items() if seed0[k] != v}
    assert changed and all(k.endswith(".safetensors") for k in changed)


def test_vocabulary_covers_the_real_tokenizer(tmp_path_factory):
    result = tiny("comfy_single", "edit_2509", tmp_path_factory)
    vocab, hidden = read_header(result["text_encoder"][0]).tensors["model.embed_tokens.weight"].shape
    assert vocab == TINY.vocab == 152064 and hidden == TINY.text_hidden
    tokenizer_vocab = json.loads((COMFY_TOKENIZER_DIR / "vocab.json").read_text())
    added = json.loads((COMFY_TOKENIZER_DIR / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert max([*tokenizer_vocab.values(), *map(int, added)]) < vocab


def test_weights_are_scaled_for_finite_lively_forwards():
    states = tiny_state_dicts(seed=0)
    dit = states["dit"]
    assert torch.equal(dit["transformer_blocks.0.attn.norm_q.weight"], torch.ones(32, dtype=torch.bfloat16))
    assert 0.015 < dit["transformer_blocks.0.img_mlp.net.0.proj.weight"].float().std() < 0.025
    vae = states["vae"]
    assert torch.equal(vae["encoder.norm_out.gamma"], torch.ones_like(vae["encoder.norm_out.gamma"]))
    assert all(t.dtype == torch.bfloat16 for state in states.values() for t in state.values())


def test_fp8_file_is_comfy_scaled_fp8(tmp_path_factory):
    result = tiny("comfy_single", "edit_2509", tmp_path_factory)
    tensors = load_file(str(result["text_encoder_fp8"]))
    assert tensors["scaled_fp8"].dtype == torch.float8_e4m3fn and tensors["scaled_fp8"].numel() == 0
    assert tensors["visual.blocks.0.attn.qkv.weight"].dtype == torch.float8_e4m3fn
    assert tensors["visual.blocks.0.attn.qkv.scale_weight"].shape == ()
    assert tensors["visual.blocks.0.attn.qkv.bias"].dtype == torch.bfloat16
    assert tensors["visual.patch_embed.proj.weight"].dtype == torch.bfloat16


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="layout must be"):
        write_tiny_checkpoints(tmp_path, "gguf", comfy_tokenizer_dir=COMFY_TOKENIZER_DIR)
    with pytest.raises(ValueError, match="variant must be"):
        write_tiny_checkpoints(tmp_path, "diffusers", comfy_tokenizer_dir=COMFY_TOKENIZER_DIR, variant="2509")
    with pytest.raises(FileNotFoundError, match="qwen25_tokenizer"):
        write_tiny_checkpoints(tmp_path, "diffusers", comfy_tokenizer_dir=tmp_path)
