"""Header-only views of the DiT: weight shapes for LoRA matching, a weightless DiT for fp8 planning."""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.qwen_edit.checkpoints import CheckpointError, resolve_single_files
from qwen_edit_hopper.qwen_edit.checkpoints.shapes import dit_config, dit_on_meta, dit_weight_shapes
from qwen_edit_hopper.qwen_edit.tiny import tiny_configs
from safetensors.torch import load_file, save_file
from test_checkpoints_support import keys_and_shapes, tiny


@pytest.mark.parametrize("layout", ["diffusers", "comfy_single"])
def test_weight_shapes_match_the_built_model(tmp_path_factory, layout):
    files = tiny(layout, "edit_2509", tmp_path_factory)["files"]
    shapes = dit_weight_shapes(files)
    assert shapes["transformer_blocks.0.attn.to_q.weight"] == (64, 64)
    model = dit_on_meta(files)
    assert all(p.is_meta for p in model.parameters())
    assert keys_and_shapes(model) == shapes
    assert dit_config(files) == tiny_configs()[0]


def test_prefix_and_fp8_scales_are_hidden(tmp_path, tmp_path_factory):
    files = tiny("comfy_single", "edit_2509", tmp_path_factory)
    tensors = load_file(str(files["dit"][0]))
    stored = {f"model.diffusion_model.{k}": v for k, v in tensors.items()}
    weight = stored["model.diffusion_model.img_in.weight"]
    stored["model.diffusion_model.img_in.weight"] = weight.to(torch.float8_e4m3fn)
    stored["model.diffusion_model.img_in.scale_weight"] = torch.tensor(1.0)
    path = tmp_path / "qwen_image_edit_2509_fp8_scaled.safetensors"
    save_file(stored, str(path))
    model_files = resolve_single_files(path, files["text_encoder"][0], files["vae"][0])
    assert dit_weight_shapes(model_files) == {k: tuple(v.shape) for k, v in tensors.items()}


def test_not_a_dit(tmp_path_factory):
    files = tiny("comfy_single", "edit_2509", tmp_path_factory)["files"]
    wrong = type(files)(layout="single_files", dit=files.vae, text_encoder=files.text_encoder, vae=files.vae)
    with pytest.raises(CheckpointError, match="holds a VAE"):
        dit_weight_shapes(wrong)
