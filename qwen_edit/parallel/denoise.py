"""One rank's denoising loop: its CFG branch, its sequence shard, one exchange of predictions per step.

Every rank starts from the same noise (the one-process path's CPU generator) and ends each step with the same
latents: the two CFG branches all-gather their predictions (one collective per step) and each rank combines them
as the one-process path does (``negative + cfg * (positive - negative)``), then steps the same scheduler. With
CFG-parallel alone each rank runs the one-process forward for batch 1, so the latents equal the one-process path's
unbatched CFG (``batched_cfg=False``) bit for bit where the same kernels run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..fast.options import SHIPPED, ForwardOptions
from ..plan import Variant
from ..sampling import Callbacks, Conditioning, EditRequest, start_denoising
from .layout import RankPlace
from .ulysses import SequenceShards

__all__ = ["RankGroups", "parallel_denoise"]


@dataclass(frozen=True, eq=False)
class RankGroups:
    """This rank's process groups: ``cfg`` (the two CFG branches' ranks of its shard, or None without CFG-parallel)
    and ``sequence`` (its Ulysses group, or None without sequence parallel)."""

    place: RankPlace
    cfg: object | None
    sequence: SequenceShards | None


def parallel_denoise(request: EditRequest, conditioning: Conditioning, *, dit, variant: Variant,
                     device: torch.device, dtype: torch.dtype, callbacks: Callbacks, groups: RankGroups,
                     attention: str = "sdpa", options: ForwardOptions = SHIPPED) -> torch.Tensor:
    """The denoising loop of :meth:`..sampling.EditSampler.denoise` on one rank; returns latents (1, 16, H/8, W/8),
    the same on every rank. ``dit``: this rank's ``fast.prepared.PreparedDit``.

    Without a negative prompt (cfg 1) both CFG branches run the prompt and nothing is exchanged.
    """
    from ..fast_forward import fast_model_fn

    scheduler, latents, shared = start_denoising(request, conditioning, variant, device, dtype)
    split_cfg = groups.cfg is not None and conditioning.negative is not None
    prompt = conditioning.negative if split_cfg and groups.place.cfg_rank == 1 else conditioning.positive
    total = len(scheduler.timesteps)
    for index, timestep in enumerate(scheduler.timesteps):
        callbacks.check_interrupt()
        t = timestep.unsqueeze(0).to(dtype=dtype, device=device)
        prediction = fast_model_fn(dit=dit, latents=latents, timestep=t, attention_backend=attention,
                                   options=options, sequence_shards=groups.sequence, **prompt, **shared)
        if split_cfg:
            both = [torch.empty_like(prediction) for _ in range(2)]
            dist.all_gather(both, prediction.contiguous(), group=groups.cfg)
            positive, negative = both
            prediction = negative + request.cfg * (positive - negative)
        elif conditioning.negative is not None:  # true CFG without CFG-parallel: both forwards here
            negative = fast_model_fn(dit=dit, latents=latents, timestep=t, attention_backend=attention,
                                     options=options, sequence_shards=groups.sequence, **conditioning.negative,
                                     **shared)
            prediction = negative + request.cfg * (prediction - negative)
        latents = scheduler.step(prediction, timestep, latents)
        callbacks.on_step(index + 1, total, latents)
    return latents
