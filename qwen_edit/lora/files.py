"""Reading LoRA files: .safetensors only, header checked before any tensor is read.

Pickle-based checkpoints (the suffixes of :data:`..checkpoints.safetensors_io.PICKLE_SUFFIXES`) are refused:
unpickling can run arbitrary code. The header is read and validated by the checkpoints' reader
(:func:`..checkpoints.safetensors_io.read_header`, the one safetensors header reader of the pack), so a
truncated or corrupted file gives an error naming the file instead of a crash deep inside safetensors; its
error is re-raised as :class:`.errors.LoraFileError`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..checkpoints.errors import CheckpointError
from ..checkpoints.integrity import FiniteCheck
from ..checkpoints.safetensors_io import PICKLE_SUFFIXES, SafetensorsHeader, read_header
from .errors import LoraFileError

__all__ = ["load_safetensors", "read_lora_header"]

logger = logging.getLogger(__name__)


def _refuse_suffix(path: Path) -> None:
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        return
    if suffix in PICKLE_SUFFIXES:
        raise LoraFileError(
            f"LoRA file {path}: '{suffix}' files are Python pickles, and loading a pickle can run "
            "arbitrary code; refused. Convert it to .safetensors (or get the .safetensors release)."
        )
    raise LoraFileError(f"LoRA file {path}: only .safetensors files are read (got '{suffix or 'no suffix'}').")


def _sniff_pickle(path: Path) -> None:
    with path.open("rb") as fh:
        head = fh.read(4)
    if head[:4] == b"PK\x03\x04" or (len(head) > 1 and head[0] == 0x80 and head[1] <= 5):
        raise LoraFileError(
            f"LoRA file {path}: this is a PyTorch pickle/zip checkpoint named .safetensors; "
            "loading a pickle can run arbitrary code, so it is refused."
        )


def read_lora_header(path: str | os.PathLike) -> SafetensorsHeader:
    """The validated safetensors header of a LoRA file, without reading tensor data.

    The LoRA checks (``.safetensors`` suffix, present, not a pickle under a safetensors name) come first, then
    :func:`..checkpoints.safetensors_io.read_header` validates the header against the file size.
    Raises LoraFileError naming the file for a wrong suffix, a pickle, a missing
    file, or a header that is not valid or does not fit the file size.
    """
    path = Path(path)
    _refuse_suffix(path)
    if not path.is_file():
        raise LoraFileError(f"LoRA file {path}: not found.")
    _sniff_pickle(path)
    try:
        return read_header(path)
    except CheckpointError as exc:
        raise LoraFileError(f"LoRA file {path}: {exc.problem} {exc.remedy}") from None


def load_safetensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], Mapping[str, str]]:
    """Load every tensor of a .safetensors LoRA file onto the CPU, in its stored dtype, checked finite.

    Returns ``(tensors, metadata)``. The header is validated first (see
    :func:`read_lora_header`); errors from safetensors itself are re-raised as
    LoraFileError naming the file. Every floating tensor is checked for NaN and
    Inf as it is read (:class:`~..checkpoints.integrity.FiniteCheck`, one pass
    over the file's data): a LoRA holding them would turn every image black.
    """
    path = Path(path)
    header = read_lora_header(path)
    entries, metadata = header.tensors, dict(header.metadata)
    tensors: dict[str, torch.Tensor] = {}
    check = FiniteCheck()
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open handles are not mappings
                tensors[key] = fh.get_tensor(key)
                check.add(key, tensors[key])
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise LoraFileError(f"LoRA file {path}: safetensors could not read it: {exc}") from exc
    logger.debug("read %d tensors from %s", len(tensors), path)
    if len(tensors) != len(entries):
        raise LoraFileError(f"LoRA file {path}: header lists {len(entries)} tensors, {len(tensors)} were read.")
    bad = check.nonfinite()
    if bad:
        tensors.clear()
        shown = ", ".join(f"'{key}'" for key in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise LoraFileError(
            f"LoRA file {path}: {len(bad)} of its tensors hold NaN or Inf values ({shown}); fused, they would "
            "turn every image black. The file is damaged or was trained into a divergence: download it again, "
            "or use another LoRA."
        )
    return tensors, metadata
