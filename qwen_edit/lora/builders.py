"""Turning the keys of one LoRA module into validated patches.

Input: the keys of one LoRA-side module grouped by role (see :mod:`.keys`), the
target module it resolved to, and the target shapes. Output: patches, the keys
left unused with a reason, and a skip reason when the whole module is an update
this library does not apply. Inconsistent tensors (rank vs alpha, shapes that
do not fit the target) raise LoraFormatError naming the file, key and shapes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .errors import LoraFormatError
from .keys import KeyPart
from .patches import LoraPatch

__all__ = ["ModuleResult", "build_module"]

_HADA = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
_LOKR = ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b")
_SKIP_MODULE = {
    "dora_scale": "DoRA (dora_scale) is not supported: fusing it as a plain LoRA would be wrong",
    "mid": "LoCon lora_mid (Tucker) factors are for convolutions, not a Linear weight",
    "hada_t1": "LoHa CP factors (hada_t1/hada_t2) are for convolutions, not a Linear weight",
    "hada_t2": "LoHa CP factors (hada_t1/hada_t2) are for convolutions, not a Linear weight",
    "lokr_t2": "LoKr CP factor (lokr_t2) is for convolutions, not a Linear weight",
    "reshape_weight": "reshape_weight (a LoRA that resizes the layer) is not supported",
}


@dataclass
class ModuleResult:
    """What one module contributed: patches, unused ``(key, reason)``, skip reason, format labels."""

    patches: list[LoraPatch] = field(default_factory=list)
    unused: list[tuple[str, str]] = field(default_factory=list)
    skipped: str | None = None
    formats: set[str] = field(default_factory=set)


class _Builder:
    def __init__(self, source, tensors, shapes, module_key, module, parts: Mapping[str, KeyPart]):
        self.source, self.tensors, self.shapes = source, tensors, shapes
        self.module_key, self.module, self.parts = module_key, module, parts
        self.weight = f"{module}.weight"

    def fail(self, key: str, msg: str) -> LoraFormatError:
        return LoraFormatError(f"LoRA file {self.source}: key '{key}' {msg}")

    def tensor(self, role: str) -> torch.Tensor:
        part = self.parts[role]
        t = self.tensors[part.key]
        if not t.is_floating_point():
            raise self.fail(part.key, f"holds {t.dtype} data; LoRA factors must be floating point")
        return t

    def matrix(self, role: str) -> torch.Tensor:
        """The factor as a 2-D tensor (a trailing 1x1 kernel is squeezed)."""
        t = self.tensor(role)
        if t.ndim == 4 and tuple(t.shape[2:]) == (1, 1):
            t = t.reshape(t.shape[:2])
        if t.ndim != 2:
            raise self.fail(self.parts[role].key, f"has shape {tuple(t.shape)}; a Linear factor must be 2-D")
        return t

    def linear_target(self, key: str) -> tuple[int, int]:
        shape = self.shapes[self.weight]
        if len(shape) != 2:
            raise self.fail(key, f"targets {self.weight} of shape {shape}, which is not a Linear weight")
        return shape  # type: ignore[return-value]

    def alpha(self, rank: int, rank_key: str) -> float | None:
        part = self.parts.get("alpha")
        if part is None:
            return None
        t = self.tensors[part.key]
        if t.numel() != 1 or t.ndim > 1:
            raise self.fail(
                part.key,
                f"has shape {tuple(t.shape)}; alpha must be a scalar (rank {rank} from '{rank_key}')",
            )
        value = float(t.double())
        if not math.isfinite(value):
            raise self.fail(part.key, f"is {value}; alpha must be finite")
        return value

    def scale(self, rank: int, rank_key: str) -> float:
        if rank <= 0:
            raise self.fail(rank_key, "has rank 0")
        alpha = self.alpha(rank, rank_key)
        return 1.0 if alpha is None else alpha / rank

    def keys(self, *roles: str) -> tuple[str, ...]:
        return tuple(self.parts[r].key for r in roles if r in self.parts)

    # --- one builder per kind -------------------------------------------------

    def lora(self) -> list[LoraPatch]:
        if "up" not in self.parts or "down" not in self.parts:
            have, miss = ("up", "down") if "up" in self.parts else ("down", "up")
            raise self.fail(self.parts[have].key, f"has no matching lora {miss} factor")
        up, down = self.matrix("up"), self.matrix("down")
        kup, kdown = self.parts["up"].key, self.parts["down"].key
        rank = down.shape[0]
        if up.shape[1] != rank:
            raise self.fail(
                kup,
                f"has shape {tuple(up.shape)} but '{kdown}' has shape {tuple(down.shape)}: "
                f"up has {up.shape[1]} columns, down has {rank} rows (the rank)",
            )
        target = self.linear_target(kup)
        if (up.shape[0], down.shape[1]) != target:
            raise self.fail(
                kup,
                f"({tuple(up.shape)}) @ '{kdown}' ({tuple(down.shape)}) gives {(up.shape[0], down.shape[1])}, "
                f"but target {self.weight} is {target}",
            )
        scale = self.scale(rank, kdown)
        patches = [LoraPatch(self.weight, "lora", {"up": up, "down": down}, scale, self.keys("up", "down", "alpha"))]
        if "up_bias" in self.parts:
            patches.append(self.diff("up_bias", f"{self.module}.bias", scale))
        return patches

    def loha(self) -> list[LoraPatch]:
        missing = [r for r in _HADA if r not in self.parts]
        if missing:
            have = next(r for r in _HADA if r in self.parts)
            raise self.fail(self.parts[have].key, f"is a LoHa factor but {', '.join(missing)} are missing")
        m = {r: self.matrix(r) for r in _HADA}
        out, inp = self.linear_target(self.parts["hada_w1_a"].key)
        for a, b in (("hada_w1_a", "hada_w1_b"), ("hada_w2_a", "hada_w2_b")):
            ta, tb = m[a], m[b]
            if ta.shape[1] != tb.shape[0] or (ta.shape[0], tb.shape[1]) != (out, inp):
                raise self.fail(
                    self.parts[a].key,
                    f"has shape {tuple(ta.shape)} and '{self.parts[b].key}' {tuple(tb.shape)}: they must be "
                    f"(out, r) and (r, in) for target {self.weight} of shape {(out, inp)}",
                )
        scale = self.scale(m["hada_w1_b"].shape[0], self.parts["hada_w1_b"].key)
        factors = {r[len("hada_") :]: t for r, t in m.items()}
        return [LoraPatch(self.weight, "loha", factors, scale, self.keys(*_HADA, "alpha"))]

    def _lokr_side(self, stem: str) -> tuple[tuple[int, int], int | None]:
        full, a, b = f"lokr_{stem}", f"lokr_{stem}_a", f"lokr_{stem}_b"
        if full in self.parts:
            return tuple(self.matrix(full).shape), None  # type: ignore[return-value]
        if a in self.parts and b in self.parts:
            ta, tb = self.matrix(a), self.matrix(b)
            if ta.shape[1] != tb.shape[0]:
                raise self.fail(
                    self.parts[a].key,
                    f"has shape {tuple(ta.shape)} but '{self.parts[b].key}' has {tuple(tb.shape)}: inner dims differ",
                )
            return (ta.shape[0], tb.shape[1]), tb.shape[0]
        have = next(r for r in _LOKR if r in self.parts)
        raise self.fail(self.parts[have].key, f"is a LoKr factor but {full} (or {a} and {b}) is missing")

    def lokr(self) -> list[LoraPatch]:
        (a, b), rank1 = self._lokr_side("w1")
        (c, d), rank2 = self._lokr_side("w2")
        first = self.keys(*_LOKR)[0]
        target = self.linear_target(first)
        if (a * c, b * d) != target:
            raise self.fail(
                first, f"kron of w1 {(a, b)} and w2 {(c, d)} is {(a * c, b * d)}, but target {self.weight} is {target}"
            )
        rank, rank_key = (rank2, "lokr_w2_b") if rank2 is not None else (rank1, "lokr_w1_b")
        scale = 1.0 if rank is None else self.scale(rank, self.parts[rank_key].key)
        factors = {r[len("lokr_") :]: self.matrix(r) for r in _LOKR if r in self.parts}
        return [LoraPatch(self.weight, "lokr", factors, scale, self.keys(*_LOKR, "alpha"))]

    def diff(self, role: str, target: str, scale: float = 1.0) -> LoraPatch:
        key = self.parts[role].key
        t = self.tensor(role)
        if target not in self.shapes:
            raise self.fail(key, f"is a delta for {target}, which the target model does not have")
        if tuple(t.shape) != self.shapes[target]:
            raise self.fail(key, f"has shape {tuple(t.shape)} but target {target} is {self.shapes[target]}")
        return LoraPatch(target, "diff", {"diff": t}, scale, (key,))


def build_module(
    source: str,
    tensors: Mapping[str, torch.Tensor],
    shapes: Mapping[str, tuple[int, ...]],
    module_key: str,
    module: str,
    parts: Mapping[str, KeyPart],
    style: str,
) -> ModuleResult:
    """Build the patches of one LoRA module resolved to target ``module`` (see module doc)."""
    res = ModuleResult()
    for role, reason in _SKIP_MODULE.items():
        if role in parts:
            res.skipped = reason
            return res
    b = _Builder(source, tensors, shapes, module_key, module, parts)
    if parts.keys() & {"up", "down", "up_bias"}:
        if "up_bias" in parts and "up" not in parts:
            raise b.fail(parts["up_bias"].key, "is a lora_B bias without lora_B/lora_A weights")
        res.patches += b.lora()
        family = parts.get("up", parts.get("down")).family
        res.formats.add("kohya" if style == "kohya" else family)
    if parts.keys() & set(_HADA):
        res.patches += b.loha()
        res.formats.add("loha")
    if parts.keys() & set(_LOKR):
        res.patches += b.lokr()
        res.formats.add("lokr")
    if "diff" in parts:
        res.patches.append(b.diff("diff", b.weight))
        res.formats.add("diff")
    if "diff_b" in parts:
        res.patches.append(b.diff("diff_b", f"{module}.bias"))
        res.formats.add("diff")
    used = {k for p in res.patches for k in p.keys}
    if "set_weight" in parts:
        res.unused.append((parts["set_weight"].key, "set_weight (replace the weight) is not supported"))
    if "alpha" in parts and parts["alpha"].key not in used:
        res.unused.append((parts["alpha"].key, "alpha without low-rank factors"))
    return res
