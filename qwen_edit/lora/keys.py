"""Splitting LoRA state-dict keys into (module, role).

A key is ``<module><suffix>``; the suffix says which factor it holds. Roles:

====================  =================================================================
role                  suffixes
====================  =================================================================
``down`` / ``up``     ``.lora_down.weight`` / ``.lora_up.weight`` (kohya, Lightning),
                      ``.lora_A[.<adapter>].weight`` / ``.lora_B[.<adapter>].weight``
                      (diffusers/PEFT, adapter usually ``default``), ``.lora.down.weight``,
                      ``.lora_linear_layer.down.weight``
``up_bias``           ``.lora_B[.<adapter>].bias`` (PEFT ``lora_bias``)
``alpha``             ``.alpha``
``diff`` ``diff_b``   full weight / bias deltas (``.w_norm`` / ``.b_norm`` read the same)
``hada_*``            LyCORIS LoHa: ``hada_w1_a``, ``hada_w1_b``, ``hada_w2_a``, ``hada_w2_b``, ``hada_t1/t2``
``lokr_*``            LyCORIS LoKr: ``lokr_w1``, ``lokr_w2``, ``lokr_w1_a/_b``, ``lokr_w2_a/_b``, ``lokr_t2``
``mid`` ``dora_scale`` ``set_weight`` ``reshape_weight``   recognised, reported as skipped
====================  =================================================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["KeyPart", "split_key"]

_PEFT = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.(?P<param>weight|bias)$")

_SUFFIXES: tuple[tuple[str, str], ...] = tuple(
    sorted(
        {
            ".lora_down.weight": "down",
            ".lora_up.weight": "up",
            ".lora.down.weight": "down",
            ".lora.up.weight": "up",
            ".lora_linear_layer.down.weight": "down",
            ".lora_linear_layer.up.weight": "up",
            ".lora_mid.weight": "mid",
            ".alpha": "alpha",
            ".diff": "diff",
            ".diff_b": "diff_b",
            ".w_norm": "diff",
            ".b_norm": "diff_b",
            ".dora_scale": "dora_scale",
            ".set_weight": "set_weight",
            ".reshape_weight": "reshape_weight",
            **{f".hada_{n}": f"hada_{n}" for n in ("w1_a", "w1_b", "w2_a", "w2_b", "t1", "t2")},
            **{f".lokr_{n}": f"lokr_{n}" for n in ("w1", "w2", "w1_a", "w1_b", "w2_a", "w2_b", "t2")},
        }.items(),
        key=lambda item: -len(item[0]),
    )
)


@dataclass(frozen=True)
class KeyPart:
    """One key split: ``module`` (LoRA-side name), ``role`` (see module doc), ``adapter`` (PEFT only).

    ``family`` is ``"peft"`` for ``lora_A``/``lora_B`` keys, ``"lora_down/up"`` for the
    other low-rank spellings, ``"lycoris"`` for LoHa/LoKr and ``"other"`` otherwise.
    """

    key: str
    module: str
    role: str
    adapter: str | None = None
    family: str = "other"


def split_key(key: str) -> KeyPart | None:
    """Split ``key`` into module and role; None when the suffix is not a LoRA factor."""
    m = _PEFT.match(key)
    if m:
        role = "up" if m["ab"] == "B" else "down"
        if m["param"] == "bias":
            if role == "down":
                return None  # lora_A has no bias in any trainer we know
            role = "up_bias"
        return KeyPart(key, m["module"], role, m["adapter"], "peft")
    for suffix, role in _SUFFIXES:
        if key.endswith(suffix) and len(key) > len(suffix):
            family = "lora_down/up" if role in ("up", "down", "mid") else "other"
            if role.startswith(("hada_", "lokr_")):
                family = "lycoris"
            return KeyPart(key, key[: -len(suffix)], role, None, family)
    return None
