"""Layer-selection presets: which linears get fp8 compute, fp8 storage, or stay bf16.

A :class:`LayerPreset` is name-pattern based, so ``fp8/`` stays model-agnostic:
patterns are regular expressions matched against a linear's qualified name at a
dot boundary (``(?:.*\\.)?PATTERN`` must match the whole name), so a prefix such
as ``diffusion_model.`` or ``dit.`` in front of the model's own names is fine.

Roles, checked in this order:

1. ``keep``: (pattern, reason) pairs kept bf16 with that reason.
2. ``compute``: fp8 compute with the configured backend.
3. ``storage``: fp8 weight storage with per-channel scales, bf16 compute
   (``Fp8Config.storage_layers="bf16"`` keeps them untouched instead).
4. anything else: kept, "not selected by preset <name>".

Shipped presets use the Qwen-Image DiT names (DiffSynth ``qwen_image_dit.py``,
identical to diffusers): ``transformer_blocks.N.attn.{to_q,to_k,to_v,add_q_proj,
add_k_proj,add_v_proj,to_out.0,to_add_out}``, ``transformer_blocks.N.{img_mlp,
txt_mlp}.net.0.proj`` / ``.net.2``, modulation ``transformer_blocks.N.{img_mod,
txt_mod}.1`` (a third of all weights, applied to one timestep vector), and
``img_in``, ``txt_in``, ``time_text_embed.*``, ``norm_out.linear``, ``proj_out``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

__all__ = ["DEFAULT_PRESET", "PRESETS", "LayerPreset", "get_preset", "preset_names"]

ROLE_COMPUTE = "compute"
ROLE_STORAGE = "storage"
ROLE_KEEP = "keep"


def _compile(field_name: str, pattern: object) -> re.Pattern[str]:
    if not isinstance(pattern, str) or not pattern:
        raise TypeError(f"{field_name} patterns must be non-empty strings, got {pattern!r}")
    try:
        return re.compile(rf"(?:.*\.)?(?:{pattern})")
    except re.error as ex:
        raise ValueError(f"{field_name} pattern {pattern!r} is not a valid regular expression: {ex}") from ex


@dataclass(frozen=True)
class LayerPreset:
    """A named, pattern-based choice of layers (see the module docstring for roles).

    name / description: shown in reports and node menus.
    compute: patterns of linears computed in fp8 by the configured backend.
    storage: patterns of linears stored in fp8 (per-channel scales), bf16 compute.
    keep: (pattern, reason) pairs of linears kept bf16, reported with that reason.
    """

    name: str
    description: str
    compute: tuple[str, ...]
    storage: tuple[str, ...] = ()
    keep: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("LayerPreset.name must be a non-empty string")
        for field_name in ("compute", "storage", "keep"):
            if not isinstance(getattr(self, field_name), tuple):
                raise TypeError(f"LayerPreset.{field_name} must be a tuple")
        for pattern in self.compute:
            _compile("LayerPreset.compute", pattern)
        for pattern in self.storage:
            _compile("LayerPreset.storage", pattern)
        for item in self.keep:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], str)):
                raise TypeError(f"LayerPreset.keep entries must be (pattern, reason) pairs, got {item!r}")
            _compile("LayerPreset.keep", item[0])

    @cached_property
    def _compiled(self) -> tuple:
        return (
            tuple((_compile("keep", p), reason) for p, reason in self.keep),
            tuple(_compile("compute", p) for p in self.compute),
            tuple(_compile("storage", p) for p in self.storage),
        )

    def classify(self, qualified_name: str) -> tuple[str, str]:
        """Return ``(role, reason)`` for a linear's qualified name; role is compute, storage or keep."""
        keep, compute, storage = self._compiled
        for rx, reason in keep:
            if rx.fullmatch(qualified_name):
                return ROLE_KEEP, reason
        if any(rx.fullmatch(qualified_name) for rx in compute):
            return ROLE_COMPUTE, f"fp8 compute (preset {self.name})"
        if any(rx.fullmatch(qualified_name) for rx in storage):
            return ROLE_STORAGE, f"fp8 storage, bf16 compute (preset {self.name})"
        return ROLE_KEEP, f"not selected by preset {self.name!r}"


_BLOCK = r"transformer_blocks\.\d+"
QWEN_ATTN = (_BLOCK + r"\.attn\.(?:to_q|to_k|to_v|to_qkv|add_q_proj|add_k_proj|add_v_proj|add_qkv_proj|to_out\.0"
             r"|to_add_out)")
QWEN_MLP = _BLOCK + r"\.(?:img_mlp|txt_mlp)\.net\.(?:0\.proj|2)"
QWEN_MOD = _BLOCK + r"\.(?:img_mod|txt_mod)\.1"
QWEN_ANY_BLOCK_LINEAR = _BLOCK + r"\..+"
QWEN_KEEP: tuple[tuple[str, str], ...] = (
    (r"img_in|txt_in", "input embedding kept bf16"),
    (r"time_text_embed\..+", "timestep embedding kept bf16"),
    (r"norm_out\..+", "final norm kept bf16"),
    (r"proj_out", "output projection kept bf16"),
)

DEFAULT_PRESET = "attn+mlp"

PRESETS: dict[str, LayerPreset] = {
    p.name: p
    for p in (
        LayerPreset(
            name="attn+mlp",
            description="default: attention projections and MLP linears of both streams in fp8; "
            "modulation stored fp8 with bf16 compute; embeddings, norms and output bf16",
            compute=(QWEN_ATTN, QWEN_MLP),
            storage=(QWEN_MOD,),
            keep=QWEN_KEEP,
        ),
        LayerPreset(
            name="attn+mlp+mod compute",
            description="attention, MLP and modulation linears in fp8 compute",
            compute=(QWEN_ATTN, QWEN_MLP, QWEN_MOD),
            keep=QWEN_KEEP,
        ),
        LayerPreset(
            name="mlp only",
            description="MLP linears of both streams in fp8 compute; modulation stored fp8; attention bf16",
            compute=(QWEN_MLP,),
            storage=(QWEN_MOD,),
            keep=QWEN_KEEP,
        ),
        LayerPreset(
            name="all linears in blocks",
            description="every linear inside transformer_blocks (modulation included) in fp8 compute",
            compute=(QWEN_ANY_BLOCK_LINEAR,),
            keep=QWEN_KEEP,
        ),
    )
}


def preset_names() -> tuple[str, ...]:
    """Names of the registered presets, default first."""
    return tuple(PRESETS)


def get_preset(name: str) -> LayerPreset:
    """Return the registered preset ``name``; ValueError lists the allowed names."""
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"preset={name!r} is not allowed; allowed values: {', '.join(PRESETS)}") from None
