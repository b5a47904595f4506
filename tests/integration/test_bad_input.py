"""Bad input through the real server: a clear node error naming the input, then the server is fine."""

from __future__ import annotations

import shutil

import pytest
from fixtures_models import DIFFUSERS_FOLDER
from prompts import DIT, VAE, apply_fp8, edit_prompt, loader, sampler, write_image
from server_checks import assert_server_still_works, execution_error, rejected


@pytest.fixture(scope="module")
def picture(comfy) -> str:
    return write_image(comfy.input_dir / "bad_input.png", 64, 64, seed=9)


@pytest.fixture(scope="module")
def baseline(comfy, picture):
    return assert_server_still_works(comfy, picture)


def place(comfy, source, folder: str, name: str) -> str:
    target = comfy.models_dir / folder / name
    shutil.copy(source, target)
    return name


def test_vae_chosen_as_dit(comfy, picture, baseline):
    name = place(comfy, comfy.models_dir / "vae" / VAE, "diffusion_models", "not_a_dit_vae.safetensors")
    message = execution_error(comfy, edit_prompt(picture, load=loader(dit=name)))
    assert "not_a_dit_vae.safetensors" in message and "VAE" in message and "vae slot" in message
    assert_server_still_works(comfy, picture, baseline)


def test_lora_chosen_as_dit(comfy, picture, baseline):
    name = place(comfy, comfy.models_dir / "loras" / "tiny_peft.safetensors", "diffusion_models",
                 "not_a_dit_lora.safetensors")
    message = execution_error(comfy, edit_prompt(picture, load=loader(dit=name)))
    assert "not_a_dit_lora.safetensors" in message and "LoRA" in message
    assert_server_still_works(comfy, picture, baseline)


def _broken_folder(comfy, name: str) -> tuple[str, list]:
    source = comfy.models_dir / "qwen_edit" / DIFFUSERS_FOLDER
    target = comfy.models_dir / "qwen_edit" / name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target)
    return name, sorted((target / "transformer").glob("*.safetensors"))


def test_missing_shard(comfy, picture, baseline):
    name, shards = _broken_folder(comfy, "Missing-Shard")
    shards[-1].unlink()
    message = execution_error(comfy, edit_prompt(picture, load=loader(folder=name)))
    assert shards[-1].name in message
    assert_server_still_works(comfy, picture, baseline)


def test_truncated_shard(comfy, picture, baseline):
    name, shards = _broken_folder(comfy, "Truncated-Shard")
    data = shards[0].read_bytes()
    shards[0].write_bytes(data[: len(data) // 2])
    message = execution_error(comfy, edit_prompt(picture, load=loader(folder=name)))
    assert shards[0].name in message and "truncated" in message.lower()
    assert_server_still_works(comfy, picture, baseline)


def test_corrupted_safetensors_header(comfy, picture, baseline):
    target = comfy.models_dir / "diffusion_models" / "corrupted_header.safetensors"
    data = bytearray((comfy.models_dir / "diffusion_models" / DIT).read_bytes())
    data[8:40] = b"{not json at all" + b"\x00" * 16
    target.write_bytes(bytes(data))
    message = execution_error(comfy, edit_prompt(picture, load=loader(dit=target.name)))
    assert "corrupted_header.safetensors" in message and "header" in message.lower()
    assert_server_still_works(comfy, picture, baseline)


def test_pickle_checkpoint_is_refused_before_loading(comfy, picture):
    (comfy.models_dir / "diffusion_models" / "old_model.ckpt").write_bytes(b"\x80\x04not really a pickle")
    message = rejected(comfy, edit_prompt(picture, load=loader(dit="old_model.ckpt")))
    assert "old_model.ckpt" in message and "pickle" in message and "safetensors" in message


def test_path_outside_model_folders_is_unreachable(comfy, picture):
    message = rejected(comfy, edit_prompt(picture, load=loader(dit="../../../../etc/passwd")))
    assert "is not a file in models/diffusion_models" in message
    message = rejected(comfy, edit_prompt(picture, load=loader(folder="../../etc")))
    assert "is not a pipeline folder" in message



@pytest.mark.parametrize("host_blocks", [-1, 201])
def test_host_blocks_out_of_range_is_refused(comfy, picture, baseline, host_blocks):
    load = loader()
    load["inputs"]["host_blocks"] = host_blocks
    message = rejected(comfy, edit_prompt(picture, load=load))
    assert "host_blocks" in message and str(host_blocks) in message
    assert_server_still_works(comfy, picture, baseline)


def test_host_blocks_on_the_cpu_says_nothing_is_streamed(comfy, picture, baseline):
    load = loader()
    load["inputs"]["host_blocks"] = 1
    entry = comfy.run(edit_prompt(picture, load=load, seed=99, prefix="host_blocks"))
    texts = " ".join(t for out in entry["outputs"].values() for t in out.get("text", []))
    assert "host_blocks: the model runs on cpu" in texts and "nothing is streamed" in texts
    assert_server_still_works(comfy, picture, baseline)

def test_image_with_alpha(comfy, picture, baseline):
    prompt = edit_prompt(picture)
    prompt["5"] = {"class_type": "JoinImageWithAlpha", "inputs": {"image": ["1", 0], "alpha": ["1", 1]}}
    prompt["3"]["inputs"]["image"] = ["5", 0]
    message = execution_error(comfy, prompt)
    assert "image" in message and "alpha" in message and "RGB" in message
    assert_server_still_works(comfy, picture, baseline)


def test_batch_of_images(comfy, picture, baseline):
    prompt = edit_prompt(picture)
    prompt["5"] = {"class_type": "ImageBatch", "inputs": {"image1": ["1", 0], "image2": ["1", 0]}}
    prompt["3"]["inputs"]["image"] = ["5", 0]
    message = execution_error(comfy, prompt)
    assert "batch of 2 images" in message
    assert_server_still_works(comfy, picture, baseline)


def test_more_reference_images_than_the_variant_takes(comfy, picture, baseline):
    prompt = edit_prompt(picture, load=loader(dit="qwen_image_edit_bf16.safetensors"))
    prompt["3"]["inputs"]["image_2"] = ["1", 0]
    message = execution_error(comfy, prompt)
    assert "qwen-image-edit takes 1 reference image" in message
    assert_server_still_works(comfy, picture, baseline)


def test_three_references_work_with_2509(comfy, picture):
    prompt = edit_prompt(picture, prefix="three_refs")
    prompt["3"]["inputs"]["image_2"] = ["1", 0]
    prompt["3"]["inputs"]["image_3"] = ["1", 0]
    assert comfy.output_files(comfy.run(prompt))


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("steps", 0, "steps must be at least 1"),
    ("cfg", 0.5, "cfg must be 1 or more, or 0 for auto"),
])
def test_steps_and_cfg_out_of_range_are_refused(comfy, picture, field, value, expected):
    message = rejected(comfy, edit_prompt(picture, **{field: value}))
    assert expected in message


def test_one_step_of_the_default_schedule_is_refused(comfy, picture, baseline):
    """DiffSynth's Qwen-Image schedule gives NaN timesteps for one step: refused, never a black image."""
    message = rejected(comfy, edit_prompt(picture, steps=1, scheduler="default"))
    assert "steps 1 with the default (Qwen-Image) schedule: it needs at least 2" in message
    message = execution_error(comfy, edit_prompt(picture, steps=1, scheduler="auto"))
    assert "steps 1 with the default (Qwen-Image) schedule" in message and "NaN timesteps" in message
    assert_server_still_works(comfy, picture, baseline)


def test_unknown_variant_value_is_refused(comfy, picture):
    message = rejected(comfy, edit_prompt(picture, load=loader(variant="qwen-image-edit-9999")))
    assert "variant" in message


def test_sampler_without_a_pipe_plan(comfy, picture):
    prompt = {"1": {"class_type": "LoadImage", "inputs": {"image": picture}},
              "3": sampler(["1", 0], ["1", 0]),
              "4": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": "x"}}}
    message = rejected(comfy, prompt)
    assert "pipe" in message or "QWEN_EDIT" in message


def test_unknown_gemm_kernel_is_refused_naming_the_input(comfy, picture, baseline):
    """Apply TE-FP8's optional gemm_kernel input with a value it does not have: refused at validation."""
    message = rejected(comfy, edit_prompt(picture, chain=[apply_fp8("weight_only", gemm_kernel="cublas")]))
    assert "gemm_kernel 'cublas' is not one of cublaslt, torch" in message
    assert_server_still_works(comfy, picture, baseline)


def test_fp8_attention_that_cannot_run_is_refused_with_the_reason(comfy, picture, baseline):
    """cudnn_fp8 on this CPU server (where_unsupported: refuse, the default): refused at validation, naming input
    and reason and the way to check the workflow anyway."""
    message = rejected(comfy, edit_prompt(picture, load=loader(attention="cudnn_fp8")))
    assert "attention cudnn_fp8 cannot run here" in message and "CUDA" in message
    assert "set where_unsupported to emulate" in message
    assert_server_still_works(comfy, picture, baseline)


def test_fp8_backend_that_cannot_run_is_refused_unless_emulation_is_chosen(comfy, picture, baseline):
    """Apply TE-FP8 scaled_mm_rowwise on this CPU: refused by default; with where_unsupported emulate it runs its
    fp32 reference path and says EMULATED; a value it does not know is refused naming the input."""
    message = rejected(comfy, edit_prompt(picture, chain=[apply_fp8("scaled_mm_rowwise")]))
    assert "backend scaled_mm_rowwise cannot run here" in message and "where_unsupported" in message
    entry = comfy.run(edit_prompt(picture, chain=[apply_fp8("scaled_mm_rowwise", where_unsupported="emulate")],
                                  seed=3, prefix="emulated"))
    texts = " ".join(t for out in entry["outputs"].values() for t in out.get("text", []))
    assert "EMULATED: scaled_mm_rowwise cannot run here" in texts
    message = rejected(comfy, edit_prompt(picture, chain=[apply_fp8("weight_only", where_unsupported="fallback")]))
    assert "where_unsupported 'fallback' is not one of refuse, emulate" in message
    assert_server_still_works(comfy, picture, baseline)
