"""ComfyUI core's Qwen-Image-Edit graph with Apply TE-FP8 and Compile Model on its MODEL, through a real server.

The shipped workflow ``qwen_edit_comfy_model_fp8`` is queued on a server of each ComfyUI version, with ComfyUI's own
loaders, ModelSamplingAuraFlow, KSampler, VAE nodes and LoraLoaderModelOnly. What a 2-core CPU machine cannot run is
changed, and only that:

- ComfyUI builds its Qwen-Image DiT and text encoder at the released widths whatever the file holds, so the files
  are full width with one block / one layer (tests/full_width_files.py) and the CLIPLoader is the test node
  ``QwenEditTest_TextEncoderLoader`` (ComfyUI's ``load_clip`` told the file's layer count);
- TextEncodeQwenImageEditPlus runs the 32-block vision tower and encodes the reference at 1 megapixel (4096 tokens
  for a 3072-wide block), so each prompt is CLIPTextEncode + ReferenceLatent of the VAEEncode'd picture: the same
  conditioning keys, without the picture's vision tokens;
- 2 steps, ``where_unsupported: emulate`` (no fp8 kernels on this CPU: the nodes say EMULATED).

Checked: the pack's MODEL runs under KSampler and stays close to ComfyUI's own path on the same graph (fp8 numerics,
not equal); a LoRA from LoraLoaderModelOnly changes the result and strength 0 gives the base back bit for bit.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from comfy_server import ComfyServer
from fixtures_server import guarded_server, running
from prompts import emulating, read_image, write_image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from workflows import DIT, INPUT_IMAGE, TEXT_ENCODER_FP8  # noqa: E402

WORKFLOW = "qwen_edit_comfy_model_fp8"
TEST_NODES = ROOT / "tests" / "comfy_nodes" / "qwen_edit_test_text_encoder"
LORA = "full_width_lora.safetensors"
LORA_STRENGTH = 8.0
"""The LoRA's up factors are drawn small (bench/full_size_files.py); at 8 its effect on 2 steps of a one-block DiT
is about 10x the fp8 error."""
STEPS = 2
PROMPT_TIMEOUT_S = 900  # the pack's first prompt compiles a 3072-wide block on the CPU


@pytest.fixture(scope="session")
def full_width_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model set (its VAE, pictures) with the DiT and fp8_scaled text encoder replaced by full-width
    one-block files of the same names, and a rank-4 LoRA for that DiT."""
    from fixtures_models import install_tiny_models
    from full_width_files import write_full_width_files, write_full_width_lora

    models = tmp_path_factory.mktemp("full_width") / "models"
    install_tiny_models(models)
    write_full_width_files(models, DIT, TEXT_ENCODER_FP8)
    write_full_width_lora(models / "loras" / LORA)
    return models


@pytest.fixture(scope="module")
def core_comfy(tmp_path_factory: pytest.TempPathFactory, comfyui_version: str,
               full_width_models: Path) -> ComfyServer:
    base = tmp_path_factory.mktemp(f"comfy_core_model-{comfyui_version}")
    (base / "models").symlink_to(full_width_models, target_is_directory=True)
    server = guarded_server(base, comfyui_version)
    server.extra_custom_nodes = (TEST_NODES,)
    with running(server):
        write_image(server.input_dir / INPUT_IMAGE, 64, 48, seed=5)
        yield server


def cpu_prompt(*, pack: bool, seed: int = 7, lora_strength: float | None = None, prefix: str = "t") -> dict:
    """The shipped API twin with the changes of the module docstring; ``pack=False`` drops Apply TE-FP8 and
    Compile Model (ComfyUI's own path on the same graph); a LoraLoaderModelOnly after the UNETLoader when
    ``lora_strength`` is given; a SaveLatent of KSampler's output."""
    prompt = emulating(json.loads((ROOT / "example_workflows" / "api" / f"{WORKFLOW}.json").read_text()))
    by_type = {node["class_type"]: node_id for node_id, node in prompt.items()}
    clip, sampler = by_type["CLIPLoader"], by_type["KSampler"]
    prompt[clip] = {"class_type": "QwenEditTest_TextEncoderLoader", "inputs": {
        "clip_name": prompt[clip]["inputs"]["clip_name"], "layers": 1, "intermediate": 128}}
    encodes = [i for i, n in prompt.items() if n["class_type"] == "TextEncodeQwenImageEditPlus"]
    latent = prompt[sampler]["inputs"]["latent_image"]
    for index, node_id in enumerate(encodes):
        text_id = f"{100 + index}"
        prompt[text_id] = {"class_type": "CLIPTextEncode",
                           "inputs": {"text": prompt[node_id]["inputs"]["prompt"], "clip": [clip, 0]}}
        prompt[node_id] = {"class_type": "ReferenceLatent", "inputs": {"conditioning": [text_id, 0],
                                                                      "latent": latent}}
    prompt[sampler]["inputs"].update(steps=STEPS, seed=seed)
    if not pack:
        sampling = by_type["ModelSamplingAuraFlow"]
        del prompt[by_type["QwenEditHopper_ApplyFP8"]], prompt[by_type["QwenEditHopper_Compile"]]
        prompt[sampler]["inputs"]["model"] = [sampling, 0]
    if lora_strength is not None:
        sampling = prompt[by_type["ModelSamplingAuraFlow"]]
        prompt["110"] = {"class_type": "LoraLoaderModelOnly", "inputs": {
            "model": sampling["inputs"]["model"], "lora_name": LORA, "strength_model": lora_strength}}
        sampling["inputs"]["model"] = ["110", 0]
    prompt["120"] = {"class_type": "SaveLatent", "inputs": {"samples": [sampler, 0], "filename_prefix": prefix}}
    prompt[by_type["SaveImage"]]["inputs"]["filename_prefix"] = prefix
    return prompt


def run_latent(server: ComfyServer, prompt: dict):
    """Run ``prompt``; return (KSampler's latent as saved by SaveLatent, the history entry, seconds)."""
    import torch
    from safetensors.torch import load_file

    started = time.monotonic()
    entry = server.run(prompt, timeout=PROMPT_TIMEOUT_S)
    seconds = time.monotonic() - started
    (latent_path,) = server.output_files(entry, "latents")
    images = server.output_files(entry)
    assert images and all(read_image(p).std() > 0 for p in images)
    latent = load_file(latent_path)["latent_tensor"].to(torch.float32)
    assert torch.isfinite(latent).all()
    return latent, entry, seconds


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def test_fp8_model_under_ksampler_is_close_to_comfyuis_own_path(core_comfy: ComfyServer):
    reference, _, core_s = run_latent(core_comfy, cpu_prompt(pack=False, prefix="core"))
    latent, _, pack_s = run_latent(core_comfy, cpu_prompt(pack=True, prefix="pack"))
    error = _rel(latent, reference)
    assert 1e-4 < error < 6e-2, error  # fp8 numerics: close to ComfyUI's own path, not equal to it
    history = json.dumps(core_comfy.get("/history").json())
    assert "FP8 on ComfyUI's Qwen-Image MODEL" in history  # Apply TE-FP8's report
    assert "EMULATED: cudnn_fp8 cannot run here" in history  # no Hopper here: attention runs its mirror, said
    assert "regional (each transformer block of the MODEL compiled" in history  # Compile Model's info
    assert "block: pack fused" in history  # the shipped workflow runs the pack's fused block on ComfyUI's blocks
    assert "fused block: ComfyUI's own block runs" not in core_comfy.log_tail(10**8)  # and never fell back
    # the positive and negative texts differ in length: padded into one batch-2 call per step
    assert "text padding: texts of" in core_comfy.log_tail(10**8)
    # every attention call of ComfyUI's forward went to the pack's backend (a call it cannot take is logged)
    assert "ComfyUI's own attention runs this call" not in core_comfy.log_tail(10**8)
    print(f"core {core_s:.1f} s, pack {pack_s:.1f} s, relative error {error:.2e}")


def test_a_lora_on_the_model_is_applied_and_strength_zero_gives_the_base_back(core_comfy: ComfyServer):
    import torch

    base, _, _ = run_latent(core_comfy, cpu_prompt(pack=True, seed=11, prefix="base"))
    strong, _, _ = run_latent(core_comfy, cpu_prompt(pack=True, seed=11, lora_strength=LORA_STRENGTH,
                                                     prefix="lora"))
    zero, _, _ = run_latent(core_comfy, cpu_prompt(pack=True, seed=11, lora_strength=0.0, prefix="lora0"))
    reference, _, _ = run_latent(core_comfy, cpu_prompt(pack=False, seed=11, lora_strength=LORA_STRENGTH,
                                                        prefix="corelora"))
    effect, error = _rel(strong, base), _rel(strong, reference)
    # the LoRA reached the fp8 layers as ComfyUI applies it: its effect stands well above the fp8 numerics
    assert error < effect / 3, (error, effect)
    assert torch.equal(zero, base)  # strength 0: the quantized base, bit for bit
    print(f"LoRA effect {effect:.2e}, against ComfyUI's own path with the LoRA {error:.2e}")


def test_a_model_it_cannot_honour_is_refused_naming_it_and_the_next_prompt_runs(core_comfy: ComfyServer):
    from prompts import TEXT_ENCODER, loader
    from qwen_edit_hopper.qwen_edit.tiny import dit_file_name
    from server_checks import failing_node, rejected

    fp8_weights = cpu_prompt(pack=True, seed=13, prefix="fp8_weights")
    unet = next(n for n in fp8_weights.values() if n["class_type"] == "UNETLoader")
    unet["inputs"]["weight_dtype"] = "fp8_e4m3fn"
    node, message = failing_node(core_comfy, fp8_weights)
    assert node == "QwenEditHopper_ApplyFP8"
    assert "float8_e4m3fn" in message and "weight_dtype 'default'" in message

    both = cpu_prompt(pack=True, seed=13, prefix="both_inputs")
    both["130"] = loader(dit=dit_file_name("edit"), text_encoder=TEXT_ENCODER)  # a tiny pack pipe
    next(n for n in both.values() if n["class_type"] == "QwenEditHopper_ApplyFP8")["inputs"]["pipe"] = ["130", 0]
    node, message = failing_node(core_comfy, both)
    assert node == "QwenEditHopper_ApplyFP8" and "pipe / model: connect exactly one" in message

    unknown_block = cpu_prompt(pack=True, seed=13, prefix="unknown_block")
    next(n for n in unknown_block.values() if n["class_type"] == "QwenEditHopper_ApplyFP8")["inputs"][
        "model_block"] = "fused"
    message = rejected(core_comfy, unknown_block)  # refused before anything is loaded
    assert "model_block" in message and "fused" in message

    reference, _, _ = run_latent(core_comfy, cpu_prompt(pack=False, seed=13, prefix="after_core"))
    latent, _, _ = run_latent(core_comfy, cpu_prompt(pack=True, seed=13, prefix="after_pack"))
    assert 1e-4 < _rel(latent, reference) < 6e-2
