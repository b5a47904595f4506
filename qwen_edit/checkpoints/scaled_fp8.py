"""Dequantize ComfyUI "fp8_scaled" checkpoints to a floating dtype on load.

ComfyUI 0.3.75 reads these files as: a ``scaled_fp8`` marker tensor (empty,
dtype = the fp8 format), ``float8_e4m3fn`` Linear weights, and per-tensor
float32 scales ``<layer>.scale_weight`` (its ``scaled_fp8_ops``; e.g. all 358
Linear layers of ``qwen_2.5_vl_7b_fp8_scaled.safetensors``), optionally
``<layer>.scale_input``. Newer ComfyUI quantized files spell the scale
``<layer>.weight_scale`` (and ``input_scale``); both are accepted here.

The real weight is ``W = W8.float() * scale``; we compute that in float32 and
store it in the target dtype (bf16 by default). Input scales only matter for
fp8 matmuls and are dropped.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .safetensors_io import CheckpointError

logger = logging.getLogger(__name__)

MARKER_KEY = "scaled_fp8"
WEIGHT_SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
INPUT_SCALE_SUFFIXES = (".scale_input", ".input_scale")
FLOAT8_TORCH_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _strip(key: str, suffixes: tuple[str, ...]) -> str | None:
    """``"a.b.scale_weight"`` -> ``"a.b."``; a bare ``"scale_weight"`` -> ``""``; None if no suffix matches."""
    for suffix in suffixes:
        if key.endswith(suffix) or key == suffix[1:]:
            return key[: len(key) - len(suffix) + 1]
    return None


def is_scale_key(key: str) -> bool:
    """True for the marker and for weight / input scale tensors."""
    return key == MARKER_KEY or _strip(key, WEIGHT_SCALE_SUFFIXES + INPUT_SCALE_SUFFIXES) is not None


def dequantize(
    tensors: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    source: Path,
) -> dict[str, torch.Tensor]:
    """Replace fp8 weights by ``W8.float() * scale`` in ``dtype``; drop scales and the marker.

    Works in place on ``tensors`` (one tensor converted at a time, so peak memory
    is the fp8 checkpoint plus one dequantized tensor). Non-fp8 floating tensors
    are cast to ``dtype``. An fp8 weight without a scale is upcast with scale 1
    (how ComfyUI treats it).

    Args:
        tensors: stored name -> tensor (float8 weights, float32 scales, other tensors).
        dtype: the floating dtype to produce (e.g. ``torch.bfloat16``).
        source: the file named in errors.

    Returns:
        The same dict, now free of scale keys, every floating tensor in ``dtype``.

    Raises:
        CheckpointError: a scale without its weight, or a scale whose shape is neither
            per-tensor (1 element) nor per-output-row (``[out]`` / ``[out, 1]``).
    """
    scales: dict[str, torch.Tensor] = {}
    for key in [k for k in tensors if is_scale_key(k)]:
        value = tensors.pop(key)
        prefix = _strip(key, WEIGHT_SCALE_SUFFIXES)
        if prefix is not None:
            scales[prefix + "weight"] = value
    orphans = sorted(set(scales) - set(tensors))
    if orphans:
        raise CheckpointError(
            source,
            f"has fp8 scales without weights (e.g. for {orphans[0]!r}).",
            "The file is damaged; download it again.",
        )

    unscaled = 0
    for key in list(tensors):
        tensor = tensors[key]
        scale = scales.pop(key, None)
        if scale is None and tensor.dtype in FLOAT8_TORCH_DTYPES:
            unscaled += 1
        if scale is not None:
            tensors[key] = (tensor.float() * _broadcastable(scale, tensor, key, source)).to(dtype)
        elif tensor.is_floating_point() and tensor.dtype != dtype:
            tensors[key] = tensor.to(dtype)
        del tensor
    if unscaled:
        logger.debug("%s: %d float8 tensors have no scale; upcast with scale 1", source.name, unscaled)
    return tensors


def _broadcastable(scale: torch.Tensor, weight: torch.Tensor, key: str, source: Path) -> torch.Tensor:
    scale = scale.to(device=weight.device, dtype=torch.float32)
    if scale.numel() == 1:
        return scale.reshape(())
    rows = weight.shape[0] if weight.ndim else 0
    if scale.numel() == rows and weight.ndim >= 1:
        return scale.reshape(rows, *([1] * (weight.ndim - 1)))
    raise CheckpointError(
        source,
        f"has a scale of shape {list(scale.shape)} for {key!r} {list(weight.shape)}; "
        "only per-tensor and per-row fp8 scales are supported.",
        "Use the bf16 text encoder (qwen_2.5_vl_7b.safetensors) instead.",
    )


def pop_fp8_weights(tensors: dict[str, torch.Tensor], *, source: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Take every 2-D float8 ``*.weight`` out of ``tensors`` with its scale, to be kept in fp8.

    Works in place on ``tensors``: the fp8 weights and their weight scales leave it (input scales and the
    marker stay, for :func:`dequantize` to drop). A weight without a scale gets scale 1 (how ComfyUI reads it).

    Returns:
        stored weight name -> ``(weight float8 [out, in], scale float32: 0-dim per tensor or [out, 1] per row)``.

    Raises:
        CheckpointError: a scale whose shape is neither per-tensor nor per-output-row.
    """
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key in [k for k, t in tensors.items() if t.dtype in FLOAT8_TORCH_DTYPES and t.ndim == 2
                and k.endswith("weight")]:
        if tensors[key].dtype != torch.float8_e4m3fn:
            continue  # e5m2 weights are dequantized instead (the fp8 layers hold e4m3)
        weight = tensors.pop(key)
        prefix = key[: -len("weight")]
        scale = None
        for suffix in WEIGHT_SCALE_SUFFIXES:
            if prefix + suffix[1:] in tensors:
                scale = tensors.pop(prefix + suffix[1:])
        if scale is None:
            scale = torch.ones((), dtype=torch.float32, device=weight.device)
        scale = _broadcastable(scale, weight, key, source)
        out[key] = (weight, scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1, 1))
    return out
