"""One Q/K/V GEMM per stream: :func:`fuse_qkv` concatenates DiffSynth's three projections in place.

Per block, ``attn.to_q / to_k / to_v`` become ``attn.to_qkv`` (weight (3D, D) = rows of q, k, v;
bias (3D,)) and ``attn.add_q_proj / add_k_proj / add_v_proj`` become ``attn.add_qkv_proj``. One GEMM
with N = 3D reads the activations once instead of three times (and with fp8 row-wise scaled-mm
quantizes them once: the per-token scale is the same for the three, the per-channel weight scales
are the rows' own, so the fused fp8 layer is numerically the three fp8 layers).

Order (architecture.md): LoRA fused into the bf16 weights first, then :func:`fuse_qkv`, then
``fp8.quantize_linears``, then compile. After fusing, DiffSynth's own ``model_fn_qwen_image`` and
LoRA code that looks for ``attn.to_q`` no longer apply to the module; the fast forward runs it.

:func:`fuse_fp8_qkv` does the same after the fp8 conversion, for row-wise ``ScaledMMLinear`` layers (their
fp8 rows, per-row scales and biases concatenated: numerically the three layers). The pack's fp8 variants
(``qwen_edit.fp8_dit.build_fp8_dit``) fuse the text stream's (:data:`FP8_FUSED_STREAMS`); a LoRA update
of ``add_q_proj`` and friends is re-quantized into the fused layer's rows (:func:`fused_rows`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

FUSED_IMAGE = "to_qkv"
FUSED_TEXT = "add_qkv_proj"
_STREAMS = ((("to_q", "to_k", "to_v"), FUSED_IMAGE), (("add_q_proj", "add_k_proj", "add_v_proj"), FUSED_TEXT))

STREAM_LAYERS = {"image": _STREAMS[0], "text": _STREAMS[1]}
"""Stream -> (its three projection names, the fused layer's name)."""

FP8_FUSED_STREAMS = ("text",)
"""Streams whose row-wise fp8 Q/K/V the pack's fp8 builds run as one GEMM (a fact of the build, in the conversion
report). The text stream (M = 300 tokens at batch 1): three 3072 -> 3072 GEMMs of about 11.5 us each become one
3072 -> 9216 GEMM. The image stream keeps three: its fused GEMM was not faster."""

FUSED_QKV_PATTERN = r"transformer_blocks\.\d+\.attn\.(?:to_qkv|add_qkv_proj)"
"""Qualified names of the fused layers, in ``fp8.presets`` pattern syntax (for a preset's ``compute``)."""


def _fuse_three(layers: tuple[nn.Linear, ...], where: str) -> nn.Linear:
    for layer in layers:
        if type(layer) is not nn.Linear:
            raise TypeError(
                f"{where}: fuse_qkv needs plain nn.Linear projections (bf16/fp32 weights), got "
                f"{type(layer).__name__}; fuse before fp8.quantize_linears"
            )
    shapes = {tuple(layer.weight.shape) for layer in layers}
    if len(shapes) != 1 or any(layer.bias is None for layer in layers):
        raise ValueError(f"{where}: q/k/v projections must share one weight shape and have biases; got {shapes}")
    first = layers[0]
    weight = torch.cat([layer.weight.detach() for layer in layers], dim=0)
    bias = torch.cat([layer.bias.detach() for layer in layers], dim=0)
    with torch.device("meta"):
        fused = nn.Linear(first.in_features, 3 * first.out_features, bias=True)
    fused.weight = nn.Parameter(weight, requires_grad=first.weight.requires_grad)
    fused.bias = nn.Parameter(bias, requires_grad=first.bias.requires_grad)
    return fused


@torch.no_grad()
def fuse_qkv(dit: nn.Module) -> int:
    """Fuse each block's Q/K/V projections into one ``nn.Linear`` per stream, in place.

    Args:
        dit: a DiffSynth ``QwenImageDiT`` (``transformer_blocks[i].attn``) with plain ``nn.Linear``
            projections; bf16/fp16/fp32 weights on any device.

    Returns:
        The number of fused layers created (2 per block; 0 when already fused).

    Memory: one block's q/k/v weights extra at a time (the originals are dropped as each fused layer
    is installed). Raises TypeError for projections that are already fp8 (fuse before quantizing).
    """
    created = 0
    for index, block in enumerate(dit.transformer_blocks):
        attn = block.attn
        for names, fused_name in _STREAMS:
            if hasattr(attn, fused_name):
                continue
            where = f"transformer_blocks.{index}.attn"
            fused = _fuse_three(tuple(getattr(attn, name) for name in names), where)
            for name in names:
                delattr(attn, name)
            setattr(attn, fused_name, fused)
            created += 1
    logger.info("fuse_qkv: %d fused Q/K/V projections", created)
    return created


def _fusable_fp8(layers: tuple[nn.Module | None, ...]) -> bool:
    """Three row-wise ``ScaledMMLinear`` layers with the same shape, settings, bias presence and device."""
    from ...fp8.linear import ScaledMMLinear

    if any(type(layer) is not ScaledMMLinear or layer.granularity != "rowwise" for layer in layers):
        return False
    return len({(layer.in_features, layer.out_features, layer.emulate, layer.fast_accum, layer.gemm_kernel,
                 layer.bias is None, layer.weight.device) for layer in layers}) == 1


def _check_streams(streams: tuple[str, ...]) -> None:
    unknown = [stream for stream in streams if stream not in STREAM_LAYERS]
    if unknown or isinstance(streams, str):
        raise ValueError(f"fuse_fp8_qkv: streams must be a tuple of {', '.join(map(repr, STREAM_LAYERS))}, got "
                         f"{streams!r}")


@torch.no_grad()
def fuse_fp8_qkv(dit: nn.Module, streams: tuple[str, ...] = FP8_FUSED_STREAMS) -> int:
    """After ``fp8.quantize_linears``: one row-wise fp8 Q/K/V layer per block for each of ``streams``.

    Args:
        dit: a DiffSynth ``QwenImageDiT`` whose projections are row-wise ``ScaledMMLinear`` (fp8 weight
            [N, K] e4m3, scale [N, 1] float32, bias [N] bf16); blocks whose three differ in type, shape or
            settings (Transformer Engine, weight-only, tensor-wise) are left as they are.
        streams: "image" and / or "text" (anything else: ValueError naming the allowed values).

    Returns:
        The number of fused layers created. The fused layer is ``ScaledMMLinear`` [3N, K] (rows q, k, v) with
        the three layers' scales and biases: each output column is computed as in its own layer.
    """
    _check_streams(streams)
    created = sum(fuse_block_fp8_qkv(block, index, streams) for index, block in enumerate(dit.transformer_blocks))
    if created:
        logger.info("fuse_fp8_qkv: %d fused fp8 Q/K/V layers (%s)", created, ", ".join(streams))
    return created


@torch.no_grad()
def fuse_block_fp8_qkv(block: nn.Module, index: int, streams: tuple[str, ...] = FP8_FUSED_STREAMS) -> int:
    """:func:`fuse_fp8_qkv` for one block (``transformer_blocks[index]``); returns the layers created (0-2).

    The DiT builder calls it as each block is quantized, so a block bound for host memory leaves the GPU in
    its final form.
    """
    from ...fp8.linear import ScaledMMLinear

    _check_streams(streams)
    created = 0
    attn = block.attn
    for stream in streams:
        names, fused_name = STREAM_LAYERS[stream]
        layers = tuple(getattr(attn, name, None) for name in names)
        if hasattr(attn, fused_name) or not _fusable_fp8(layers):
            continue
        first = layers[0]
        bias = None if first.bias is None else torch.cat([layer.bias for layer in layers])
        fused = ScaledMMLinear(
            torch.cat([layer.weight for layer in layers]),
            torch.cat([layer.weight_scale.reshape(-1, 1) for layer in layers]), bias, "rowwise", first.emulate,
            f"transformer_blocks.{index}.attn.{fused_name}", first.fast_accum, first.gemm_kernel)
        for name in names:
            delattr(attn, name)
        setattr(attn, fused_name, fused)
        created += 1
    return created


def fused_rows(dit: nn.Module, layer_name: str) -> tuple[nn.Module, slice] | None:
    """Where a projection fused away by :func:`fuse_fp8_qkv` lives: (the fused layer, its rows), or None.

    ``layer_name`` is the original's qualified name, e.g. ``transformer_blocks.3.attn.add_k_proj``.
    """
    attn_name, _, leaf = layer_name.rpartition(".")
    for names, fused_name in _STREAMS:
        if leaf not in names:
            continue
        try:
            fused = dit.get_submodule(f"{attn_name}.{fused_name}")
        except AttributeError:
            return None
        rows = fused.weight.shape[0] // 3
        start = names.index(leaf) * rows
        return fused, slice(start, start + rows)
    return None


def fused_in_plan(decisions, backend: str, streams: tuple[str, ...] = FP8_FUSED_STREAMS) -> int:
    """How many Q/K/V layer triples ``build_fp8_dit`` will fuse, read from ``fp8.plan_linears`` decisions
    (names and actions, before anything is built): for the row-wise scaled-mm backend, the blocks whose three
    projections of a fused stream are all in fp8 compute."""
    from ...fp8.swap import COMPUTE

    if backend != "scaled_mm_rowwise":
        return 0
    compute = {d.name for d in decisions if d.action == COMPUTE}
    blocks = {name.split(".")[1] for name in compute if name.startswith("transformer_blocks.")}
    return sum(all(f"transformer_blocks.{b}.attn.{name}" in compute for name in STREAM_LAYERS[stream][0])
               for stream in streams for b in blocks)
