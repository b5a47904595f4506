"""The real server loads the pack: every node listed with tooltips; bad values come back as node errors."""

from __future__ import annotations

import pytest
from comfy_server import PromptRejectedError

CATEGORY = "Qwen Edit Hopper"

EXPECTED_NODES = {
    "QwenEditHopper_Load": "Load Qwen Edit",
    "QwenEditHopper_Sampler": "Qwen Edit Sampler",
    "QwenEditHopper_Parallel": "Qwen Edit Parallel",
}


def pack_nodes(object_info: dict) -> dict:
    return {name: info for name, info in object_info.items() if info.get("category") == CATEGORY}


def test_object_info_lists_every_node_with_tooltips(comfy):
    nodes = pack_nodes(comfy.object_info())
    for node_id, display in EXPECTED_NODES.items():
        assert node_id in nodes, f"{node_id} not registered; got {sorted(nodes)}"
        assert nodes[node_id]["display_name"] == display
    for node_id, info in nodes.items():
        for section in ("required", "optional"):
            for name, spec in info["input"].get(section, {}).items():
                options = spec[1] if len(spec) > 1 else {}
                assert options.get("tooltip"), f"{node_id}.{name} has no tooltip"
        assert info.get("description"), f"{node_id} has no description"


def test_unknown_input_value_is_a_node_error_not_a_crash(comfy):
    prompt = {
        "1": {"class_type": "QwenEditHopper_Load", "inputs": {
            "diffusion_model": "no_such_file.safetensors", "text_encoder": "qwen_2.5_vl_7b.safetensors",
            "vae": "qwen_image_vae.safetensors", "diffusers_folder": "(none: use the three files)",
            "variant": "auto", "attention": "auto"}},
        "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 1]}},
    }
    with pytest.raises(PromptRejectedError) as rejected:
        comfy.queue(prompt)
    assert "1" in rejected.value.node_errors
    assert "diffusion_model 'no_such_file.safetensors' is not a file in models/diffusion_models" in (
        rejected.value.messages())
    assert comfy.get("/system_stats").ok
