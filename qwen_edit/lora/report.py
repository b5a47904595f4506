"""What one LoRA file matched in the target model, for logs and the node's text output."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoraReport"]


def _first(items: tuple[str, ...], limit: int) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... (+{len(items) - limit})" if len(items) > limit else "")


@dataclass(frozen=True)
class LoraReport:
    """Matching result of one LoRA.

    ``formats``: the layouts found (``peft``, ``kohya``, ``lora_down/up``, ``loha``,
    ``lokr``, ``diff``). ``matched_keys``: file keys used. ``unmatched``:
    ``(key, reason)`` for keys that map to nothing. ``skipped``: ``(module key,
    reason)`` for recognised updates this library does not apply (DoRA, CP/Tucker
    factors, set_weight). ``targets``: target tensor names the LoRA changes.
    ``architecture_hint``: the model family unmatched keys look made for, if any.
    """

    source: str
    formats: tuple[str, ...]
    total_keys: int
    matched_keys: tuple[str, ...]
    unmatched: tuple[tuple[str, str], ...]
    skipped: tuple[tuple[str, str], ...]
    targets: tuple[str, ...]
    architecture_hint: str | None = None

    @property
    def partial(self) -> bool:
        """True when some keys of the file were not applied."""
        return bool(self.unmatched or self.skipped)

    @property
    def unmatched_keys(self) -> tuple[str, ...]:
        return tuple(key for key, _ in self.unmatched)

    def summary(self, limit: int = 3) -> str:
        """A few lines: formats, matched/total keys, targets touched, first unmatched and skipped."""
        lines = [
            f"{self.source}: {'+'.join(self.formats) or 'no known format'}, "
            f"{len(self.matched_keys)}/{self.total_keys} keys matched, {len(self.targets)} weights changed"
        ]
        if self.unmatched:
            reasons = sorted({reason for _, reason in self.unmatched})
            lines.append(
                f"  unmatched {len(self.unmatched)} keys ({'; '.join(reasons[:limit])}): "
                f"{_first(self.unmatched_keys, limit)}"
            )
            if self.architecture_hint:
                lines.append(f"  unmatched keys look made for {self.architecture_hint}")
        for module, reason in self.skipped[:limit]:
            lines.append(f"  skipped {module}: {reason}")
        if len(self.skipped) > limit:
            lines.append(f"  skipped {len(self.skipped) - limit} more modules")
        return "\n".join(lines)
