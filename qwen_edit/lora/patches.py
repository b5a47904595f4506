"""One LoRA update to one target tensor, kept in the factors the file stores.

A patch never holds a dense delta: the delta is formed on demand, in float32 on
the device of the weight it goes into, and added straight into a float32
accumulator (see :meth:`LoraPatch.add_to`). Shapes, for a Linear weight W of
shape ``(out, in)``:

=========  ===================================================  =================================
kind       factors (stored dtype, CPU)                          delta (float32, ``(out, in)``)
=========  ===================================================  =================================
``lora``   ``up (out, r)``, ``down (r, in)``                    ``scale * up @ down``
``loha``   ``w1_a (out, r1)``, ``w1_b (r1, in)``, same for w2   ``scale * (w1_a@w1_b) * (w2_a@w2_b)``
``lokr``   ``w1 (a, b)`` or ``w1_a@w1_b``; ``w2 (c, d)`` or      ``scale * kron(w1, w2)``, ``a*c = out``,
           ``w2_a@w2_b``                                        ``b*d = in``
``diff``   ``diff`` (shape of the target, weight or bias)       ``scale * diff``
=========  ===================================================  =================================

``scale`` is ``alpha / rank`` when the file has an alpha, else 1.0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["KINDS", "LoraPatch"]

KINDS = ("lora", "loha", "lokr", "diff")


@dataclass(frozen=True, eq=False)
class LoraPatch:
    """An update to ``target`` (full tensor name, e.g. ``transformer_blocks.0.attn.to_q.weight``).

    ``factors`` map factor names (see the module table) to tensors as stored;
    ``scale`` is alpha/rank or 1.0; ``keys`` are the file keys this patch consumed.
    """

    target: str
    kind: str
    factors: Mapping[str, torch.Tensor]
    scale: float
    keys: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown patch kind {self.kind!r}; expected one of {KINDS}")

    def _f(self, name: str, device: torch.device | None) -> torch.Tensor:
        return self.factors[name].to(device=device, dtype=torch.float32)

    def _pair(self, stem: str, device: torch.device | None) -> torch.Tensor:
        if stem in self.factors:
            return self._f(stem, device)
        return self._f(f"{stem}_a", device) @ self._f(f"{stem}_b", device)

    @torch.no_grad()
    def add_to(self, acc: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
        """Add ``factor * scale * delta`` into ``acc`` in place and return it.

        ``acc`` must be float32 with the target's shape; factors are moved to its
        device and upcast to float32 there.
        """
        if acc.dtype != torch.float32:
            raise TypeError(f"accumulator for {self.target} must be float32, got {acc.dtype}")
        coeff = float(factor) * self.scale
        dev = acc.device
        if self.kind == "lora":
            return acc.addmm_(self._f("up", dev), self._f("down", dev), alpha=coeff)
        if self.kind == "loha":
            delta = self._pair("w1", dev) * self._pair("w2", dev)
        elif self.kind == "lokr":
            delta = torch.kron(self._pair("w1", dev), self._pair("w2", dev))
        else:
            delta = self._f("diff", dev)
        return acc.add_(delta.reshape(acc.shape), alpha=coeff)

    def delta(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Dense ``scale * delta`` as a new float32 tensor of the target's shape (for tests and reports)."""
        shape = self.target_shape()
        return self.add_to(torch.zeros(shape, dtype=torch.float32, device=device))

    def target_shape(self) -> tuple[int, ...]:
        """Shape of the target tensor implied by the factors."""
        f = self.factors
        if self.kind == "lora":
            return (f["up"].shape[0], f["down"].shape[1])
        if self.kind == "loha":
            return (f["w1_a"].shape[0], f["w1_b"].shape[1])
        if self.kind == "lokr":
            w1 = f["w1"].shape if "w1" in f else (f["w1_a"].shape[0], f["w1_b"].shape[1])
            w2 = f["w2"].shape if "w2" in f else (f["w2_a"].shape[0], f["w2_b"].shape[1])
            return (w1[0] * w2[0], w1[1] * w2[1])
        return tuple(f["diff"].shape)
