"""DiffSynth's ``QwenImageTextEncoder`` with a config from :class:`~.text_encoder.TextEncoderConfig`.

Imported only when a text encoder is built (it imports DiffSynth and transformers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from diffsynth.models.qwen_image_text_encoder import QwenImageTextEncoder
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

from .materialize import meta_device

if TYPE_CHECKING:  # annotations only: .text_encoder imports this module when it builds a model
    from .text_encoder import TextEncoderConfig

# Qwen2.5-VL special tokens (the tokenizer's ids; the vocabulary must cover them).
BOS_TOKEN_ID = 151643
EOS_TOKEN_ID = 151645
VISION_START_TOKEN_ID = 151652
VISION_END_TOKEN_ID = 151653
VISION_TOKEN_ID = 151654
IMAGE_TOKEN_ID = 151655
VIDEO_TOKEN_ID = 151656


def hf_config(config: TextEncoderConfig) -> Qwen2_5_VLConfig:
    """The transformers config DiffSynth would use, at ``config`` size."""
    text = {
        **config.hf_text_sizes(),
        "max_position_embeddings": 128000,
        "max_window_layers": config.num_layers,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "tie_word_embeddings": False,
    }
    vision = {
        **config.hf_vision_sizes(),
        "in_channels": config.vision_in_channels,
        "tokens_per_second": 2,
        "hidden_act": "silu",
    }
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_TOKEN_ID,
        vision_end_token_id=VISION_END_TOKEN_ID,
        vision_token_id=VISION_TOKEN_ID,
        tie_word_embeddings=False,
    )


class SizedQwenImageTextEncoder(QwenImageTextEncoder):
    """``QwenImageTextEncoder`` (``model`` = ``Qwen2_5_VLModel``) at any size, without ``lm_head``.

    ``forward`` is DiffSynth's: it returns the tuple of hidden states
    ``[B, S, hidden_size]`` per layer and never reads ``lm_head`` (vocab x hidden, 1.09 GB
    in bf16 at 7B), which is therefore not built. Parameters are created on ``meta``; the
    rotary-embedding buffers are built on CPU.

    Attributes:
        config: the transformers ``Qwen2_5_VLConfig`` (as in DiffSynth).
        encoder_config: the :class:`TextEncoderConfig` it was built from.
    """

    def __init__(self, config: TextEncoderConfig):
        torch.nn.Module.__init__(self)
        hf = hf_config(config)
        with meta_device():
            self.model = Qwen2_5_VLModel(hf)
        self.config = hf
        self.encoder_config = config
        rebuild_meta_buffers(self)


def rebuild_meta_buffers(model: torch.nn.Module) -> None:
    """Rebuild, on CPU, every submodule whose buffers are on ``meta`` (the rotary embeddings).

    transformers' rotary modules are constructed from their ``config`` alone.
    """
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            if not hasattr(module, "config"):
                raise RuntimeError(f"cannot rebuild meta buffers of {name} ({type(module).__name__})")
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, type(module)(module.config))
