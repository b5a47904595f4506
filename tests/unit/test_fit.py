"""A prompt that cannot fit the GPU is refused before anything loads, with what it needs, what is free and what fits.

The runtime is pointed at a CUDA device it never touches: the estimate reads file headers only, and the host hooks
(here a stand-in for ComfyUI's memory manager) say how much memory there is.
"""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.fp8 import Fp8Config
from qwen_edit_hopper.qwen_edit.checkpoints import resolve_single_files
from qwen_edit_hopper.qwen_edit.dit_build import DitSource, estimate_bytes
from qwen_edit_hopper.qwen_edit.fit import GIB, NotEnoughMemoryError, check_fits, forward_working_bytes
from qwen_edit_hopper.qwen_edit.memory import NoHost
from qwen_edit_hopper.qwen_edit.plan import PipePlan, Variant
from qwen_edit_hopper.qwen_edit.runtime import PlanRuntime
from qwen_edit_hopper.qwen_edit.sampling import EditRequest
from test_checkpoints_support import tiny


class Budget(NoHost):
    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def available_bytes(self, device):
        return self.nbytes


@pytest.fixture
def plan(tmp_path_factory):
    files = tiny("comfy_single", "edit_2509", tmp_path_factory)
    return PipePlan(files=resolve_single_files(files["dit"][0], files["text_encoder_fp8"], files["vae"][0]),
                    variant=Variant.EDIT_2509, variant_reason="test",
                    fp8=Fp8Config(backend="scaled_mm_rowwise", preset="attn+mlp+mod compute"))


def request(side: int = 1024, cfg: float = 4.0) -> EditRequest:
    from PIL import Image

    return EditRequest(images=(Image.new("RGB", (side, side)),), prompt="p", negative_prompt=" ", seed=0, steps=4,
                       cfg=cfg, width=side, height=side)


def test_a_prompt_that_fits_passes_and_says_what_it_needs(plan):
    runtime = PlanRuntime("cuda", torch.bfloat16, hooks=Budget(80 * GIB))
    need = check_fits(runtime, plan, request())
    assert set(need.models) == {"DiT", "VAE"}  # the text encoder is streamed from host memory on CUDA
    assert need.models["DiT"] == estimate_bytes(DitSource(plan.files), plan.fp8)
    assert need.working["DiT forward"] == forward_working_bytes(1024, 1024, 1, 2, 64)
    assert "GiB" in need.describe() and runtime.residents() == []  # nothing was loaded


def test_a_prompt_that_cannot_fit_is_refused_with_the_figures_and_what_fits(plan):
    runtime = PlanRuntime("cuda", torch.bfloat16, hooks=Budget(GIB // 2))
    with pytest.raises(NotEnoughMemoryError) as refused:
        check_fits(runtime, plan, request())
    message = str(refused.value)
    assert "needs about" in message and "0.5 GiB are free" in message
    assert "low VRAM workflow" in message and "weight_only" in message and "smaller output size" in message
    assert runtime.residents() == []


def test_working_memory_grows_with_size_and_batch():
    assert forward_working_bytes(1024, 1024, 1, 2, 3072) > forward_working_bytes(1024, 1024, 1, 1, 3072)
    assert forward_working_bytes(1328, 1328, 1, 1, 3072) > forward_working_bytes(1024, 1024, 1, 1, 3072)
    # full size, one reference, true CFG: a few GiB, not tens
    assert 1 * GIB < forward_working_bytes(1024, 1024, 1, 2, 3072) < 4 * GIB


def test_the_cpu_is_not_checked(plan):
    runtime = PlanRuntime("cpu", torch.float32, hooks=Budget(0))
    assert check_fits(runtime, plan, request(64, 1.0)).models["DiT"] > 0
