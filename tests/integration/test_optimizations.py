"""Fuse LoRA, Apply TE-FP8 and Compile Model through the real server on the tiny checkpoints."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from comfy_server import PromptFailedError, PromptRejectedError
from fixtures_models import FORMAT_LORAS, LIGHTNING_LORAS
from prompts import DIT, TEXT_ENCODER, VAE, apply_fp8, compile_model, edit_prompt, fuse_lora, read_image, write_image
from qwen_edit_hopper.qwen_edit.metrics import psnr


@pytest.fixture(scope="module")
def picture(comfy) -> str:
    return write_image(comfy.input_dir / "optimizations.png", 80, 64, seed=4)


def run_image(comfy, picture, chain=(), **kwargs) -> np.ndarray:
    entry = comfy.run(edit_prompt(picture, chain=list(chain), **kwargs))
    return read_image(comfy.output_files(entry)[0])


def run_texts(comfy, picture, chain=(), **kwargs) -> tuple[np.ndarray, str]:
    entry = comfy.run(edit_prompt(picture, chain=list(chain), **kwargs))
    texts = " ".join(t for out in entry["outputs"].values() for t in out.get("text", []))
    return read_image(comfy.output_files(entry)[0]), texts


def db(a: np.ndarray, b: np.ndarray) -> float:
    return psnr(torch.from_numpy(a / 255.0), torch.from_numpy(b / 255.0))


@pytest.fixture(scope="module")
def base_image(comfy, picture) -> np.ndarray:
    return run_image(comfy, picture, seed=5)


def reference_with_deltas(comfy, lora_name: str, strength: float, picture_path) -> np.ndarray:
    """The edit computed in this process with W + strength * scale * B @ A set by hand (the math reference).

    It computes in the server's dtype (``compute_dtype``: float32 on this CPU server), so the two differ only by
    where the LoRA delta was added.
    """
    from PIL import Image
    from qwen_edit_hopper.qwen_edit.checkpoints.layouts import resolve_single_files
    from qwen_edit_hopper.qwen_edit.compute_dtype import compute_dtype
    from qwen_edit_hopper.qwen_edit.edit import run_edit
    from qwen_edit_hopper.qwen_edit.lora import load_lora, shapes_of
    from qwen_edit_hopper.qwen_edit.plan import PipePlan, Variant
    from qwen_edit_hopper.qwen_edit.runtime import PlanRuntime
    from qwen_edit_hopper.qwen_edit.sampling import EditRequest
    from tiny_models import tokenizer_dir

    models = comfy.models_dir
    files = resolve_single_files(dit=models / "diffusion_models" / DIT, text_encoder=models / "text_encoders" /
                                 TEXT_ENCODER, vae=models / "vae" / VAE)
    runtime = PlanRuntime("cpu", compute_dtype("cpu"), comfy_tokenizer_dir=tokenizer_dir())
    plan = PipePlan(files=files, variant=Variant.EDIT_2509, variant_reason="test")
    with torch.inference_mode():
        dit = runtime.dit(plan).module
        parsed = load_lora(models / "loras" / lora_name, shapes_of(dit))
        params = dict(dit.named_parameters())
        for patch in parsed.patches:
            weight = params[patch.target]
            weight.copy_((weight.float() + strength * patch.delta("cpu")).to(weight.dtype))
        image = Image.open(picture_path).convert("RGB")
        request = EditRequest(images=(image,), prompt="make it red", negative_prompt=" ", seed=5, steps=2, cfg=4.0,
                              width=64, height=48, reference_pixels=int(0.01 * 2**20))
        out, _ = run_edit(runtime, plan, request)
    return (out[0].numpy() * 255).round().astype(np.uint8)


@pytest.mark.parametrize("fmt", FORMAT_LORAS)
def test_each_lora_format_fuses_to_the_reference_and_removal_restores_the_base(comfy, picture, base_image, fmt):
    name = f"tiny_{fmt}.safetensors"
    fused, _texts = run_texts(comfy, picture, [fuse_lora(name, 1.5)], seed=5)
    assert not np.array_equal(fused, base_image), "the LoRA changed nothing"
    reference = reference_with_deltas(comfy, name, 1.5, comfy.input_dir / picture)
    assert db(fused, reference) > 40, f"{fmt}: server image differs from W + s*scale*B@A (PSNR {db(fused, reference)})"
    restored = run_image(comfy, picture, seed=5)
    assert np.array_equal(restored, base_image), "removing the LoRA did not restore the base bit for bit"


def test_lora_report_and_chaining(comfy, picture, base_image):
    entry = comfy.run(edit_prompt(picture, chain=[fuse_lora("tiny_kohya.safetensors", 1.0),
                                                  fuse_lora("tiny_peft.safetensors", -0.5)], seed=5))
    report = " ".join(t for out in entry["outputs"].values() for t in out.get("text", []))
    assert read_image(comfy.output_files(entry)[0]).shape == base_image.shape
    for _ in range(3):  # many changes leave no drift
        run_image(comfy, picture, [fuse_lora("tiny_loha.safetensors", 0.7)], seed=5)
    assert np.array_equal(run_image(comfy, picture, seed=5), base_image)
    assert "tiny_kohya.safetensors x 1" in report and "tiny_peft.safetensors x -0.5" in report
    assert "matched" in report


def test_strength_zero_equals_the_base(comfy, picture, base_image):
    assert np.array_equal(run_image(comfy, picture, [fuse_lora("tiny_peft.safetensors", 0.0)], seed=5), base_image)


def _fuse_only_prompt(lora_name: str) -> dict:
    return {"2": {"class_type": "QwenEditHopper_Load", "inputs": {
        "diffusion_model": DIT, "text_encoder": TEXT_ENCODER, "vae": VAE,
        "diffusers_folder": "(none: use the three files)", "variant": "auto", "attention": "auto"}},
        "5": {"class_type": "QwenEditHopper_FuseLoRA", "inputs": {"pipe": ["2", 0], "lora_name": lora_name,
                                                                   "strength": 1.0}},
        "6": {"class_type": "PreviewAny", "inputs": {"source": ["5", 1]}}}


def _fuse_error_message(comfy, lora_name: str) -> str:
    """Queue the fuse-only prompt with ``lora_name``, expect it to fail, return ComfyUI's error message."""
    with pytest.raises(PromptFailedError) as failed:
        comfy.run(_fuse_only_prompt(lora_name))
    return failed.value.event("execution_error")["exception_message"]


def test_lora_for_another_architecture_is_an_error_naming_the_file(comfy):
    from safetensors.torch import save_file

    path = comfy.models_dir / "loras" / "sdxl_style.safetensors"
    save_file({"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(4, 320),
               "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.zeros(320, 4)}, str(path))
    assert "sdxl_style.safetensors" in _fuse_error_message(comfy, path.name)


def test_corrupted_lora_and_rank_alpha_mismatch(comfy):
    from safetensors.torch import save_file

    broken = comfy.models_dir / "loras" / "broken.safetensors"
    broken.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    assert "broken.safetensors" in _fuse_error_message(comfy, broken.name)

    mismatch = comfy.models_dir / "loras" / "rank_mismatch.safetensors"
    save_file({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 64),
               "transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(64, 8)}, str(mismatch))
    message = _fuse_error_message(comfy, mismatch.name)
    assert "rank_mismatch.safetensors" in message and "to_q" in message


def test_partial_match_is_reported(comfy):
    from safetensors.torch import save_file

    path = comfy.models_dir / "loras" / "partial.safetensors"
    save_file({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 64),
               "transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(64, 4),
               "text_model.encoder.layers.0.q_proj.lora_A.weight": torch.zeros(4, 32),
               "text_model.encoder.layers.0.q_proj.lora_B.weight": torch.zeros(32, 4)}, str(path))
    entry = comfy.run(_fuse_only_prompt(path.name))
    texts = " ".join(t for out in entry["outputs"].values() for t in out.get("text", []))
    assert "unmatched" in texts.lower()


def test_lightning_lora_switches_auto_scheduler_and_cfg(comfy, picture):
    name = next(n for n, steps in LIGHTNING_LORAS.items() if steps == 4)
    _, texts = run_texts(comfy, picture, [fuse_lora(name)], steps=4, cfg=0.0, seed=6)
    assert "scheduler: lightning (auto, Lightning LoRA fused)" in texts
    assert "true cfg: 1 (auto)" in texts


def test_weight_only_fp8_is_close_to_bf16_and_reports_layers(comfy, picture, base_image):
    fp8_image, texts = run_texts(comfy, picture, [apply_fp8("weight_only")], seed=5)
    assert db(fp8_image, base_image) > 25
    assert "fp8 compute" not in texts or "fp8 storage" in texts
    # the Sampler says which fast-forward kernels ran and why the others did not (on this CPU: none of them)
    kernels = next(line for line in texts.splitlines() if line.startswith("kernels: "))
    assert kernels.startswith("kernels: trim_last_block; left out: shared_modulation (")
    assert "norm_quant (the model runs on cpu; the kernel needs a CUDA GPU)" in kernels


def test_fp8_compute_on_this_cpu_is_refused_with_the_reason(comfy, picture):
    for backend in ("scaled_mm_rowwise", "te"):
        with pytest.raises(PromptRejectedError) as refused:
            comfy.queue(edit_prompt(picture, chain=[apply_fp8(backend)]))
        assert f"backend {backend} cannot run here" in refused.value.messages()
        assert "compute capability" in refused.value.messages()


def test_lora_is_fused_before_fp8_whatever_the_wiring_order(comfy, picture):
    lora_first = run_image(comfy, picture, [fuse_lora("tiny_peft.safetensors"), apply_fp8("weight_only")], seed=5)
    fp8_first = run_image(comfy, picture, [apply_fp8("weight_only"), fuse_lora("tiny_peft.safetensors")], seed=5)
    assert np.array_equal(lora_first, fp8_first)


def test_branches_of_one_loader_do_not_affect_each_other(comfy, picture, base_image):
    prompt = edit_prompt(picture, chain=[fuse_lora("tiny_kohya.safetensors")], seed=5, prefix="branch_lora")
    prompt["7"] = {"class_type": "QwenEditHopper_Sampler", "inputs": {**prompt["3"]["inputs"], "pipe": ["2", 0]}}
    prompt["8"] = {"class_type": "SaveImage", "inputs": {"images": ["7", 0], "filename_prefix": "branch_plain"}}
    entry = comfy.run(prompt)
    plain = next(p for p in comfy.output_files(entry) if "branch_plain" in p.name)
    assert np.array_equal(read_image(plain), base_image)


@pytest.mark.slow
def test_compiled_equals_eager_and_a_strength_change_does_not_recompile(comfy, picture, base_image):
    chain = [fuse_lora("tiny_peft.safetensors", 1.0), compile_model(warmup=True, warmup_size=64)]
    compiled, texts = run_texts(comfy, picture, chain, seed=5)
    eager = run_image(comfy, picture, [fuse_lora("tiny_peft.safetensors", 1.0)], seed=5)
    assert db(compiled, eager) > 30
    assert "warm-up forward at 64x64" in texts
    changed, texts = run_texts(comfy, picture, [fuse_lora("tiny_peft.safetensors", 0.5),
                                                compile_model(warmup=False)], seed=5)
    graphs = int(re.search(r"graphs compiled this run: (\d+)", texts).group(1))
    assert graphs == 0, f"a LoRA strength change recompiled ({graphs} graphs)"
    assert not np.array_equal(changed, compiled)
