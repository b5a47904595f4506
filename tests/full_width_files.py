"""Qwen-Image-Edit files ComfyUI core's own loaders take, as small as those loaders allow, for CPU server tests.

ComfyUI's UNETLoader builds a Qwen-Image DiT at the released width whatever the file holds (its detection
reads only ``in_channels`` and the block count), and its Qwen2.5-VL text encoder has the 7B sizes built in.
So these files have the released widths and one block / one layer:

- ``diffusion_models/<dit_name>``: the Comfy-Org bf16 DiT layout, 1 transformer block at width 3072 (0.76 GB);
- ``text_encoders/<text_encoder_name>``: ComfyUI's fp8_scaled Qwen2.5-VL layout, hidden size 3584 (the DiT's
  text width), 1 decoder layer with a 128-wide MLP, the full 152064-token embedding (the tokenizer's special
  tokens sit at its end), 1 vision block (1.19 GB). ComfyUI builds its text encoder to match only when told,
  through the model option ``qwen25_7b_model_config`` (tests/comfy_nodes/qwen_edit_test_text_encoder); the other
  vision blocks stay unloaded, so prompts must not carry pictures to it;
- a rank-4 LoRA for that DiT (:func:`write_full_width_lora`).

Written with bench/full_size_files.py's writer and value rule, on the CPU, in under a minute on 2 cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from full_size_files import dit_entries, lora_entries, text_encoder_entries, write_file  # noqa: E402

TEXT_LAYERS = 1
TEXT_INTERMEDIATE = 128
TEXT_MODEL_CONFIG = {"num_hidden_layers": TEXT_LAYERS, "intermediate_size": TEXT_INTERMEDIATE}
"""What ComfyUI's ``Qwen25_7BVLI_Config`` must be told to match the text encoder file."""


def dit_config():
    """The DiT's sizes: the released widths, one transformer block."""
    from qwen_edit_hopper.qwen_edit.checkpoints.dit import DiTConfig

    return DiTConfig(dim=3072, num_layers=1, num_heads=24, head_dim=128, text_dim=3584)


def write_full_width_files(models: Path, dit_name: str, text_encoder_name: str) -> dict[str, Path]:
    """Write the two files of the module docstring under ComfyUI ``models`` folder ``models``; return their paths."""
    from qwen_edit_hopper.qwen_edit.checkpoints.text_encoder import TextEncoderConfig

    text_config = TextEncoderConfig(num_layers=TEXT_LAYERS, intermediate_size=TEXT_INTERMEDIATE, vision_depth=1,
                                    vision_fullatt_block_indexes=(0,))
    cpu = torch.device("cpu")
    dit = models / "diffusion_models" / dit_name
    text_encoder = models / "text_encoders" / text_encoder_name
    write_file(dit, dit_entries(dit_config(), "bf16"), cpu, seed=1)
    write_file(text_encoder, text_encoder_entries(text_config), cpu, seed=2)
    return {"dit": dit, "text_encoder": text_encoder}


def write_full_width_lora(path: Path, rank: int = 4) -> Path:
    """A LoRA in the lightx2v layout on every 2-D weight of the DiT's block (alpha = rank), for ComfyUI's
    LoraLoaderModelOnly."""
    write_file(path, lora_entries(dit_config(), rank), torch.device("cpu"), seed=3)
    return path
