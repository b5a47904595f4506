"""What the runtime holds is released with the models it belongs to (ComfyUI's "free model and node cache")."""

from __future__ import annotations

import torch
from qwen_edit_hopper.qwen_edit.runtime import PlanRuntime
from qwen_edit_hopper.qwen_edit.sampling import Conditioning


def test_unloading_an_encoder_drops_the_conditioning_it_made():
    runtime = PlanRuntime("cpu", torch.float32)
    encoder = runtime.adopt(("text_encoder", "files"), torch.nn.Linear(2, 2), "text encoder")
    runtime.adopt(("dit", "files", None, 0), torch.nn.Linear(2, 2), "DiT")
    runtime.conditioning.put(("key",), Conditioning(positive={}, negative=None, edit_latents=[]))
    runtime.evict(("dit", "files", None, 0))
    assert runtime.conditioning.get(("key",)) is not None  # a DiT holds no conditioning
    runtime.evict(encoder.key)
    assert runtime.conditioning.get(("key",)) is None
    runtime.conditioning.put(("key",), Conditioning(positive={}, negative=None, edit_latents=[]))
    runtime.evict_all()
    assert runtime.conditioning.get(("key",)) is None and runtime.residents() == []
