"""Deriving DiT variants from the base: LoRA state, FP8 copies, compile state.

LoRAs are fused *in place* into the base bf16 weights, one transformer block
at a time (no second copy of the model on the GPU); the original tensors of
every touched weight are kept on the CPU and copied back bit for bit when the
chain changes. The parameters stay the same objects, so a compiled graph sees
new weight values, not new inputs: changing a LoRA or its strength never
recompiles.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from .memory import Resident
from .plan import CompileChoice, LoraChoice

logger = logging.getLogger(__name__)


def _lora_identity(lora: LoraChoice) -> tuple:
    stat = Path(lora.path).stat()
    return (str(Path(lora.path).resolve()), stat.st_size, stat.st_mtime_ns)


def parse_lora_for(base: Resident, lora: LoraChoice):
    """The LoRA parsed against the base DiT's weight names and shapes (cached per file)."""
    from .lora import load_lora, shapes_of

    cache: dict[tuple, Any] = base.extra.setdefault("parsed_loras", {})
    key = _lora_identity(lora)
    if key not in cache:
        cache[key] = load_lora(lora.path, shapes_of(base.module))
    return cache[key]


def _chain_key(loras: tuple[LoraChoice, ...]) -> tuple:
    return tuple((_lora_identity(lora), float(lora.strength)) for lora in loras)


def _restricted(parsed, names: set[str]):
    return dataclasses.replace(parsed, patches=tuple(p for p in parsed.patches if p.target in names))


@torch.no_grad()
def restore_base(base: Resident) -> None:
    """Copy the saved original weights back into the base (exact; no-op when nothing is fused)."""
    originals: dict[str, torch.Tensor] = base.extra.get("lora_originals", {})
    params = dict(base.module.named_parameters())
    for name, original in originals.items():
        params[name].data.copy_(original, non_blocking=False)
    originals.clear()
    base.extra["lora_chain"] = ()


@torch.no_grad()
def ensure_loras(base: Resident, loras: tuple[LoraChoice, ...]) -> set[str]:
    """Make the base DiT hold exactly ``W + sum strength * scale * B @ A`` for this chain (or plain W).

    Returns the names of the weights whose values changed (touched by the old or the new chain).
    """
    from .lora import fused_state

    wanted = _chain_key(loras)
    if base.extra.get("lora_chain", ()) == wanted:
        return set()
    changed = set(base.extra.get("lora_originals", {}))
    restore_base(base)
    if not loras:
        return changed
    parsed = [(parse_lora_for(base, lora), lora.strength) for lora in loras]
    params = dict(base.module.named_parameters())
    touched = sorted({target for lora, _ in parsed for target in lora.targets})
    originals: dict[str, torch.Tensor] = base.extra.setdefault("lora_originals", {})
    for group in _groups(touched):
        names = set(group)
        chain = [(_restricted(lora, names), strength) for lora, strength in parsed]
        fused = fused_state({name: params[name] for name in group}, chain)
        for name, tensor in fused.items():
            originals[name] = params[name].detach().to("cpu", copy=True)
            params[name].data.copy_(tensor)
        del fused
    base.extra["lora_chain"] = wanted
    logger.info("fused %d LoRA(s) into %d weights", len(loras), len(originals))
    return changed | set(originals)


def _groups(names: list[str]) -> list[list[str]]:
    """Weights grouped by transformer block (``transformer_blocks.N.``), the rest alone."""
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] == "transformer_blocks" else name
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def fp8_variant_key(base_key: tuple, fp8_config: Any) -> tuple:
    """FP8 variants are keyed by base and recipe; their LoRA state is updated in place (see ``sync_fp8_loras``)."""
    return ("dit_fp8", base_key, fp8_config)


def chain_key(loras: tuple[LoraChoice, ...]) -> tuple:
    return _chain_key(loras)


@torch.no_grad()
def sync_fp8_loras(variant: Resident, base: Resident, loras: tuple[LoraChoice, ...]) -> bool:
    """Bring an FP8 variant to this LoRA chain by re-quantizing the changed weights in place.

    Same tensors, new values: a compiled graph over the variant does not recompile. Returns False when
    the variant cannot be updated in place (Transformer Engine layers): the caller rebuilds it.
    """
    from .fp8_dit import requantize_in_place

    wanted = _chain_key(loras)
    if variant.extra.get("lora_chain", ()) == wanted:
        return True
    changed = ensure_loras(base, loras)
    if not requantize_in_place(variant.module, base.module, changed):
        return False
    variant.extra["lora_chain"] = wanted
    return True


def apply_compile(resident: Resident, choice: CompileChoice | None) -> None:
    """Switch the module's transformer blocks to the compiled callables for ``choice`` (or to eager)."""
    from .compile import set_regional_compile

    set_regional_compile(resident, choice)


def make_fp8_variant(base_module: torch.nn.Module, fp8_config: Any) -> torch.nn.Module:
    """A new DiT whose selected linears are FP8 (weights quantized from the base's current, LoRA-fused values)."""
    from .fp8_dit import build_fp8_dit

    return build_fp8_dit(base_module, fp8_config)
