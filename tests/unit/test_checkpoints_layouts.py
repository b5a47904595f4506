"""Layouts resolve and validate from headers only; broken folders fail naming the file."""

from __future__ import annotations

import json
import shutil

import pytest
from qwen_edit_hopper.qwen_edit.checkpoints import (
    CheckpointError,
    CheckpointKind,
    ModelFiles,
    read_index,
    resolve_diffusers_folder,
    resolve_single_files,
    validate_model_files,
)
from test_checkpoints_support import tiny


@pytest.fixture(scope="module")
def diffusers_files(tmp_path_factory):
    return tiny("diffusers", "edit_2509", tmp_path_factory)


@pytest.fixture(scope="module")
def comfy_files(tmp_path_factory):
    return tiny("comfy_single", "edit_2509", tmp_path_factory)


@pytest.fixture
def folder_copy(diffusers_files, tmp_path):
    target = tmp_path / "Qwen-Image-Edit-2509"
    shutil.copytree(diffusers_files["root"], target)
    return target


def test_diffusers_folder_resolves(diffusers_files):
    files = resolve_diffusers_folder(diffusers_files["root"])
    assert files.layout == "diffusers"
    assert [p.name for p in files.dit] == [
        "diffusion_pytorch_model-00001-of-00002.safetensors",
        "diffusion_pytorch_model-00002-of-00002.safetensors",
    ]
    assert [p.name for p in files.text_encoder] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert [p.name for p in files.vae] == ["diffusion_pytorch_model.safetensors"]
    assert files.processor_dir.name == "processor" and files.tokenizer_dir.name == "tokenizer"
    assert files.config_json("dit").name == "config.json"
    assert files == diffusers_files["files"]


def test_single_files_resolve(comfy_files):
    files = resolve_single_files(comfy_files["dit"][0], comfy_files["text_encoder_fp8"], comfy_files["vae"][0])
    assert files.layout == "single_files"
    assert files.root is None and files.processor_dir is None
    validated = validate_model_files(files)
    assert validated.kinds["text_encoder"].kind is CheckpointKind.TEXT_ENCODER_FP8_SCALED
    assert validated.kinds["vae"].kind is CheckpointKind.VAE_COMFY


def test_model_files_is_frozen_and_checked(comfy_files):
    files = comfy_files["files"]
    with pytest.raises(AttributeError):
        files.layout = "x"
    with pytest.raises(ValueError, match="at least one file"):
        ModelFiles(layout="single_files", dit=(), text_encoder=files.text_encoder, vae=files.vae)
    with pytest.raises(ValueError, match="layout must be"):
        ModelFiles(layout="zip", dit=files.dit, text_encoder=files.text_encoder, vae=files.vae)


def test_missing_shard_is_named(folder_copy):
    shard = folder_copy / "transformer" / "diffusion_pytorch_model-00002-of-00002.safetensors"
    shard.unlink()
    with pytest.raises(CheckpointError) as info:
        resolve_diffusers_folder(folder_copy)
    message = str(info.value)
    assert message.startswith("diffusion_pytorch_model-00002-of-00002.safetensors is missing")
    assert "diffusion_pytorch_model.safetensors.index.json lists it" in message
    assert "download this shard" in message


def test_truncated_shard_is_named(folder_copy):
    shard = folder_copy / "text_encoder" / "model-00001-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"^model-00001-of-00002\.safetensors is truncated"):
        resolve_diffusers_folder(folder_copy)


def test_corrupted_shard_header_is_named(folder_copy):
    shard = folder_copy / "transformer" / "diffusion_pytorch_model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\xff\xfe\x00{"
    shard.write_bytes(bytes(data))
    expected = r"^diffusion_pytorch_model-00001-of-00002\.safetensors has a corrupted header"
    with pytest.raises(CheckpointError, match=expected):
        resolve_diffusers_folder(folder_copy)


def test_index_assigning_a_key_to_the_wrong_shard(folder_copy):
    index_path = folder_copy / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    key = next(k for k, v in index["weight_map"].items() if v.endswith("00001-of-00002.safetensors"))
    index["weight_map"][key] = "diffusion_pytorch_model-00002-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    expected = r"lacks 1 tensors that diffusion_pytorch_model\.safetensors\.index\.json"
    with pytest.raises(CheckpointError, match=expected):
        read_index(index_path)


def test_missing_component_folder(folder_copy):
    shutil.rmtree(folder_copy / "vae")
    with pytest.raises(CheckpointError, match=r"^vae is missing: a diffusers model folder needs vae/"):
        resolve_diffusers_folder(folder_copy)


def test_pickle_only_folder_is_refused(folder_copy):
    for path in (folder_copy / "vae").glob("*.safetensors"):
        path.unlink()
    (folder_copy / "vae" / "diffusion_pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="pickles can run arbitrary code"):
        resolve_diffusers_folder(folder_copy)


def test_vae_in_transformer_folder_is_reported(folder_copy):
    for path in (folder_copy / "transformer").glob("*.safetensors*"):
        path.unlink()
    shutil.copy(folder_copy / "vae" / "diffusion_pytorch_model.safetensors", folder_copy / "transformer")
    expected = r"was chosen as the diffusion model .* holds a VAE \(diffusers layout\)"
    with pytest.raises(CheckpointError, match=expected):
        resolve_diffusers_folder(folder_copy)


def test_duplicate_key_across_shards(diffusers_files, comfy_files):
    files = ModelFiles(
        layout="single_files",
        dit=(comfy_files["dit"][0], comfy_files["dit"][0].with_name(comfy_files["dit"][0].name)),
        text_encoder=comfy_files["files"].text_encoder,
        vae=comfy_files["files"].vae,
    )
    with pytest.raises(CheckpointError, match="repeats tensor"):
        validate_model_files(files)
