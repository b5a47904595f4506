"""A model folder's index (and links) may only name files inside that folder; nothing outside is opened."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from qwen_edit_hopper.qwen_edit.checkpoints import CheckpointError, resolve_diffusers_folder
from qwen_edit_hopper.qwen_edit.checkpoints import layouts as layouts_module
from qwen_edit_hopper.qwen_edit.checkpoints.contained import resolve_inside
from test_checkpoints_support import tiny

SHARD = "diffusion_pytorch_model-00002-of-00002.safetensors"
INDEX = "diffusion_pytorch_model.safetensors.index.json"


@pytest.fixture
def setup(tmp_path, tmp_path_factory):
    """A copy of the tiny diffusers folder, and a valid copy of one of its shards outside it."""
    source = tiny("diffusers", "edit_2509", tmp_path_factory)["root"]
    folder = tmp_path / "models" / "Qwen-Image-Edit-2509"
    shutil.copytree(source, folder)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(folder / "transformer" / SHARD, outside / SHARD)
    return folder, outside / SHARD


@pytest.fixture
def opened(monkeypatch):
    """Every path whose safetensors header is read from here on."""
    seen: list[Path] = []
    real = layouts_module.read_header

    def recording(path):
        seen.append(Path(path).resolve())
        return real(path)

    monkeypatch.setattr(layouts_module, "read_header", recording)
    return seen


def _point_index(folder: Path, entry: str, part: str = "transformer", index: str = INDEX, shard: str = SHARD):
    index_path = folder / part / index
    data = json.loads(index_path.read_text())
    data["weight_map"] = {k: (entry if v == shard else v) for k, v in data["weight_map"].items()}
    index_path.write_text(json.dumps(data))
    (folder / part / shard).unlink()


def _refused(folder: Path, opened: list[Path], outside: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        resolve_diffusers_folder(folder)
    assert outside.resolve() not in opened
    return str(info.value)


def test_relative_path_climbing_out_is_refused(setup, opened):
    folder, outside = setup
    entry = os.path.relpath(outside, folder / "transformer")
    assert entry.startswith("..")
    _point_index(folder, entry)
    message = _refused(folder, opened, outside)
    assert message.startswith(f"{INDEX} names {entry!r}, which climbs out of its folder transformer/ with '..'")
    assert "only name files inside itself" in message and "Download the model folder again" in message


def test_dot_dot_that_comes_back_inside_is_fine(setup, opened):
    folder, outside = setup
    _point_index(folder, f"../transformer/{SHARD}")
    shutil.copy(outside, folder / "transformer" / SHARD)
    resolve_diffusers_folder(folder)


def test_absolute_path_is_refused(setup, opened):
    folder, outside = setup
    _point_index(folder, str(outside))
    message = _refused(folder, opened, outside)
    assert f"names {str(outside)!r}, an absolute path outside its folder transformer/" in message


def test_link_resolving_outside_is_refused(setup, opened):
    folder, outside = setup
    _point_index(folder, "linked.safetensors")
    (folder / "transformer" / "linked.safetensors").symlink_to(outside)
    message = _refused(folder, opened, outside)
    assert f"names 'linked.safetensors', which is a link to {outside.resolve()}, outside its folder" in message


def test_link_inside_the_folder_is_fine(setup):
    folder, _ = setup
    te = folder / "text_encoder"
    shutil.copy(te / "model-00002-of-00002.safetensors", te / "real.safetensors")
    _point_index(folder, "linked.safetensors", part="text_encoder", index="model.safetensors.index.json",
                 shard="model-00002-of-00002.safetensors")
    (te / "linked.safetensors").symlink_to("real.safetensors")
    assert te / "linked.safetensors" in resolve_diffusers_folder(folder).text_encoder


def test_text_encoder_index_is_checked_too(setup, opened):
    folder, _ = setup
    te = folder / "text_encoder"
    outside = folder.parent.parent / "te_shard.safetensors"
    shutil.copy(te / "model-00002-of-00002.safetensors", outside)
    _point_index(folder, str(outside), part="text_encoder", index="model.safetensors.index.json",
                 shard="model-00002-of-00002.safetensors")
    message = _refused(folder, opened, outside)
    assert message.startswith("model.safetensors.index.json names") and "absolute path" in message


def test_single_file_linked_from_outside_is_refused(setup, opened):
    folder, _ = setup
    vae = folder / "vae" / "diffusion_pytorch_model.safetensors"
    target = folder.parent.parent / "vae_outside.safetensors"
    shutil.move(vae, target)
    vae.symlink_to(target)
    message = _refused(folder, opened, target)
    assert "which is a link to" in message and "outside its folder vae/" in message


def test_config_json_linked_from_outside_is_refused(setup):
    folder, _ = setup
    config = folder / "transformer" / "config.json"
    target = folder.parent.parent / "config.json"
    shutil.move(config, target)
    config.symlink_to(target)
    with pytest.raises(CheckpointError, match=r"names 'config\.json', which is a link to"):
        resolve_diffusers_folder(folder)


def test_a_linked_component_folder_keeps_its_own_files(setup):
    """Sharing text_encoder/ between model folders by one link is fine: its index names files beside it."""
    folder, _ = setup
    shared = folder.parent.parent / "shared_text_encoder"
    shutil.move(folder / "text_encoder", shared)
    (folder / "text_encoder").symlink_to(shared, target_is_directory=True)
    assert resolve_diffusers_folder(folder).text_encoder[0].parent == folder / "text_encoder"


@pytest.mark.parametrize("entry", [None, 3, "", "a\x00b"])
def test_entries_that_are_not_file_names(tmp_path, entry):
    with pytest.raises(CheckpointError, match="which is not a file name"):
        resolve_inside(tmp_path, entry, named_by=tmp_path / "x.index.json")


def test_the_folder_itself_is_not_a_file(tmp_path):
    with pytest.raises(CheckpointError, match="climbs out"):
        resolve_inside(tmp_path, ".", named_by=tmp_path / "x.index.json")
