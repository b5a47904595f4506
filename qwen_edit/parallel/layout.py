"""Which GPUs one edit runs on, and how the work is split: a frozen value on the pipe plan.

Ranks are laid out CFG-major: rank ``r`` runs CFG branch ``r // ulysses`` (0: the prompt, 1: the negative prompt)
and holds sequence shard ``r % ulysses``. ``cfg=2, ulysses=4`` runs on 8 GPUs as two groups of four.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ULYSSES_DEGREES", "ParallelChoice", "ParallelInputError", "RankPlace"]

ULYSSES_DEGREES = (1, 2, 4, 8)
"""Sequence-parallel degrees offered (Qwen-Image's DiT has 24 heads: each divides them)."""


class ParallelInputError(ValueError):
    """A parallel layout that cannot run here; the message names the input and what to do."""


@dataclass(frozen=True)
class RankPlace:
    """Where one rank sits: its CFG branch (0: prompt, 1: negative prompt) and its sequence shard."""

    rank: int
    cfg_rank: int
    sp_rank: int


@dataclass(frozen=True)
class ParallelChoice:
    """CFG-parallel degree (1 or 2) x Ulysses degree (1, 2, 4, 8), on ``gpus`` (device indices; empty: the first
    ``world`` devices).

    ``cfg=2`` runs the prompt's and the negative prompt's forwards of each step on two ranks and combines the
    guidance after one all-gather of the two predictions; ``ulysses=P`` splits each forward's token sequence over
    P ranks, with two all-to-alls per block around the attention (heads must divide by P).
    """

    cfg: int = 1
    ulysses: int = 1
    gpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.cfg not in (1, 2):
            raise ParallelInputError(f"cfg_parallel: the CFG-parallel degree is 1 or 2, got {self.cfg}")
        if self.ulysses not in ULYSSES_DEGREES:
            raise ParallelInputError(f"ulysses: the sequence-parallel degree is one of "
                                     f"{', '.join(map(str, ULYSSES_DEGREES))}, got {self.ulysses}")
        if self.gpus and len(self.gpus) != self.world:
            raise ParallelInputError(f"gpus: {len(self.gpus)} devices listed ({', '.join(map(str, self.gpus))}) for "
                                     f"cfg {self.cfg} x ulysses {self.ulysses} = {self.world} ranks: list exactly "
                                     f"{self.world}, or leave gpus empty for the first {self.world}")
        if len(set(self.gpus)) != len(self.gpus):
            raise ParallelInputError(f"gpus: each device once, got {', '.join(map(str, self.gpus))}")

    @property
    def world(self) -> int:
        return self.cfg * self.ulysses

    @property
    def devices(self) -> tuple[int, ...]:
        """Device index of each rank."""
        return self.gpus or tuple(range(self.world))

    def place(self, rank: int) -> RankPlace:
        return RankPlace(rank=rank, cfg_rank=rank // self.ulysses, sp_rank=rank % self.ulysses)

    def cfg_groups(self) -> list[list[int]]:
        """Ranks that exchange their CFG predictions: one group per sequence shard."""
        return [[c * self.ulysses + s for c in range(self.cfg)] for s in range(self.ulysses)]

    def sequence_groups(self) -> list[list[int]]:
        """Ranks that share one forward's sequence: one group per CFG branch."""
        return [[c * self.ulysses + s for s in range(self.ulysses)] for c in range(self.cfg)]

    def check(self, heads: int, available: int, device_kind: str = "cuda") -> None:
        """Raise :class:`ParallelInputError` when the model's ``heads`` do not divide by ``ulysses`` or the ranks
        ask for devices beyond the ``available`` ones (``torch.cuda.device_count()`` on GPUs)."""
        if heads % self.ulysses:
            fitting = ", ".join(str(d) for d in ULYSSES_DEGREES if heads % d == 0)
            raise ParallelInputError(f"ulysses: {self.ulysses} does not divide the model's {heads} attention heads; "
                                     f"choose a degree that does ({fitting})")
        if device_kind == "cuda":
            wanted = max(self.devices) + 1
            if wanted > available:
                raise ParallelInputError(
                    f"gpus: cfg {self.cfg} x ulysses {self.ulysses} needs {self.world} GPUs (devices "
                    f"{', '.join(map(str, self.devices))}), this process sees {available} "
                    "(torch.cuda.device_count(); CUDA_VISIBLE_DEVICES and ComfyUI's --cuda-device limit it): lower "
                    "cfg_parallel / ulysses, or start ComfyUI where more GPUs are visible")

    def describe(self) -> str:
        if self.world == 1:
            return "one GPU"
        parts = []
        if self.cfg > 1:
            parts.append("CFG-parallel 2")
        if self.ulysses > 1:
            parts.append(f"Ulysses sequence parallel {self.ulysses}")
        return f"{' x '.join(parts)} on {self.world} devices ({', '.join(map(str, self.devices))})"
