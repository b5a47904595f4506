"""Build a model without allocating weights, then give it the checkpoint's tensors.

Models are constructed under ``torch.device("meta")`` (no memory, no random
init, fast even at 20B parameters), then :func:`load_into` checks the key set
and shapes strictly and assigns the loaded tensors in place
(``load_state_dict(assign=True)``), so weights exist once, never twice.

Tensors computed in ``__init__`` (RoPE tables, latent mean/std) come out on
``meta`` as well; each builder recomputes its own, and :func:`find_meta_tensors`
makes sure none is left behind.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from .safetensors_io import CheckpointError, SafetensorsHeader, load_tensors

logger = logging.getLogger(__name__)

_SHOW = 5


def _sample(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(repr(k) for k in keys[:_SHOW])
    return shown + (f" and {len(keys) - _SHOW} more" if len(keys) > _SHOW else "")


@contextmanager
def meta_device():
    """Construct modules with parameters on ``meta`` (no allocation, no init)."""
    with torch.device("meta"):
        yield


def read_tensors(
    headers: Iterable[SafetensorsHeader],
    *,
    device: torch.device | str,
    rename: Callable[[str], str | None] = lambda key: key,
) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """Load every shard onto ``device`` in its stored dtype, renaming keys.

    Each shard goes through :func:`~.safetensors_io.load_tensors`, which refuses integer / boolean
    tensors and checks every tensor for NaN/Inf on ``device`` (one host sync per shard).

    Args:
        headers: validated headers of the shards.
        device: target device; tensors are read straight onto it.
        rename: stored name -> model name, or None to drop the tensor.

    Returns:
        ``(tensors, sources)``: model name -> tensor, and model name -> shard it came from.

    Raises:
        CheckpointError: a shard cannot be read, or holds a non-float or non-finite tensor; the
            tensors of the shards read before it are released first.
    """
    tensors: dict[str, torch.Tensor] = {}
    sources: dict[str, Path] = {}
    try:
        for header in headers:
            wanted = {key: rename(key) for key in header.tensors}
            keep = [key for key, new in wanted.items() if new is not None]
            for key, tensor in load_tensors(header.path, device=device, keys=keep).items():
                tensors[wanted[key]] = tensor
                sources[wanted[key]] = header.path
    except BaseException:
        tensors.clear()
        raise
    return tensors, sources


def cast_floating(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Cast floating-point tensors to ``dtype`` one at a time (in place in the dict; peak = one extra tensor)."""
    for key in list(tensors):
        tensor = tensors[key]
        if tensor.is_floating_point() and tensor.dtype != dtype:
            tensors[key] = tensor.to(dtype)
            del tensor
    return tensors


def check_keys_and_shapes(
    expected: Mapping[str, tuple[int, ...]],
    found: Mapping[str, tuple[int, ...]],
    *,
    source: Path,
    what: str,
) -> None:
    """Strict comparison of a model's state-dict shapes with the checkpoint's.

    Raises:
        CheckpointError: naming the file, with the first few missing / unexpected / mismatched keys.
    """
    missing = set(expected) - set(found)
    unexpected = set(found) - set(expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing keys ({_sample(missing)})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys ({_sample(unexpected)})")
        raise CheckpointError(
            source,
            f"does not match {what} built at the size its own tensors give: {'; '.join(parts)}.",
            "The file is incomplete or is another model; download it again or pick the right file.",
        )
    wrong = {k: (tuple(found[k]), tuple(expected[k])) for k in expected if tuple(found[k]) != tuple(expected[k])}
    if wrong:
        first = sorted(wrong)[:_SHOW]
        shown = ", ".join(f"{k!r} is {list(wrong[k][0])}, expected {list(wrong[k][1])}" for k in first)
        raise CheckpointError(
            source,
            f"is inconsistent with itself: {len(wrong)} tensors have unexpected shapes ({shown}).",
            "The file is corrupted or mixes two models; download it again.",
        )


def find_meta_tensors(model: torch.nn.Module) -> list[str]:
    """Names of parameters, buffers and plain tensor attributes still on ``meta``."""
    names = [n for n, p in model.named_parameters() if p.is_meta]
    names += [n for n, b in model.named_buffers() if b.is_meta]
    for module_name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                names.append(f"{module_name}.{attr}" if module_name else attr)
    return names


def load_into(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    *,
    source: Path,
    what: str,
) -> torch.nn.Module:
    """Strictly check and assign ``tensors`` to a meta-built ``model`` (no copy).

    After this, the caller recomputes init-time tensors, then calls :func:`finish`.

    Raises:
        CheckpointError: missing / unexpected keys or wrong shapes, naming ``source``.
    """
    expected = {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()}
    check_keys_and_shapes(expected, {k: tuple(v.shape) for k, v in tensors.items()}, source=source, what=what)
    model.load_state_dict(tensors, strict=True, assign=True)
    return model


def finish(model: torch.nn.Module, *, device: torch.device | str, source: Path) -> torch.nn.Module:
    """Move buffers to ``device``, freeze for inference and check nothing is left on ``meta``.

    Raises:
        RuntimeError: a tensor stayed on ``meta`` (a builder bug, not a user error).
    """
    leftover = find_meta_tensors(model)
    if leftover:
        raise RuntimeError(f"{source.name}: {type(model).__name__} still has meta tensors: {_sample(leftover)}")
    model.to(device)
    model.requires_grad_(False)
    model.eval()
    return model
