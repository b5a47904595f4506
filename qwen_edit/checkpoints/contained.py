"""Paths named inside a model folder must stay inside it.

A diffusers / ModelScope folder names files in its own JSON (``*.safetensors.index.json`` maps each
tensor to a shard) and may hold links. A downloaded folder must never make the pack read a file the
user did not choose, so every such name is resolved the way ComfyUI's own folder checks do, after
``..`` and links, and refused unless it lands inside the folder that names it, before it is opened.

Pure Python: no torch.
"""

from __future__ import annotations

import os
from pathlib import Path

from .safetensors_io import CheckpointError

OUTSIDE_REMEDY = (
    "A model folder may only name files inside itself, so this file is not opened. Download the model folder "
    "again from its source (files downloaded as links into a cache: download with --local-dir, or copy the "
    "files in, so the folder holds the files themselves)."
)


def resolve_inside(folder: Path, entry: object, *, named_by: Path) -> Path:
    """The path ``entry`` names relative to ``folder``, refused unless it stays inside ``folder``.

    Args:
        folder: the folder the names are relative to (links in its own path are fine).
        entry: the name as stored, e.g. ``"diffusion_pytorch_model-00001-of-00005.safetensors"``.
        named_by: the file that holds the name (the index file), or the path itself; named in errors.

    Returns:
        ``folder / entry`` (not yet checked to exist).

    Raises:
        CheckpointError: ``entry`` is not a non-empty string, is absolute, climbs out with ``..``, or
            resolves through a link to somewhere outside ``folder``.
    """
    if not isinstance(entry, str) or not entry or "\x00" in entry:
        raise CheckpointError(named_by, f"names {entry!r}, which is not a file name.", OUTSIDE_REMEDY)
    if os.path.isabs(entry) or Path(entry).is_absolute():
        raise CheckpointError(
            named_by, f"names {entry!r}, an absolute path outside its folder {folder.name}/.", OUTSIDE_REMEDY
        )
    path = folder / entry
    root = Path(os.path.abspath(folder))
    if not _within(Path(os.path.normpath(root / entry)), root):
        raise CheckpointError(
            named_by, f"names {entry!r}, which climbs out of its folder {folder.name}/ with '..'.", OUTSIDE_REMEDY
        )
    try:
        real_root, real = root.resolve(), path.resolve()
    except (OSError, RuntimeError) as exc:  # a link loop
        raise CheckpointError(named_by, f"names {entry!r}, which cannot be resolved ({exc}).", OUTSIDE_REMEDY) from exc
    if not _within(real, real_root):
        raise CheckpointError(
            named_by,
            f"names {entry!r}, which is a link to {real}, outside its folder {folder.name}/.",
            OUTSIDE_REMEDY,
        )
    return path


def _within(path: Path, folder: Path) -> bool:
    return path != folder and path.is_relative_to(folder)
