"""Lightning LoRA detection from file names and safetensors metadata."""

from __future__ import annotations

import pytest
from qwen_edit_hopper.qwen_edit.lora import detect_lightning, load_lora
from qwen_edit_hopper.qwen_edit.lora.testing import tiny_target_shapes, write_tiny_lora


@pytest.mark.parametrize(
    ("name", "steps"),
    [
        ("Qwen-Image-Edit-Lightning-4steps-V1.0-bf16.safetensors", 4),
        ("Qwen-Image-Edit-Lightning-8steps-V1.0.safetensors", 8),
        ("Qwen-Image-Lightning-8steps-V1.1.safetensors", 8),
        ("Qwen-Image-Lightning-4steps-V2.0.safetensors", 4),
        ("Qwen-Image-Edit-2509-Lightning-8steps-V1.0-fp32.safetensors", 8),
        ("Qwen-Image-Edit-2511-Lightning-4steps-V1.0-bf16.safetensors", 4),
        ("/models/loras/qwen/Qwen-Image-Lightning-8steps-V1.1.safetensors", 8),
        ("qwen_image_lightning_4_steps.safetensors", 4),
        ("my_style_lora.safetensors", None),
        ("/models/loras/Lightning/my_style_lora.safetensors", None),  # only the file name counts
        ("Qwen-Image-Lightning.safetensors", None),
        ("Qwen-Image-Lightning-4steps-8steps.safetensors", None),
        (None, None),
    ],
)
def test_file_names(name, steps):
    found, reason = detect_lightning(name)
    assert found == steps, reason
    assert reason


def test_reasons_say_why():
    assert detect_lightning("Qwen-Image-Lightning.safetensors")[1].endswith("gives no step count")
    assert "not a Lightning LoRA" in detect_lightning("style.safetensors")[1]
    assert "4-step" in detect_lightning("Qwen-Image-Edit-Lightning-4steps-V1.0-bf16.safetensors")[1]


def test_metadata_when_the_file_was_renamed():
    meta = {"modelspec.title": "Qwen-Image-Edit-Lightning-8steps-V1.0", "format": "pt"}
    assert detect_lightning("renamed.safetensors", meta)[0] == 8
    assert "metadata modelspec.title" in detect_lightning("renamed.safetensors", meta)[1]
    assert detect_lightning("renamed.safetensors", {"format": "pt"})[0] is None
    # The file name wins when it gives a count.
    assert detect_lightning("Qwen-Image-Lightning-4steps.safetensors", meta)[0] == 4


def test_parsed_lora_carries_detection(tmp_path):
    shapes = tiny_target_shapes(num_layers=1)
    path = tmp_path / "Qwen-Image-Edit-Lightning-4steps-V1.0-bf16.safetensors"
    write_tiny_lora(path, "lightning", shapes, rank=8, alpha=1.0)
    assert load_lora(path, shapes).lightning[0] == 4
    other = tmp_path / "renamed.safetensors"
    write_tiny_lora(other, "lightning", shapes, metadata={"ss_output_name": "qwen-image-lightning-8steps"})
    assert load_lora(other, shapes).lightning[0] == 8
