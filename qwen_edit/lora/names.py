"""Mapping LoRA module names onto target weight names.

The target model is described only by ``target_shapes`` (weight name -> shape),
e.g. ``transformer_blocks.0.attn.to_q.weight -> (3072, 3072)``, so the same code
serves a 2-layer test model and the 60-layer DiT.

Two spellings are resolved:

* dotted (diffusers/DiffSynth names), optionally behind a wrapper prefix:
  ``transformer.``, ``diffusion_model.``, ``model.diffusion_model.``,
  ``base_model.model.`` (stripped repeatedly, at most three times);
* kohya/LyCORIS underscore names: ``lora_unet_``, ``lora_transformer_`` or
  ``lycoris_`` followed by the module name with every ``.`` written as ``_``
  (``lora_unet_transformer_blocks_0_img_mlp_net_0_proj``). Underscores are
  mapped back by building the underscore spelling of every target module and
  looking it up, never by guessing where dots were; a spelling two targets share
  is an error.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from .errors import LoraFormatError

__all__ = [
    "DOTTED_PREFIXES",
    "KOHYA_PREFIXES",
    "TargetIndex",
    "foreign_architecture",
    "guess_architecture",
    "kohya_name",
]

DOTTED_PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.", "model.")
KOHYA_PREFIXES = ("lora_unet_", "lora_transformer_", "lycoris_")

# (substring of a key, model family, whether it is another diffusion model rather than an encoder)
_ARCH_HINTS = (
    ("double_blocks", "FLUX (BFL names)", True),
    ("single_blocks", "FLUX (BFL names)", True),
    ("single_transformer_blocks", "FLUX (diffusers names)", True),
    ("ff_context", "FLUX (diffusers names)", True),
    ("norm1_context", "FLUX (diffusers names)", True),
    ("down_blocks", "Stable Diffusion / SDXL (UNet)", True),
    ("input_blocks", "Stable Diffusion / SDXL (UNet)", True),
    ("up_blocks", "Stable Diffusion / SDXL (UNet)", True),
    ("cross_attn", "Wan / a video DiT", True),
    ("context_refiner", "Lumina 2 / Z-Image", True),
    ("lora_te", "a CLIP text encoder", False),
    ("text_model", "a CLIP text encoder", False),
)


def kohya_name(module: str) -> str:
    """Underscore spelling of a dotted module name: ``attn.to_out.0`` -> ``attn_to_out_0``."""
    return module.replace(".", "_")


def _hints(keys: Iterable[str]):
    for key in keys:
        for needle, label, foreign in _ARCH_HINTS:
            if needle in key:
                yield key, label, foreign


def guess_architecture(keys: Iterable[str]) -> str | None:
    """Name the model family a set of LoRA keys looks made for, or None when unknown."""
    return next((label for _, label, _ in _hints(keys)), None)


def foreign_architecture(keys: Iterable[str]) -> tuple[str, str] | None:
    """``(family, example key)`` when some keys belong to another diffusion model's layers, else None.

    FLUX's diffusers names share ``transformer_blocks.N.attn.to_q`` (and its 3072
    width) with Qwen-Image, so a FLUX LoRA partly "matches"; its other keys give it away.
    """
    return next(((label, key) for key, label, foreign in _hints(keys) if foreign), None)


class TargetIndex:
    """Target weights of one model, indexed for LoRA name resolution.

    ``shapes`` maps every target tensor name to its shape (tuple of ints);
    ``modules`` is the set of module names owning a ``.weight`` target.
    """

    def __init__(self, target_shapes: Mapping[str, Sequence[int]]):
        self.shapes: dict[str, tuple[int, ...]] = {k: tuple(int(d) for d in v) for k, v in target_shapes.items()}
        self.modules: frozenset[str] = frozenset(k[: -len(".weight")] for k in self.shapes if k.endswith(".weight"))
        self._kohya: dict[str, str] = {}
        self._clashes: dict[str, list[str]] = {}
        for module in sorted(self.modules):
            spelled = kohya_name(module)
            if spelled in self._kohya:
                self._clashes.setdefault(spelled, [self._kohya[spelled]]).append(module)
            else:
                self._kohya[spelled] = module

    def resolve(self, module_key: str, source: str) -> tuple[str | None, str]:
        """Map a LoRA module key onto a target module.

        Returns ``(module, style)`` with style ``"dotted"`` or ``"kohya"``, or
        ``(None, "")`` when nothing matches. Raises LoraFormatError (naming
        ``source``) when an underscore spelling fits two target modules.
        """
        for candidate in self._dotted_candidates(module_key):
            if candidate in self.modules:
                return candidate, "dotted"
        for prefix in (*KOHYA_PREFIXES, ""):
            if not module_key.startswith(prefix):
                continue
            rest = module_key[len(prefix) :]
            if rest in self._clashes:
                raise LoraFormatError(
                    f"LoRA file {source}: key '{module_key}' is ambiguous, its underscore name fits "
                    f"{' and '.join(self._clashes[rest])}."
                )
            if rest in self._kohya:
                return self._kohya[rest], "kohya"
        return None, ""

    @staticmethod
    def _dotted_candidates(key: str) -> list[str]:
        out, frontier = [key], [key]
        for _ in range(3):
            frontier = [c[len(p) :] for c in frontier for p in DOTTED_PREFIXES if c.startswith(p)]
            out.extend(frontier)
        return out
