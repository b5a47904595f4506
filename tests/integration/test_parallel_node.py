"""The Parallel node through the real server (CPU): ComfyUI's process drives two worker processes (gloo), and a
layout the model cannot run is refused naming the input."""

from __future__ import annotations

import numpy as np
import pytest
from comfy_server import PromptFailedError
from prompts import edit_prompt, read_image, write_image


def parallel(cfg_parallel: bool = True, ulysses: str = "1") -> dict:
    return {"class_type": "QwenEditHopper_Parallel", "inputs": {"cfg_parallel": cfg_parallel, "ulysses": ulysses,
                                                                "gpus": ""}}


@pytest.fixture(scope="module")
def picture(comfy) -> str:
    return write_image(comfy.input_dir / "parallel_input.png", 96, 64, seed=4)


def test_cfg_parallel_edit_matches_one_process_and_says_so(comfy, picture):
    one = read_image(comfy.output_files(comfy.run(edit_prompt(picture, seed=9, prefix="one")))[0])
    entry = comfy.run(edit_prompt(picture, seed=9, prefix="cfgpar", chain=[parallel()]))
    two = read_image(comfy.output_files(entry)[0])
    texts = " ".join(t for out in entry["outputs"].values() for t in out.get("text", []))
    assert "parallel: CFG-parallel 2 on 2 devices" in texts
    # the one-process sampler batches the two prompts, the workers run them as batch 1: fp32, same image to a level
    assert one.shape == two.shape and np.abs(one.astype(int) - two.astype(int)).max() <= 1
    assert comfy.get("/system_stats").ok


def test_ulysses_beyond_the_heads_is_refused_naming_the_input(comfy, picture):
    with pytest.raises(PromptFailedError) as failed:
        comfy.run(edit_prompt(picture, prefix="u4", chain=[parallel(ulysses="4")]))
    message = failed.value.event("execution_error")["exception_message"]
    assert "ulysses: 4 does not divide the model's 2 attention heads" in message
