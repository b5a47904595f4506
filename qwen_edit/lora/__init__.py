"""LoRA formats for the Qwen-Image DiT and their exact, reversible fusion.

Typical use::

    shapes = shapes_of(dit)                              # or any name -> shape map
    loras = [(load_lora(p, shapes), s) for p, s in chain]  # user's chain order
    patcher = LoraPatcher(dit)
    patcher.apply(loras)        # W' = W + sum s * alpha/rank * B @ A, fp32 sum, one rounding
    patcher.clear()             # base weights back, bit for bit

Pure function form: ``fused_state(base_state, loras) -> {name: new tensor}``.
``detect_lightning(file_name, metadata)`` says whether a LoRA is a Lightning
4/8-step LoRA (the Sampler's "auto" scheduler and cfg follow it).
"""

from .errors import LoraError, LoraFileError, LoraFormatError, LoraMatchError
from .files import load_safetensors, read_lora_header
from .formats import ParsedLora, load_lora, parse_lora
from .fuse import LoraPatcher, fused_state, restore_weights, shapes_of, swap_weights
from .lightning import detect_lightning
from .names import TargetIndex, kohya_name
from .patches import LoraPatch
from .report import LoraReport

__all__ = [
    "LoraError",
    "LoraFileError",
    "LoraFormatError",
    "LoraMatchError",
    "LoraPatch",
    "LoraPatcher",
    "LoraReport",
    "ParsedLora",
    "TargetIndex",
    "detect_lightning",
    "fused_state",
    "kohya_name",
    "load_lora",
    "load_safetensors",
    "parse_lora",
    "read_lora_header",
    "restore_weights",
    "shapes_of",
    "swap_weights",
]
