"""Every block's modulation linear in two launches per forward: all ``img_mod.1``, then all ``txt_mod.1``.

Each block's ``img_mod`` / ``txt_mod`` is ``Linear(dim, 6 * dim)`` on ``silu(conditioning)``, the same one
to two rows for all 60 blocks. With fp8 weights (the "attn+mlp+mod compute" preset: row-wise
``ScaledMMLinear``; the default preset: ``WeightOnlyLinear``) they run as two
:class:`...fp8.shared_input_gemv.SharedInputLinears` launches before the first block, and each block gets
its two (Bt, 6 * dim) rows instead of calling its layers. bf16 models, Transformer Engine layers and CPU
runs keep the per-block calls (the reason is logged once per model).

On by default since the sixteenth session (``QWEN_EDIT_FUSED_MODULATION=0`` turns it off). Until then the two
launches read the weights at 2.2-2.5 TB/s, no faster than the compiled blocks' own 120 GEMVs, and did not pay
(sixth and thirteenth sessions). Triton had been loading the weights a byte at a time: their addresses come from a
table, so it could not know their alignment. With the hint the two launches take 1.51 ms at one row and 1.60 ms at
two (4.5 / 4.2 TB/s, H200, ``bench/modulation_stream_bench.py``); forward A/B on an H200 (``bench/forward_ab_bench.py
--alignment`` and ``--modulation-stream``, docs/benchmarks.md): 177.80 -> 175.89 ms and 180.49 -> 180.32 ms at
batch 1 in two runs. The switch is read on the host and is not part of a CUDA graph's signature: change it before
graphs are captured (or drop them).
"""

from __future__ import annotations

import logging
import os
import weakref

import torch

from ...fp8.shared_input_gemv import MAX_ROWS, SharedInputLinears, shared_input_problem

__all__ = ["FUSED_MODULATION", "block_modulations"]

logger = logging.getLogger(__name__)

FUSED_MODULATION = os.environ.get("QWEN_EDIT_FUSED_MODULATION", "1") != "0"
"""Two shared-input launches for all blocks' modulation where they can run (see the module docstring)."""

_GROUPS: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


def _layers(dit: torch.nn.Module) -> tuple[tuple[torch.nn.Module, ...], tuple[torch.nn.Module, ...]]:
    blocks = dit.transformer_blocks
    return tuple(b.img_mod[1] for b in blocks), tuple(b.txt_mod[1] for b in blocks)


def _groups(dit: torch.nn.Module) -> tuple[SharedInputLinears, SharedInputLinears] | None:
    """The two launch groups of ``dit`` (cached while its modulation layers stay the same objects on the same
    device), or None."""
    img_layers, txt_layers = _layers(dit)
    device = img_layers[0].weight.device if img_layers and hasattr(img_layers[0], "weight") else None
    cached = _GROUPS.get(dit)
    if cached is not None and cached[:3] == (img_layers, txt_layers, device):
        return cached[3]
    problem = shared_input_problem(img_layers) or shared_input_problem(txt_layers)
    if problem is None:
        groups = (SharedInputLinears(img_layers), SharedInputLinears(txt_layers))
        logger.info("fast forward: %d modulation linears in two shared-input fp8 launches per forward",
                    2 * len(img_layers))  # fmt: skip
    else:
        groups = None
        logger.info("fast forward: modulation linears run per block (%s)", problem)
    _GROUPS[dit] = (img_layers, txt_layers, device, groups)
    return groups


def block_modulations(dit: torch.nn.Module, temb_img: torch.Tensor, temb_txt: torch.Tensor
                      ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Each block's ``(img_mod.1(temb_img), txt_mod.1(temb_txt))``, or None where the blocks compute them.

    temb_img: (Bt, D) or (2 Bt, D) (zero_cond_t), temb_txt: (Bt, D), bf16. Returns one pair of
    (rows, 6 * D) bf16 views per block.
    """
    if not FUSED_MODULATION or max(temb_img.shape[0], temb_txt.shape[0]) > MAX_ROWS:
        return None
    if temb_img.dtype != torch.bfloat16 or temb_txt.dtype != torch.bfloat16:
        return None
    groups = _groups(dit)
    if groups is None:
        return None
    return list(zip(groups[0](temb_img).unbind(0), groups[1](temb_txt).unbind(0), strict=True))
