"""Variant detection returns the release and why, or "unknown" with why."""

from __future__ import annotations

import json
import shutil

import pytest
from qwen_edit_hopper.qwen_edit.checkpoints import ModelFiles, detect_variant
from qwen_edit_hopper.qwen_edit.checkpoints.variants import variant_from_text
from safetensors.torch import load_file, save_file
from test_checkpoints_support import tiny


@pytest.mark.parametrize(
    ("variant", "reason"),
    [
        ("edit", "model_index.json names QwenImageEditPipeline"),
        ("edit_2509", "QwenImageEditPlusPipeline (multi-image) and transformer/config.json has no zero_cond_t"),
        ("edit_2511", "transformer/config.json sets zero_cond_t=true"),
    ],
)
def test_diffusers_folders(tmp_path_factory, variant, reason):
    files = tiny("diffusers", variant, tmp_path_factory)["files"]
    info = detect_variant(files)
    assert info.name == variant
    assert reason in info.reason


@pytest.mark.parametrize(
    ("variant", "file_name"),
    [
        ("edit", "qwen_image_edit_bf16.safetensors"),
        ("edit_2509", "qwen_image_edit_2509_bf16.safetensors"),
        ("edit_2511", "qwen_image_edit_2511_bf16.safetensors"),
    ],
)
def test_comfy_single_files(tmp_path_factory, variant, file_name):
    files = tiny("comfy_single", variant, tmp_path_factory)["files"]
    assert files.dit[0].name == file_name
    info = detect_variant(files)
    assert info.name == variant
    assert f"the DiT file name {file_name!r}" in info.reason


def test_properties():
    from qwen_edit_hopper.qwen_edit.checkpoints import VariantInfo

    assert VariantInfo("edit", "x").max_images == 1
    assert VariantInfo("edit_2509", "x").max_images == 3
    assert VariantInfo("edit_2511", "x").zero_cond_t
    assert not VariantInfo("edit_2509", "x").zero_cond_t
    assert VariantInfo("unknown", "x").max_images is None and not VariantInfo("unknown", "x").known
    with pytest.raises(ValueError):
        VariantInfo("edit_2600", "x")


def _renamed_single(tmp_path, comfy, name, metadata=None):
    dit = tmp_path / name
    if metadata is None:
        shutil.copy(comfy["dit"][0], dit)
    else:
        save_file(load_file(str(comfy["dit"][0])), str(dit), metadata=metadata)
    return ModelFiles(
        layout="single_files", dit=(dit,), text_encoder=comfy["files"].text_encoder, vae=comfy["files"].vae
    )


def test_unknown_when_nothing_tells(tmp_path, tmp_path_factory):
    comfy = tiny("comfy_single", "edit_2509", tmp_path_factory)
    info = detect_variant(_renamed_single(tmp_path, comfy, "my_model.safetensors"))
    assert info.name == "unknown"
    assert "choose the variant by hand" in info.reason


def test_metadata_field_decides(tmp_path, tmp_path_factory):
    comfy = tiny("comfy_single", "edit_2509", tmp_path_factory)
    files = _renamed_single(tmp_path, comfy, "my_model.safetensors", {"modelspec.title": "Qwen-Image-Edit-2511 bf16"})
    info = detect_variant(files)
    assert info.name == "edit_2511"
    assert "safetensors metadata modelspec.title='Qwen-Image-Edit-2511 bf16'" in info.reason


def test_metadata_outranks_file_name_and_disagreement_is_reported(tmp_path, tmp_path_factory):
    comfy = tiny("comfy_single", "edit_2509", tmp_path_factory)
    files = _renamed_single(tmp_path, comfy, "qwen_image_edit_2509_x.safetensors", {"modelspec.title": "edit 2511"})
    info = detect_variant(files)
    assert info.name == "edit_2511"
    assert "although the DiT file name" in info.reason and "suggests edit_2509" in info.reason


def test_override(tmp_path_factory):
    files = tiny("comfy_single", "edit_2509", tmp_path_factory)["files"]
    assert detect_variant(files, override="edit_2511").reason == "chosen by hand"
    assert detect_variant(files, override="auto").name == "edit_2509"
    with pytest.raises(ValueError, match="variant override"):
        detect_variant(files, override="2511")


def _folder_copy(tmp_path, tmp_path_factory, name="model"):
    source = tiny("diffusers", "edit_2509", tmp_path_factory)["root"]
    target = tmp_path / name
    shutil.copytree(source, target)
    files = tiny("diffusers", "edit_2509", tmp_path_factory)["files"]
    rebase = lambda paths: tuple(target / p.relative_to(source) for p in paths)  # noqa: E731
    return target, ModelFiles(
        layout="diffusers",
        dit=rebase(files.dit),
        text_encoder=rebase(files.text_encoder),
        vae=rebase(files.vae),
        root=target,
    )


def test_text_to_image_pipeline_is_unknown(tmp_path, tmp_path_factory):
    root, files = _folder_copy(tmp_path, tmp_path_factory)
    (root / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    info = detect_variant(files)
    assert info.name == "unknown"
    assert "QwenImagePipeline, which is not a Qwen-Image-Edit pipeline" in info.reason


def test_edit_plus_without_transformer_config_uses_folder_name(tmp_path, tmp_path_factory):
    root, files = _folder_copy(tmp_path, tmp_path_factory, name="Qwen-Image-Edit-2511")
    (root / "transformer" / "config.json").unlink()
    info = detect_variant(files)
    assert info.name == "edit_2511"
    assert "no transformer config" in info.reason and "folder name 'Qwen-Image-Edit-2511'" in info.reason


@pytest.mark.parametrize(
    ("text", "variant"),
    [
        ("qwen_image_edit_2509_fp8_e4m3fn.safetensors", "edit_2509"),
        ("Qwen-Image-Edit-2511", "edit_2511"),
        ("qwen_image_edit_bf16.safetensors", "edit"),
        ("qwen_image_bf16.safetensors", None),
        ("model_125090.safetensors", None),
    ],
)
def test_variant_from_text(text, variant):
    assert variant_from_text(text) == variant
