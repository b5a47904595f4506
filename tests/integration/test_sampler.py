"""Load Qwen Edit + Sampler through the real server on the tiny checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from comfy_server import PromptFailedError
from fixtures_models import DIFFUSERS_FOLDER
from fixtures_server import NETGUARD_DIR
from prompts import TEXT_ENCODER_FP8, edit_prompt, loader, read_image, write_image


@pytest.fixture(scope="module")
def picture(comfy) -> str:
    return write_image(comfy.input_dir / "sampler_input.png", 96, 64, seed=3)


LAYOUTS = {
    "comfy_single_bf16_te": loader(),
    "comfy_single_fp8_scaled_te": loader(text_encoder=TEXT_ENCODER_FP8),
    "diffusers_folder": loader(folder=DIFFUSERS_FOLDER),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_loads_and_samples_an_image_of_the_expected_size(comfy, picture, layout):
    entry = comfy.run(edit_prompt(picture, load=LAYOUTS[layout], width=80, height=48, prefix=layout))
    (path,) = comfy.output_files(entry)
    image = read_image(path)
    assert image.shape == (48, 80, 3)
    assert image.std() > 1.0, "the tiny model should not produce a flat image"


def test_same_seed_same_image_and_another_seed_differs(comfy, picture):
    first = read_image(comfy.output_files(comfy.run(edit_prompt(picture, seed=7, prefix="s7a")))[0])
    again = read_image(comfy.output_files(comfy.run(edit_prompt(picture, seed=7, prefix="s7b", prompt="make it red ")
                                                    ))[0])
    other = read_image(comfy.output_files(comfy.run(edit_prompt(picture, seed=8, prefix="s8")))[0])
    assert not np.array_equal(first, other)
    repeat = read_image(comfy.output_files(comfy.run(edit_prompt(picture, seed=7, prefix="s7c")))[0])
    assert np.array_equal(first, repeat)
    assert again.shape == first.shape


def test_default_output_size_follows_the_image_aspect_at_one_megapixel(comfy, picture):
    entry = comfy.run(edit_prompt(picture, width=0, height=0, steps=1, cfg=1.0, scheduler="lightning",
                                  prefix="auto_size"), timeout=900)
    image = read_image(comfy.output_files(entry)[0])
    height, width = image.shape[:2]
    assert width % 16 == 0 and height % 16 == 0
    assert abs(width / height - 96 / 64) < 0.02
    assert 0.9e6 < width * height < 1.1e6


def test_sizes_not_multiple_of_16_are_rounded_and_said_so(comfy, picture):
    entry = comfy.run(edit_prompt(picture, width=70, height=50, prefix="rounded"))
    image = read_image(comfy.output_files(entry)[0])
    assert image.shape[:2] == (48, 64)
    texts = " ".join(t for out in entry["outputs"].values() for t in out.get("text", []))
    assert "asked 70x50, rounded to multiples of 16" in texts
    assert "compute dtype: float32 (cpu; bf16 on a GPU)" in texts


def test_interrupt_stops_sampling_and_the_next_prompt_succeeds(comfy, picture):
    # 200 steps at 512x512 with true CFG takes tens of seconds on a CPU: long enough to interrupt mid-way
    prompt_id = comfy.queue(edit_prompt(picture, steps=200, seed=11, width=512, height=512,
                                        reference_megapixels=0.25, prefix="interrupted"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        running = comfy.get("/queue").json()["queue_running"]
        if running and running[0][1] == prompt_id:
            break
        time.sleep(0.1)
    time.sleep(1.5)
    comfy.interrupt()
    started = time.monotonic()
    with pytest.raises(PromptFailedError) as failed:
        comfy.wait(prompt_id, timeout=120)
    assert failed.value.event("execution_interrupted") is not None
    assert time.monotonic() - started < 30, "interrupt should stop within the running step"
    entry = comfy.run(edit_prompt(picture, seed=12, prefix="after_interrupt"))
    assert comfy.output_files(entry)


def test_prompt_encoding_is_cached_while_prompt_and_images_are_unchanged(comfy, picture):
    first = comfy.run(edit_prompt(picture, prompt="a cached prompt", seed=21, prefix="cache1"))
    second = comfy.run(edit_prompt(picture, prompt="a cached prompt", seed=22, prefix="cache2"))
    third = comfy.run(edit_prompt(picture, prompt="another prompt", seed=23, prefix="cache3"))

    def text(entry):
        return " ".join(t for out in entry["outputs"].values() for t in out.get("text", []))

    assert "(cached)" not in text(first)
    assert "(cached)" in text(second)
    assert "(cached)" not in text(third)


def test_free_unloads_our_models(comfy, picture):
    comfy.run(edit_prompt(picture, seed=31, prefix="before_free"))
    offset = len(comfy.log_path.read_text(errors="replace"))
    comfy.free()
    deadline = time.monotonic() + 60
    unloaded = ""
    while time.monotonic() < deadline and unloaded.count("ComfyUI unloads") < 3:
        time.sleep(0.5)
        unloaded = comfy.log_path.read_text(errors="replace")[offset:]
    for part in ("DiT", "text encoder", "VAE"):
        assert f"ComfyUI unloads {part}" in unloaded, f"{part} was not unloaded by /free"
    entry = comfy.run(edit_prompt(picture, seed=32, prefix="after_free"))
    assert comfy.output_files(entry)


def test_no_network_access_during_load_and_sampling(comfy, picture):
    log = comfy.base_dir / "netguard.log"
    before = log.read_text() if log.exists() else ""
    comfy.free()
    comfy.run(edit_prompt(picture, load=loader(folder=DIFFUSERS_FOLDER), seed=41, prefix="offline"))
    comfy.run(edit_prompt(picture, seed=42, prefix="offline2"))
    after = log.read_text() if log.exists() else ""
    assert after == before, f"network access attempted: {after[len(before):]}"


def test_the_network_guard_blocks_and_records(tmp_path):
    """The guard the server runs under really refuses non-loopback connections (so the test above can fail)."""
    log = tmp_path / "guard.log"
    code = ("import socket\ntry:\n    socket.create_connection(('example.com', 80), timeout=1)\n"
            "except OSError as e:\n    print('blocked', e)\n")
    env = dict(os.environ, PYTHONPATH=str(NETGUARD_DIR), QWEN_EDIT_NETGUARD_LOG=str(log))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert "blocked" in result.stdout
    assert "example.com" in log.read_text()
