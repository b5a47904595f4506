"""Where a model's files are, checked from headers only, before any tensor is loaded.

Two layouts load through the same code:

* ``"diffusers"``: a diffusers / ModelScope folder with ``transformer/``,
  ``text_encoder/``, ``vae/`` (each one file, or shards plus a
  ``*.safetensors.index.json``), ``processor/`` and ``tokenizer/``,
  ``model_index.json``.
* ``"single_files"``: three files picked one by one (e.g. Comfy-Org's
  ``qwen_image_edit_2509_bf16.safetensors``, ``qwen_2.5_vl_7b[_fp8_scaled].safetensors``,
  ``qwen_image_vae.safetensors``).

:func:`validate_model_files` reads every header, checks shards against their
index and checks that each part holds what its slot expects.

Pure Python: no torch, no DiffSynth.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .classify import Classification, expect_slot
from .contained import resolve_inside
from .integrity import check_float_dtypes
from .safetensors_io import PICKLE_SUFFIXES, CheckpointError, SafetensorsHeader, check_suffix, read_header

logger = logging.getLogger(__name__)

PARTS = ("dit", "text_encoder", "vae")

#: diffusers sub-folder of each part.
PART_FOLDERS: Mapping[str, str] = {"dit": "transformer", "text_encoder": "text_encoder", "vae": "vae"}

LAYOUT_DIFFUSERS = "diffusers"
LAYOUT_SINGLE_FILES = "single_files"


@dataclass(frozen=True)
class ModelFiles:
    """The files of one Qwen-Image-Edit model (paths only; nothing is opened here).

    Attributes:
        layout: ``"diffusers"`` or ``"single_files"``.
        dit: DiT shard paths (one or more ``.safetensors``).
        text_encoder: text encoder shard paths.
        vae: VAE shard paths (in practice one file).
        processor_dir: a ``processor/`` folder (Qwen2VLProcessor files), if any.
        tokenizer_dir: a ``tokenizer/`` folder, if any.
        root: the diffusers folder (for ``model_index.json`` and ``*/config.json``); None for single files.
    """

    layout: str
    dit: tuple[Path, ...]
    text_encoder: tuple[Path, ...]
    vae: tuple[Path, ...]
    processor_dir: Path | None = None
    tokenizer_dir: Path | None = None
    root: Path | None = None

    def __post_init__(self) -> None:
        if self.layout not in (LAYOUT_DIFFUSERS, LAYOUT_SINGLE_FILES):
            raise ValueError(f"layout must be {LAYOUT_DIFFUSERS!r} or {LAYOUT_SINGLE_FILES!r}, got {self.layout!r}")
        for part in PARTS:
            value = getattr(self, part)
            paths = (Path(value),) if isinstance(value, (str, Path)) else tuple(Path(p) for p in value)
            if not paths:
                raise ValueError(f"ModelFiles.{part} needs at least one file")
            object.__setattr__(self, part, paths)
        for name in ("processor_dir", "tokenizer_dir", "root"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value))

    def part(self, name: str) -> tuple[Path, ...]:
        """The shard paths of ``"dit"``, ``"text_encoder"`` or ``"vae"``."""
        if name not in PARTS:
            raise ValueError(f"unknown part {name!r}; expected one of {PARTS}")
        return getattr(self, name)

    def config_json(self, name: str) -> Path | None:
        """``<root>/<folder>/config.json`` of a part in a diffusers folder, if present."""
        if self.root is None:
            return None
        path = self.root / PART_FOLDERS[name] / "config.json"
        return path if path.is_file() else None

    def source(self, name: str) -> Path:
        """The path to name in messages about a part: its file, or its folder when sharded."""
        paths = self.part(name)
        if len(paths) == 1:
            return paths[0]
        return self.root / PART_FOLDERS[name] if self.root is not None else paths[0].parent


@dataclass(frozen=True)
class ValidatedFiles:
    """Headers and classification of every part, produced by :func:`validate_model_files`.

    Attributes:
        files: the validated :class:`ModelFiles`.
        headers: part -> headers of its shards (same order as the paths).
        kinds: part -> what the part holds.
    """

    files: ModelFiles
    headers: Mapping[str, tuple[SafetensorsHeader, ...]] = field(default_factory=dict)
    kinds: Mapping[str, Classification] = field(default_factory=dict)

    def shapes(self, part: str) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape over all shards of ``part``."""
        out: dict[str, tuple[int, ...]] = {}
        for header in self.headers[part]:
            out.update(header.shapes())
        return out


def read_json(path: Path | None) -> dict | None:
    """A JSON object from ``path``; None if ``path`` is None, missing or not an object.

    Raises:
        CheckpointError: the file exists but is not valid JSON.
    """
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, f"could not be read as JSON ({exc}).", "Download the model folder again.") from exc
    return data if isinstance(data, dict) else None


def read_index(index_path: Path) -> tuple[SafetensorsHeader, ...]:
    """Validate a ``*.safetensors.index.json`` and the shards it lists, from headers only.

    Every shard named in ``weight_map`` must lie inside the index's folder (after ``..`` and links are
    resolved; checked for all entries before any shard is opened), exist and have a valid header, and
    every key must be in the shard the index assigns it to.

    Returns:
        The headers of the shards, sorted by file name.

    Raises:
        CheckpointError: unreadable index, a shard outside the folder (absolute, ``..``, a link out),
            missing shard (named), truncated or corrupted shard, key missing from its shard.
    """
    index_path = Path(index_path)
    index = read_json(index_path)
    weight_map = index.get("weight_map") if index is not None else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(index_path, "has no weight_map.", "Download the model folder again.")

    by_shard: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        if not isinstance(shard, str):
            resolve_inside(index_path.parent, shard, named_by=index_path)  # raises: not a file name
        by_shard.setdefault(shard, []).append(key)
    for shard in by_shard:
        resolve_inside(index_path.parent, shard, named_by=index_path)

    headers = []
    for shard in sorted(by_shard):
        shard_path = index_path.parent / shard
        if not shard_path.is_file():
            raise CheckpointError(
                shard_path,
                f"is missing: {index_path.name} lists it as one of {len(by_shard)} shards.",
                "The download is incomplete; download this shard (or the whole folder) again.",
            )
        header = read_header(shard_path)
        missing = [k for k in by_shard[shard] if k not in header.tensors]
        if missing:
            raise CheckpointError(
                shard_path,
                f"lacks {len(missing)} tensors that {index_path.name} assigns to it (e.g. {missing[0]!r}).",
                "The shard and the index come from different downloads; download the folder again.",
            )
        headers.append(header)
    return tuple(headers)


def _resolve_component(folder: Path, part: str) -> tuple[Path, ...]:
    if not folder.is_dir():
        raise CheckpointError(
            folder,
            f"is missing: a diffusers model folder needs {PART_FOLDERS[part]}/ for {part}.",
            "Download the complete model folder (transformer/, text_encoder/, vae/, processor/, tokenizer/).",
        )
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise CheckpointError(
            folder, f"has {len(indexes)} index files; expected one.", "Remove the stale index file(s)."
        )
    if indexes:
        return tuple(h.path for h in read_index(resolve_inside(folder, indexes[0].name, named_by=folder)))
    files = sorted(folder.glob("*.safetensors"))
    if len(files) == 1:
        return (resolve_inside(folder, files[0].name, named_by=folder),)
    if len(files) > 1:
        raise CheckpointError(
            folder,
            f"has {len(files)} .safetensors files but no *.safetensors.index.json saying how they fit together.",
            "Download the index json too, or keep only the single-file checkpoint.",
        )
    pickles = sorted(p for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        check_suffix(pickles[0])  # raises the "pickles can run code" error
    raise CheckpointError(
        folder, "holds no .safetensors file.", "Download the .safetensors weights of this model folder."
    )


def resolve_diffusers_folder(root: Path | str) -> ModelFiles:
    """Find and validate the files of a diffusers / ModelScope model folder.

    Every file it will read (index files, shards, ``config.json``, ``model_index.json``) must resolve
    inside the folder that holds or names it (:func:`~.contained.resolve_inside`).

    Raises:
        CheckpointError: missing sub-folder, missing or broken shard, a file outside its folder, wrong content.
    """
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(root, "is not a folder.", "Pick the model folder that holds transformer/, vae/ ...")
    parts = {part: _resolve_component(root / folder, part) for part, folder in PART_FOLDERS.items()}
    for json_file in (root / "model_index.json", *(root / folder / "config.json" for folder in PART_FOLDERS.values())):
        if json_file.exists() or json_file.is_symlink():
            resolve_inside(json_file.parent, json_file.name, named_by=json_file.parent)
    processor_dir = root / "processor"
    tokenizer_dir = root / "tokenizer"
    files = ModelFiles(
        layout=LAYOUT_DIFFUSERS,
        processor_dir=processor_dir if processor_dir.is_dir() else None,
        tokenizer_dir=tokenizer_dir if tokenizer_dir.is_dir() else None,
        root=root,
        **parts,
    )
    validate_model_files(files)
    return files


def resolve_single_files(
    dit: Path | str,
    text_encoder: Path | str,
    vae: Path | str,
    *,
    processor_dir: Path | str | None = None,
    tokenizer_dir: Path | str | None = None,
) -> ModelFiles:
    """Validate three single files (DiT, text encoder, VAE) and return their :class:`ModelFiles`.

    Raises:
        CheckpointError: a file is missing, broken, pickled, or holds another part
            (e.g. a VAE chosen as the DiT).
    """
    files = ModelFiles(
        layout=LAYOUT_SINGLE_FILES,
        dit=(Path(dit),),
        text_encoder=(Path(text_encoder),),
        vae=(Path(vae),),
        processor_dir=Path(processor_dir) if processor_dir is not None else None,
        tokenizer_dir=Path(tokenizer_dir) if tokenizer_dir is not None else None,
    )
    validate_model_files(files)
    return files


def validate_part(files: ModelFiles, part: str) -> tuple[tuple[SafetensorsHeader, ...], Classification]:
    """Read the headers of one part and check it holds what its slot expects.

    Raises:
        CheckpointError: broken header, an integer or boolean tensor, a key in two shards, or the wrong
            kind of model.
    """
    headers = tuple(read_header(p) for p in files.part(part))
    seen: dict[str, Path] = {}
    for header in headers:
        for key in header.tensors:
            if key in seen:
                raise CheckpointError(
                    header.path,
                    f"repeats tensor {key!r}, which {seen[key].name} also holds.",
                    "Shards of one model never overlap; remove the stray file or download again.",
                )
            seen[key] = header.path
    kind = expect_slot(headers, part, source=files.source(part))
    for header in headers:
        check_float_dtypes(header.dtypes(), source=header.path)
    return headers, kind


def validate_model_files(files: ModelFiles, parts: tuple[str, ...] = PARTS) -> ValidatedFiles:
    """Validate the headers of ``parts`` (all by default) before any tensor is loaded.

    Returns:
        The headers and classification of each part.

    Raises:
        CheckpointError: the first problem found, naming its file.
    """
    headers: dict[str, tuple[SafetensorsHeader, ...]] = {}
    kinds: dict[str, Classification] = {}
    for part in parts:
        headers[part], kinds[part] = validate_part(files, part)
        logger.debug("%s: %s (%s)", part, kinds[part].kind.value, kinds[part].reason)
    return ValidatedFiles(files=files, headers=headers, kinds=kinds)
