"""Read safetensors headers without loading tensors, and load tensors safely.

A safetensors file is ``[8-byte little-endian header length N][N bytes of JSON][tensor data]``.
The JSON maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the start of the data block) plus an optional
``"__metadata__"`` dict of strings. :func:`read_header` checks all of that against
the file size, so a truncated download or a corrupted header fails here, with
the file named, before any tensor is read.

Only ``.safetensors`` (or ComfyUI's ``.sft``) files are accepted: pickled checkpoints (``.ckpt``, ``.pt``,
``.pth``, ``.bin``) can run code when loaded and are refused.

This module imports neither torch nor DiffSynth at import time.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CheckpointError

logger = logging.getLogger(__name__)

SAFETENSORS_SUFFIXES = (".safetensors", ".sft")  # ComfyUI also reads ".sft" as safetensors
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pt2", ".pth", ".bin", ".pkl", ".pickle")
"""Suffixes of pickled PyTorch checkpoints: every loader and node refuses them by name (the one list of the pack)."""

# safetensors refuses headers above 100 MB; anything larger is not a safetensors file.
MAX_HEADER_BYTES = 100_000_000

#: Bytes per element of each safetensors dtype name.
DTYPE_SIZES: Mapping[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}

FLOAT8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})


@dataclass(frozen=True)
class TensorInfo:
    """One tensor entry of a safetensors header.

    Attributes:
        dtype: safetensors dtype name, e.g. ``"BF16"``, ``"F8_E4M3"``.
        shape: tensor shape.
        data_offsets: ``(begin, end)`` byte offsets inside the data block.
    """

    dtype: str
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.data_offsets[1] - self.data_offsets[0]


@dataclass(frozen=True)
class SafetensorsHeader:
    """The validated header of one safetensors file (no tensor data).

    Attributes:
        path: the file.
        tensors: tensor name -> :class:`TensorInfo`, in header order.
        metadata: the ``__metadata__`` string dict (empty if absent).
        file_size: size of the file in bytes.
    """

    path: Path
    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str]
    file_size: int

    @property
    def keys(self) -> frozenset[str]:
        return frozenset(self.tensors)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: info.shape for name, info in self.tensors.items()}

    def dtypes(self) -> dict[str, str]:
        return {name: info.dtype for name, info in self.tensors.items()}


def check_suffix(path: Path | str) -> Path:
    """Refuse anything that is not a ``.safetensors`` (or ``.sft``) file, by name.

    Raises:
        CheckpointError: pickled checkpoints (``.ckpt``/``.pt``/``.pth``/``.bin``...)
            and unknown suffixes.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in SAFETENSORS_SUFFIXES:
        return path
    if suffix in PICKLE_SUFFIXES:
        raise CheckpointError(
            path,
            f"is a pickled PyTorch checkpoint ({suffix}); pickles can run arbitrary code when loaded, "
            "so this loader never opens them.",
            "Convert it to .safetensors (for example with safetensors.torch.save_file on a machine you "
            "trust) or download the .safetensors release of the same model.",
        )
    raise CheckpointError(
        path,
        f"has the suffix {suffix or '(none)'!r}; only .safetensors files are loaded.",
        "Pick the .safetensors file of this model.",
    )


def read_header(path: Path | str) -> SafetensorsHeader:
    """Read and validate a safetensors header without reading tensor data.

    Checks: the suffix, the 8-byte length prefix, that the header fits in the
    file, that it is a JSON object, and for every tensor that the dtype is known,
    the shape is a list of non-negative ints, ``end - begin == numel * itemsize``,
    tensors do not overlap and the data block ends exactly at the end of the file.

    Raises:
        CheckpointError: missing file, truncated file, corrupted header, not a
            safetensors file. The message names the file and the remedy.
    """
    path = check_suffix(path)
    if not path.is_file():
        raise CheckpointError(
            path, "does not exist or is not a file.", "Check the path, or put the file in the models folder."
        )
    file_size = path.stat().st_size
    redownload = "Download or copy the file again; compare its size with the source."
    if file_size < 8:
        raise CheckpointError(path, f"is truncated: only {file_size} bytes, not even a header length.", redownload)
    with path.open("rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
            raise CheckpointError(
                path,
                f"has a corrupted header: it claims {header_len} header bytes but the file has {file_size} bytes "
                "(it is truncated, or is not a safetensors file at all, e.g. a renamed pickle).",
                redownload,
            )
        raw = handle.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, f"has a corrupted header: its JSON does not parse ({exc}).", redownload) from exc
    if not isinstance(header, dict):
        raise CheckpointError(path, "has a corrupted header: it is not a JSON object.", redownload)

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(path, "has a corrupted header: __metadata__ is not a dict of strings.", redownload)

    data_size = file_size - 8 - header_len
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        tensors[name] = _parse_entry(path, name, entry, redownload)

    end = 0
    for name, info in sorted(tensors.items(), key=lambda item: item[1].data_offsets):
        begin = info.data_offsets[0]
        if begin < end:
            raise CheckpointError(
                path, f"has a corrupted header: tensor {name!r} overlaps the previous one.", redownload
            )
        end = info.data_offsets[1]
    if end > data_size:
        raise CheckpointError(
            path,
            f"is truncated: its tensors need {end} data bytes but only {data_size} are present "
            f"(file is {file_size} bytes, expected {8 + header_len + end}).",
            redownload,
        )
    if end < data_size:
        raise CheckpointError(
            path,
            f"is corrupted: {data_size - end} unexpected bytes follow the last tensor.",
            redownload,
        )
    return SafetensorsHeader(path=path, tensors=tensors, metadata=dict(metadata), file_size=file_size)


def _parse_entry(path: Path, name: str, entry: Any, redownload: str) -> TensorInfo:
    def bad(why: str) -> CheckpointError:
        return CheckpointError(path, f"has a corrupted header: tensor {name!r} {why}.", redownload)

    if not isinstance(entry, dict):
        raise bad("is not described by a JSON object")
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise bad(f"has an unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise bad(f"has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise bad(f"has invalid data_offsets {offsets!r}")
    info = TensorInfo(dtype=dtype, shape=tuple(shape), data_offsets=(offsets[0], offsets[1]))
    if info.nbytes != info.numel * DTYPE_SIZES[dtype]:
        raise bad(f"spans {info.nbytes} bytes but {dtype}{list(shape)} needs {info.numel * DTYPE_SIZES[dtype]}")
    return info


def load_tensors(
    path: Path | str,
    *,
    device: Any = "cpu",
    keys: Iterable[str] | None = None,
) -> dict[str, Any]:
    """Load tensors of one safetensors file with ``safetensors.safe_open`` (never pickle), checked.

    Every checkpoint tensor of this pack is read here, so every loader gets the same checks
    (:mod:`.integrity`): before any tensor is read, the wanted tensors' dtypes must be floating-point;
    as they arrive on ``device``, each is checked for NaN/Inf there, with one host synchronization per
    call at the end.

    Args:
        path: the file; its header should already have been validated with :func:`read_header`.
        device: where the tensors land (``"cpu"``, ``"cuda:0"``, a ``torch.device``).
        keys: load only these names (all if None).

    Returns:
        name -> ``torch.Tensor`` in the file's own dtype, all finite.

    Raises:
        CheckpointError: the file cannot be opened or read by safetensors, a wanted tensor is an
            integer or boolean one, or a wanted tensor holds NaN or Inf. Nothing read stays referenced.
    """
    from safetensors import SafetensorError, safe_open

    from .integrity import FiniteCheck, check_float_dtypes, raise_if_nonfinite

    path = check_suffix(path)
    tensors: dict[str, Any] = {}
    check = FiniteCheck()
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as handle:
            names = list(handle.keys()) if keys is None else list(keys)
            check_float_dtypes({name: handle.get_slice(name).get_dtype() for name in names}, source=path)
            for name in names:
                tensors[name] = handle.get_tensor(name)
                check.add(name, tensors[name])
        raise_if_nonfinite(check, source=path)
    except (OSError, SafetensorError) as exc:
        tensors.clear()
        raise CheckpointError(
            path, f"could not be read by safetensors ({exc}).", "Download or copy the file again."
        ) from exc
    except BaseException:
        tensors.clear()
        raise
    return tensors
