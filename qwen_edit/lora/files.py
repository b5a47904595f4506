"""Reading LoRA files: .safetensors only, header checked before any tensor is read.

Pickle-based checkpoints (.ckpt, .pt, .pth, .bin, .pkl) are refused: unpickling
can run arbitrary code. The header (8-byte little-endian length + JSON) is
validated against the file size first, so a truncated or corrupted file gives
an error naming the file instead of a crash deep inside safetensors.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..checkpoints.integrity import FiniteCheck
from .errors import LoraFileError

__all__ = ["PICKLE_SUFFIXES", "load_safetensors", "read_header"]

logger = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle")
_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


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


def _sniff_pickle(path: Path, head: bytes) -> None:
    if head[:4] == b"PK\x03\x04" or (len(head) > 1 and head[0] == 0x80 and head[1] <= 5):
        raise LoraFileError(
            f"LoRA file {path}: this is a PyTorch pickle/zip checkpoint named .safetensors; "
            "loading a pickle can run arbitrary code, so it is refused."
        )


def read_header(path: str | os.PathLike) -> tuple[dict[str, dict], dict[str, str]]:
    """Read and validate a safetensors header without reading tensor data.

    Returns ``(entries, metadata)``: ``entries`` maps tensor name to its header
    entry (``dtype``, ``shape``, ``data_offsets``); ``metadata`` is the optional
    ``__metadata__`` string map ({} when absent).
    Raises LoraFileError naming the file for a wrong suffix, a pickle, a missing
    file, or a header that is not valid or does not fit the file size.
    """
    path = Path(path)
    _refuse_suffix(path)
    if not path.is_file():
        raise LoraFileError(f"LoRA file {path}: not found.")
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        _sniff_pickle(path, head)
        if len(head) < 8:
            raise LoraFileError(f"LoRA file {path}: corrupted safetensors file ({size} bytes, shorter than a header).")
        (n,) = struct.unpack("<Q", head)
        if n == 0 or n > _MAX_HEADER or 8 + n > size:
            raise LoraFileError(
                f"LoRA file {path}: corrupted safetensors header (declares {n} header bytes, file has {size})."
            )
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraFileError(f"LoRA file {path}: corrupted safetensors header (not JSON: {exc}).") from None
    if not isinstance(header, dict):
        raise LoraFileError(f"LoRA file {path}: corrupted safetensors header (not a JSON object).")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise LoraFileError(f"LoRA file {path}: corrupted safetensors header (__metadata__ is not a map).")
    data_size = size - 8 - n
    for name, entry in header.items():
        _check_entry(path, name, entry, data_size)
    return header, {str(k): str(v) for k, v in metadata.items()}


def _check_entry(path: Path, name: str, entry: object, data_size: int) -> None:
    bad = f"LoRA file {path}: corrupted safetensors header at tensor '{name}'"
    if not isinstance(entry, dict) or entry.get("dtype") not in _ITEMSIZE:
        raise LoraFileError(f"{bad} (unknown entry or dtype: {entry!r:.120}).")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise LoraFileError(f"{bad} (bad shape {shape!r}).")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise LoraFileError(f"{bad} (bad data_offsets {offsets!r}).")
    start, end = offsets
    nbytes = math.prod(shape) * _ITEMSIZE[entry["dtype"]]
    if not 0 <= start <= end <= data_size or end - start != nbytes:
        raise LoraFileError(
            f"{bad} (data_offsets {offsets} for shape {shape} {entry['dtype']} do not fit the "
            f"{data_size} data bytes: truncated or corrupted file)."
        )


def load_safetensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], Mapping[str, str]]:
    """Load every tensor of a .safetensors LoRA file onto the CPU, in its stored dtype, checked finite.

    Returns ``(tensors, metadata)``. The header is validated first (see
    :func:`read_header`); errors from safetensors itself are re-raised as
    LoraFileError naming the file. Every floating tensor is checked for NaN and
    Inf as it is read (:class:`~..checkpoints.integrity.FiniteCheck`, one pass
    over the file's data): a LoRA holding them would turn every image black.
    """
    path = Path(path)
    entries, metadata = read_header(path)
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
