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
batch 1 in two runs.

With :data:`HEAD_BLOCKS` = H > 0, the launches for blocks 0..H-1 run first and those for the other blocks on a side
stream, beside blocks 0..H-1 (memory-bound GEMVs beside compute-bound GEMMs and attention); the forward waits for
the side stream before block H. CUDA graphs capture the fork and the join.

The switches are read on the host and are not part of a CUDA graph's signature: change them before graphs are
captured (or drop them).
"""

from __future__ import annotations

import logging
import os
import weakref

import torch

from ...fp8.shared_input_gemv import MAX_ROWS, SharedInputLinears, shared_input_problem

__all__ = ["FUSED_MODULATION", "HEAD_BLOCKS", "BlockModulations", "block_modulations"]

logger = logging.getLogger(__name__)

FUSED_MODULATION = os.environ.get("QWEN_EDIT_FUSED_MODULATION", "1") != "0"
"""Shared-input launches for all blocks' modulation where they can run (see the module docstring)."""

HEAD_BLOCKS = int(os.environ.get("QWEN_EDIT_MODULATION_HEAD_BLOCKS", "0"))
"""0: both launches before the first block, on the forward's stream. H > 0: blocks 0..H-1's first, the rest on a
side stream beside them (module docstring)."""

_GROUPS: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _layers(dit: torch.nn.Module) -> tuple[tuple[torch.nn.Module, ...], tuple[torch.nn.Module, ...]]:
    blocks = dit.transformer_blocks
    return tuple(b.img_mod[1] for b in blocks), tuple(b.txt_mod[1] for b in blocks)


def _split(count: int) -> int:
    """Blocks launched first: all of them unless :data:`HEAD_BLOCKS` leaves some for the side stream."""
    return HEAD_BLOCKS if 0 < HEAD_BLOCKS < count else count


def _groups(dit: torch.nn.Module) -> tuple[SharedInputLinears, ...] | None:
    """The launch groups of ``dit``: (img, txt) for blocks 0..H-1, then (img, txt) for the rest where
    :data:`HEAD_BLOCKS` splits them; cached while its modulation layers stay the same objects on the same device
    and the split is the same. None where they cannot run (the reason is logged)."""
    img_layers, txt_layers = _layers(dit)
    device = img_layers[0].weight.device if img_layers and hasattr(img_layers[0], "weight") else None
    head = _split(len(img_layers))
    cached = _GROUPS.get(dit)
    if cached is not None and cached[:4] == (img_layers, txt_layers, device, head):
        return cached[4]
    problem = shared_input_problem(img_layers) or shared_input_problem(txt_layers)
    if problem is None:
        groups = (SharedInputLinears(img_layers[:head]), SharedInputLinears(txt_layers[:head]))
        if head < len(img_layers):
            groups += (SharedInputLinears(img_layers[head:]), SharedInputLinears(txt_layers[head:]))
        logger.info("fast forward: %d modulation linears in %d shared-input fp8 launches per forward%s",
                    2 * len(img_layers), len(groups),
                    f" (blocks {head}.. on a side stream)" if len(groups) > 2 else "")  # fmt: skip
    else:
        groups = None
        logger.info("fast forward: modulation linears run per block (%s)", problem)
    _GROUPS[dit] = (img_layers, txt_layers, device, head, groups)
    return groups


class BlockModulations:
    """Each block's ``(img_mod.1(temb_img), txt_mod.1(temb_txt))``: ``mods[i]``, two (rows, 6 * D) bf16 views.

    Where the later blocks' launches run on a side stream, call :meth:`before_block` before each block: it makes the
    forward's stream wait for them before the first block that reads them.
    """

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], head: int,
                 side: torch.cuda.Stream | None = None, keep: tuple = ()):
        self.pairs, self.head, self._side, self._keep = pairs, head, side, keep

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pairs[index]

    def __len__(self) -> int:
        return len(self.pairs)

    def before_block(self, index: int) -> None:
        if self._side is not None and index == self.head:
            torch.cuda.current_stream().wait_stream(self._side)
            self._side, self._keep = None, ()  # the side stream's inputs may be freed now


def block_modulations(dit: torch.nn.Module, temb_img: torch.Tensor, temb_txt: torch.Tensor
                      ) -> BlockModulations | None:
    """Each block's modulation rows computed before the blocks (:class:`BlockModulations`), or None where the
    blocks compute them.

    temb_img: (Bt, D) or (2 Bt, D) (zero_cond_t), temb_txt: (Bt, D), bf16.
    """
    if not FUSED_MODULATION or max(temb_img.shape[0], temb_txt.shape[0]) > MAX_ROWS:
        return None
    if temb_img.dtype != torch.bfloat16 or temb_txt.dtype != torch.bfloat16:
        return None
    groups = _groups(dit)
    if groups is None:
        return None
    inputs = (temb_img, temb_txt) * (len(groups) // 2)
    prepared = [group.prepare(x) for group, x in zip(groups, inputs, strict=True)]  # all allocation on this stream
    outs = [group.launch(*args) for group, args in zip(groups[:2], prepared[:2], strict=True)]
    head, side = len(groups[0].layers), None
    if len(groups) > 2:
        if temb_img.is_cuda:
            if temb_img.device not in _SIDE_STREAMS:
                _SIDE_STREAMS[temb_img.device] = torch.cuda.Stream(temb_img.device)
            side = _SIDE_STREAMS[temb_img.device]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                outs += [group.launch(*args) for group, args in zip(groups[2:], prepared[2:], strict=True)]
        else:  # the interpreter: no streams
            outs += [group.launch(*args) for group, args in zip(groups[2:], prepared[2:], strict=True)]
    img = [row for out in outs[0::2] for row in out.unbind(0)]
    txt = [row for out in outs[1::2] for row in out.unbind(0)]
    return BlockModulations(list(zip(img, txt, strict=True)), head, side, tuple(prepared) if side else ())
