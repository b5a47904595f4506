"""Parsing a LoRA state dict into per-target patches for the Qwen-Image DiT.

Formats read (any mix, per module):

* diffusers / PEFT: ``<m>.lora_A[.default].weight``, ``<m>.lora_B[.default].weight``,
  optional ``<m>.alpha`` and ``<m>.lora_B[.default].bias``;
* kohya: ``lora_unet_<m with _>.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha``
  (also ``lora_transformer_`` and SimpleTuner's ``lycoris_``);
* dotted ``<m>.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha`` with diffusers
  names, as in the lightx2v Qwen-Image(-Edit)-Lightning files;
* full deltas ``<m>.diff`` / ``<m>.diff_b``;
* LyCORIS LoHa (``hada_w1_a`` ...) and LoKr (``lokr_w1``/``lokr_w2`` or their ``_a/_b``).

``<m>`` may carry a ``transformer.``, ``diffusion_model.``, ``model.diffusion_model.``
or ``base_model.model.`` prefix. Scale is ``alpha / rank`` when an alpha exists,
else 1.0. Names are resolved against the target shapes given by the caller
(see :class:`.names.TargetIndex`); nothing is dropped silently: every key is
either used, or reported as unmatched or skipped with a reason. A LoRA whose
keys match nothing, or whose unmatched keys are another diffusion model's
layers (FLUX shares ``transformer_blocks.N.attn.*`` names and widths with
Qwen-Image), is refused with LoraMatchError.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .builders import build_module
from .errors import LoraFormatError, LoraMatchError
from .files import load_safetensors
from .keys import KeyPart, split_key
from .lightning import detect_lightning
from .names import TargetIndex, foreign_architecture, guess_architecture
from .patches import LoraPatch
from .report import LoraReport

__all__ = ["ParsedLora", "load_lora", "parse_lora"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class ParsedLora:
    """A LoRA resolved against one target model.

    ``source``: file path (or label). ``patches``: one or more per target, in
    target-name order; factor tensors stay on the CPU in their stored dtype.
    ``report``: what matched. ``metadata``: the safetensors metadata.
    ``lightning``: ``(steps or None, reason)`` from :func:`.lightning.detect_lightning`.
    """

    source: str
    patches: tuple[LoraPatch, ...]
    report: LoraReport
    metadata: Mapping[str, str] = field(default_factory=dict)
    lightning: tuple[int | None, str] = (None, "not checked")

    @property
    def targets(self) -> tuple[str, ...]:
        """Target tensor names this LoRA changes, sorted."""
        return self.report.targets


def _group(state_dict: Mapping[str, torch.Tensor], source: str):
    groups: dict[str, dict[str, KeyPart]] = {}
    unmatched: list[tuple[str, str]] = []
    for key in state_dict:
        part = split_key(key)
        if part is None:
            unmatched.append((key, "not a LoRA factor key"))
            continue
        roles = groups.setdefault(part.module, {})
        if part.role in roles:
            other = roles[part.role]
            raise LoraFormatError(
                f"LoRA file {source}: keys '{other.key}' and '{key}' are both the {part.role} factor of "
                f"'{part.module}' (two PEFT adapters or two spellings in one file); keep one"
            )
        roles[part.role] = part
    return groups, unmatched


def parse_lora(
    state_dict: Mapping[str, torch.Tensor],
    target_shapes: Mapping[str, Sequence[int]] | TargetIndex,
    *,
    source: str = "<state dict>",
    metadata: Mapping[str, str] | None = None,
    file_name: str | None = None,
) -> ParsedLora:
    """Resolve a LoRA state dict against the target model.

    ``target_shapes`` maps target tensor names (e.g. ``transformer_blocks.0.attn.to_q.weight``)
    to shapes; biases may be included (needed for ``diff_b`` / ``lora_B.bias``).
    Returns a :class:`ParsedLora`. Raises LoraMatchError (naming ``source``)
    when no key maps onto the model or some keys are another diffusion model's
    layers, LoraFormatError for inconsistent tensors.
    """
    index = target_shapes if isinstance(target_shapes, TargetIndex) else TargetIndex(target_shapes)
    metadata = dict(metadata or {})
    groups, unmatched = _group(state_dict, source)
    patches: list[LoraPatch] = []
    skipped: list[tuple[str, str]] = []
    formats: set[str] = set()
    owner: dict[str, str] = {}
    for module_key in sorted(groups):
        parts = groups[module_key]
        module, style = index.resolve(module_key, source)
        if module is None:
            unmatched += [(p.key, "no such module in the target model") for p in parts.values()]
            continue
        res = build_module(source, state_dict, index.shapes, module_key, module, parts, style)
        if res.skipped:
            skipped.append((module_key, res.skipped))
        unmatched += res.unused
        formats |= res.formats
        for patch in res.patches:
            if owner.setdefault(patch.target, module_key) != module_key:
                raise LoraFormatError(
                    f"LoRA file {source}: modules '{owner[patch.target]}' and '{module_key}' both map to "
                    f"{patch.target}; the file mixes two spellings of one layer"
                )
        patches += res.patches
    patches.sort(key=lambda p: p.target)
    used = tuple(sorted(k for p in patches for k in p.keys))
    unmatched.sort()
    report = LoraReport(
        source=source,
        formats=tuple(sorted(formats)),
        total_keys=len(state_dict),
        matched_keys=used,
        unmatched=tuple(unmatched),
        skipped=tuple(skipped),
        targets=tuple(sorted({p.target for p in patches})),
        architecture_hint=guess_architecture(k for k, _ in unmatched),
    )
    if not patches:
        raise LoraMatchError(_no_match_message(report))
    foreign = foreign_architecture(k for k, _ in unmatched)
    if foreign:
        raise LoraMatchError(
            f"LoRA file {source}: it has {foreign[0]} layers (e.g. '{foreign[1]}'), so it is a LoRA for "
            f"another model; its {len(used)} keys that share Qwen-Image layer names would be applied to the "
            "wrong weights. Refused."
        )
    if report.partial:
        logger.warning("LoRA only partly applied:\n%s", report.summary())
    else:
        logger.info("%s", report.summary())
    lightning = detect_lightning(file_name or source, metadata)
    return ParsedLora(source, tuple(patches), report, metadata, lightning)


def _no_match_message(report: LoraReport) -> str:
    hint = f" Its keys look made for {report.architecture_hint}." if report.architecture_hint else ""
    first = ", ".join(report.unmatched_keys[:3]) or "(no keys)"
    skipped = "".join(f" Skipped {m}: {r}." for m, r in report.skipped[:3])
    return (
        f"LoRA file {report.source}: none of its {report.total_keys} keys matches a layer of this "
        f"Qwen-Image model (first keys: {first}).{hint}{skipped} Is it a LoRA for another model?"
    )


def load_lora(path: str | os.PathLike, target_shapes: Mapping[str, Sequence[int]] | TargetIndex) -> ParsedLora:
    """Read a .safetensors LoRA (header checked first) and resolve it against ``target_shapes``.

    Raises LoraFileError for unreadable or pickle files, LoraFormatError and
    LoraMatchError as :func:`parse_lora`.
    """
    path = Path(path)
    tensors, metadata = load_safetensors(path)
    return parse_lora(tensors, target_shapes, source=str(path), metadata=metadata, file_name=path.name)
