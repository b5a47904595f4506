"""Every weight of a checkpoint is floating-point and finite, checked as the tensors are read.

A NaN or Inf in one tensor of a DiT, text encoder, VAE or LoRA turns every image into a black or
constant one without any error, and an integer or boolean tensor where a weight belongs fails deep
inside torch ("Only Tensors of floating point dtype can require gradients"). Both are refused here,
naming the file and the tensors.

* :func:`check_float_dtypes` works from header dtype names only (``"BF16"``, ``"I64"``...), before
  any tensor is read.
* :class:`FiniteCheck` runs on the device the tensors were read onto, as they arrive: one reduction
  kernel per tensor (``torch.aminmax``: NaN propagates to both ends, an Inf is an end), its two scalars
  kept on the device; :meth:`FiniteCheck.nonfinite` synchronizes once for the whole set and looks up
  which tensors failed only when one did. ``aminmax`` reads each tensor once and writes nothing else,
  so the check costs one read of the weights. On a CPU it runs at about 8 G bf16 elements/s per thread,
  where ``torch.isfinite(t).all()`` (which writes a bool tensor first) manages about 0.2 G. 1-byte
  float8 tensors, which ``aminmax`` does not take, are tested on their bit patterns (an OR and an
  ``amax``: a NaN/Inf byte has all exponent bits set).
* :func:`check_finite` wraps it: tensors in, :class:`CheckpointError` out.

No preset or option turns these checks off. torch is imported on first use, so the header check
stays importable from pure-Python modules.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import CheckpointError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_SHOW = 5

#: safetensors dtype names of tensors that cannot be weights of these models.
NON_FLOAT_DTYPES = frozenset({"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "C64"})

#: float8 formats: OR-ing this mask into a byte gives 0xFF exactly when the byte is NaN or Inf.
#: e4m3fn: NaN is S.1111.111 (no Inf); e5m2: Inf/NaN have exponent 11111; e8m0: NaN is 0xFF.
_FLOAT8_NONFINITE_MASKS = (("float8_e4m3fn", 0x80), ("float8_e5m2", 0x83), ("float8_e8m0fnu", 0x00))


@functools.cache
def _float8_masks() -> dict[torch.dtype, int]:
    import torch

    return {dtype: mask for name, mask in _FLOAT8_NONFINITE_MASKS if (dtype := getattr(torch, name, None)) is not None}


DAMAGED_REMEDY = (
    "The file is damaged (an interrupted download, a disk error or a broken conversion): download it again "
    "from its source, or pick another copy of this model."
)


def _sample(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:_SHOW])
    return shown + (f" and {len(names) - _SHOW} more" if len(names) > _SHOW else "")


def non_float_tensors(dtypes: Mapping[str, str]) -> dict[str, str]:
    """Tensor name -> safetensors dtype name, for every integer, boolean or complex tensor (header order)."""
    return {name: dtype for name, dtype in dtypes.items() if dtype in NON_FLOAT_DTYPES}


def check_float_dtypes(dtypes: Mapping[str, str], *, source: Path) -> None:
    """Refuse integer, boolean and complex tensors: every tensor of a checkpoint here is a float weight.

    Args:
        dtypes: tensor name -> safetensors dtype name, e.g. from ``SafetensorsHeader.dtypes()``.
        source: the file named in the error.

    Raises:
        CheckpointError: naming the file, the first tensors and their dtypes.
    """
    wrong = non_float_tensors(dtypes)
    if wrong:
        first = list(wrong)[:_SHOW]
        shown = ", ".join(f"{name!r} is {wrong[name]}" for name in first)
        more = f" and {len(wrong) - len(first)} more" if len(wrong) > len(first) else ""
        raise CheckpointError(
            source,
            f"holds {len(wrong)} integer or boolean tensors where floating-point weights belong ({shown}{more}).",
            "It is damaged or was saved by a tool that stores weights in a format this loader does not read; "
            "download the bf16 (or fp8) .safetensors release of this model again.",
        )


def _summary(tensor: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """One kernel's result per tensor, on its device, no host sync (None: empty, integer or boolean).

    A float tensor gives ``aminmax`` (both finite iff the tensor is); a float8 tensor gives the largest
    byte after OR-ing its format's mask in (0xFF iff a byte is NaN/Inf).
    """
    import torch

    if tensor.numel() == 0 or not tensor.is_floating_point():
        return None
    mask = _float8_masks().get(tensor.dtype)
    if mask is not None:
        return (torch.bitwise_or(tensor.view(torch.uint8).reshape(-1), mask).amax(),)
    if tensor.element_size() == 1:  # another 1-byte float format: no fast path, upcast
        tensor = tensor.float()
    # flattened: on CPU, aminmax over a 5-d conv kernel can take far longer than over the same data as 1-d
    return tuple(torch.aminmax(tensor.reshape(-1)))


def _finite(values: list[torch.Tensor]) -> torch.Tensor:
    """Element-wise: is each summary value (all of one dtype) finite."""
    import torch

    stacked = torch.stack(values)
    return stacked != 0xFF if stacked.dtype == torch.uint8 else torch.isfinite(stacked)


class FiniteCheck:
    """Collects, without host syncs, whether each tensor added is finite; :meth:`nonfinite` tells once.

    Per tensor one reduction kernel (two for float8) is queued on the tensor's device; the results
    (a few scalars per tensor) are combined at the end, a handful of kernels per dtype. Add the tensors
    of one file (or one model) as they are read; all must be on one device.

    Example::

        check = FiniteCheck()
        for name in names:
            tensors[name] = handle.get_tensor(name)
            check.add(name, tensors[name])
        bad = check.nonfinite()  # one synchronization
    """

    def __init__(self) -> None:
        self._names: list[str] = []
        self._groups: dict[torch.dtype, tuple[list[int], list[torch.Tensor]]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue the check of one tensor on its own device (asynchronous on CUDA)."""
        summary = _summary(tensor)
        if summary is None:
            return
        owners, values = self._groups.setdefault(summary[0].dtype, ([], []))
        owners.extend([len(self._names)] * len(summary))
        values.extend(summary)
        self._names.append(name)

    def __len__(self) -> int:
        return len(self._names)

    def nonfinite(self) -> list[str]:
        """Names of the tensors added so far that hold a NaN or an Inf, in the order added.

        One host synchronization when all are finite; a second only to name the failures.
        """
        import torch

        if not self._names:
            return []
        flags = [_finite(values).all() for _, values in self._groups.values()]
        if bool(torch.stack(flags).all()):
            return []
        bad: set[int] = set()
        for owners, values in self._groups.values():
            bad.update(owner for owner, ok in zip(owners, _finite(values).tolist(), strict=True) if not ok)
        return [self._names[i] for i in sorted(bad)]


def check_finite(tensors: Mapping[str, torch.Tensor], *, source: Path) -> None:
    """Refuse a set of tensors (all on one device) of which any holds a NaN or an Inf.

    Raises:
        CheckpointError: naming ``source`` and the first non-finite tensors.
    """
    check = FiniteCheck()
    for name, tensor in tensors.items():
        check.add(name, tensor)
    raise_if_nonfinite(check, source=source)


def raise_if_nonfinite(check: FiniteCheck, *, source: Path) -> None:
    """Synchronize ``check`` once and raise if a tensor it saw is not finite.

    Raises:
        CheckpointError: naming ``source``, how many tensors hold NaN/Inf, and the first of them.
    """
    bad = check.nonfinite()
    if bad:
        raise CheckpointError(
            source,
            f"holds NaN or Inf values in {len(bad)} of the {len(check)} tensors read ({_sample(bad)}); a model with "
            "them produces black or constant images.",
            DAMAGED_REMEDY,
        )
