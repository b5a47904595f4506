"""Damaged and hostile checkpoints for the tests, written from the tiny real ones.

Each writer takes a good file (or folder) and writes a copy with one defect: a NaN or Inf in a tensor,
an integer or boolean tensor where a weight belongs, missing or incomplete blocks, a config that
disagrees with the weights, an index that points outside its folder. The fp8 writers make the
Comfy-Org ``fp8_e4m3fn`` and ``fp8_scaled`` forms of a bf16 file, so each defect can be tried in
every layout the loader reads.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0  # largest float8_e4m3fn value
FP8_NAN_BYTE = 0x7F  # float8_e4m3fn NaN


def read(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def write(tensors: dict[str, torch.Tensor], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    return path


def edited(source: Path, target: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """``target`` = ``source`` with ``edit`` applied to its tensors (in place on the dict)."""
    tensors = read(source)
    edit(tensors)
    return write(tensors, target)


# ----------------------------------------------------------------------------- one defect, any file


def poison(tensors: dict[str, torch.Tensor], key: str, value: float = float("nan")) -> None:
    """Put one ``value`` (NaN, Inf) into tensor ``key``; an fp8 tensor gets its NaN byte."""
    tensor = tensors[key].clone()
    if tensor.element_size() == 1:
        tensor.view(torch.uint8).view(-1)[tensor.numel() // 2] = FP8_NAN_BYTE
    else:
        tensor.view(-1)[tensor.numel() // 2] = value
    tensors[key] = tensor


def as_dtype(tensors: dict[str, torch.Tensor], key: str, dtype: torch.dtype) -> None:
    """Store tensor ``key`` as ``dtype`` (e.g. int32 or bool), same shape."""
    tensors[key] = tensors[key].float().round().to(dtype)


def drop(tensors: dict[str, torch.Tensor], prefix: str) -> None:
    """Remove every tensor whose name starts with ``prefix``."""
    for key in [k for k in tensors if k.startswith(prefix)]:
        del tensors[key]


def scale(tensors: dict[str, torch.Tensor], key: str, value: float) -> None:
    """Fill tensor ``key`` with a finite ``value`` (e.g. 1e38: finite weights whose products overflow)."""
    tensors[key] = torch.full_like(tensors[key], value)


# ----------------------------------------------------------------------------- fp8 forms of a bf16 file


def _linear_weights(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, v in tensors.items() if k.endswith(".weight") and v.ndim == 2 and "embed_tokens" not in k]


def fp8_e4m3fn(source: Path, target: Path) -> Path:
    """Comfy-Org's ``*_fp8_e4m3fn`` form: Linear weights cast to float8_e4m3fn, no scales."""

    def cast(tensors: dict[str, torch.Tensor]) -> None:
        for key in _linear_weights(tensors):
            tensors[key] = tensors[key].float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)

    return edited(source, target, cast)


def fp8_scaled(source: Path, target: Path) -> Path:
    """ComfyUI's ``fp8_scaled`` form: float8_e4m3fn Linear weights, a float32 ``scale_weight`` each, the marker."""

    def quantize(tensors: dict[str, torch.Tensor]) -> None:
        for key in _linear_weights(tensors):
            weight = tensors[key].float()
            factor = weight.abs().amax().clamp(min=1e-12) / FP8_MAX
            tensors[key] = (weight / factor).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            tensors[key[: -len("weight")] + "scale_weight"] = factor.reshape(())
        tensors["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)

    return edited(source, target, quantize)


# ----------------------------------------------------------------------------- diffusers folders


def copy_folder(source: Path, target: Path) -> Path:
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target)
    return target


def index_path(folder: Path, part: str) -> Path:
    return next((folder / part).glob("*.safetensors.index.json"))


def shard_of(folder: Path, part: str, key: str) -> Path:
    """The shard of ``folder/part`` that holds ``key``, from its index."""
    weight_map = json.loads(index_path(folder, part).read_text())["weight_map"]
    return folder / part / weight_map[key]


def edit_shards(folder: Path, part: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Apply ``edit`` to every shard of ``folder/part`` and rewrite the index to what the shards hold."""
    index = index_path(folder, part)
    data = json.loads(index.read_text())
    weight_map = {}
    for shard in sorted({folder / part / name for name in data["weight_map"].values()}):
        tensors = read(shard)
        edit(tensors)
        write(tensors, shard)
        weight_map.update(dict.fromkeys(tensors, shard.name))
    data["weight_map"] = weight_map
    index.write_text(json.dumps(data, indent=2))


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data, indent=2))


def point_outside(folder: Path, part: str, how: str, outside_dir: Path) -> tuple[str, Path]:
    """Move one shard of ``folder/part`` out to ``outside_dir`` (still valid) and make the index reach it.

    ``how``: ``"relative"`` (``../..`` out of the folder), ``"absolute"``, or ``"link"`` (a link inside the
    folder resolving to the moved shard). Returns ``(entry written in the index, moved shard)``.
    """
    index = index_path(folder, part)
    data = json.loads(index.read_text())
    shard_name = sorted(set(data["weight_map"].values()))[-1]
    outside_dir.mkdir(parents=True, exist_ok=True)
    moved = outside_dir / shard_name
    shutil.move(folder / part / shard_name, moved)
    if how == "relative":
        entry = os.path.relpath(moved, folder / part)
    elif how == "absolute":
        entry = str(moved.resolve())
    elif how == "link":
        entry = "linked-" + shard_name
        (folder / part / entry).symlink_to(moved.resolve())
    else:
        raise ValueError(f"how must be relative, absolute or link, got {how!r}")
    data["weight_map"] = {k: (entry if v == shard_name else v) for k, v in data["weight_map"].items()}
    index.write_text(json.dumps(data, indent=2))
    return entry, moved


# ----------------------------------------------------------------------------- a released-width DiT, sparse


def sparse_released_dit(path: Path, blocks: int) -> Path:
    """A header-valid bf16 DiT at the released width (dim 3072) with ``blocks`` blocks; the data is a sparse hole.

    The released DiT has 60 blocks; a file with another count must be refused from its header, before any
    tensor is read, so the data region is never allocated on disk (``truncate`` makes a sparse file).
    """
    from qwen_edit_hopper.qwen_edit.checkpoints.dit import DiTConfig, create_dit

    config = DiTConfig(dim=3072, num_layers=blocks, num_heads=24, head_dim=128, text_dim=3584)
    shapes = {k: tuple(v.shape) for k, v in create_dit(config).state_dict(keep_vars=True).items()}
    header, offset = {}, 0
    for key in sorted(shapes):
        nbytes = 2 * int(torch.Size(shapes[key]).numel())
        header[key] = {"dtype": "BF16", "shape": list(shapes[key]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw)
        handle.truncate(8 + len(raw) + offset)
    return path
