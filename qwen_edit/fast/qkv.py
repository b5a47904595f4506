"""One Q/K/V GEMM per stream: :func:`fuse_qkv` concatenates DiffSynth's three projections in place.

Per block, ``attn.to_q / to_k / to_v`` become ``attn.to_qkv`` (weight (3D, D) = rows of q, k, v;
bias (3D,)) and ``attn.add_q_proj / add_k_proj / add_v_proj`` become ``attn.add_qkv_proj``. One GEMM
with N = 3D reads the activations once instead of three times (and with fp8 row-wise scaled-mm
quantizes them once: the per-token scale is the same for the three, the per-channel weight scales
are the rows' own, so the fused fp8 layer is numerically the three fp8 layers).

Order (architecture.md): LoRA fused into the bf16 weights first, then :func:`fuse_qkv`, then
``fp8.quantize_linears``, then compile. After fusing, DiffSynth's own ``model_fn_qwen_image`` and
LoRA code that looks for ``attn.to_q`` no longer apply to the module; the fast forward runs it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

FUSED_IMAGE = "to_qkv"
FUSED_TEXT = "add_qkv_proj"
_STREAMS = ((("to_q", "to_k", "to_v"), FUSED_IMAGE), (("add_q_proj", "add_k_proj", "add_v_proj"), FUSED_TEXT))

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
