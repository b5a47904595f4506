"""The DiT is built on a worker thread while the text encoder loads and the prompt is encoded; a failure or an
interrupt before the DiT is used cancels the build and leaves nothing of it behind."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from qwen_edit_hopper.qwen_edit.background_build import BackgroundBuild
from test_checkpoints_support import COMFY_TOKENIZER_DIR, tiny


def _build_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("build ")]


def test_the_result_is_what_the_build_returned_and_the_wait_is_counted():
    build = BackgroundBuild("model", lambda check: (time.sleep(0.2), "built")[1], torch.device("cpu")).start()
    assert build.result() == "built"
    assert build.waited_s > 0.1 and build.seconds >= 0.2


def test_a_failed_build_raises_its_own_error_on_the_callers_thread():
    def build(check):
        raise ValueError("dit.safetensors: block 3 has the wrong shape")

    started = BackgroundBuild("model", build, torch.device("cpu")).start()
    with pytest.raises(ValueError, match="block 3 has the wrong shape"):
        started.result()


def test_cancel_stops_the_build_at_its_next_check_and_drops_it():
    groups = []

    def build(check):
        for index in range(200):
            check()
            groups.append(index)
            time.sleep(0.01)
        return "all groups"

    started = BackgroundBuild("model", build, torch.device("cpu")).start()
    time.sleep(0.05)
    started.cancel()
    assert not _build_threads()
    assert 0 < len(groups) < 200


def test_an_interrupt_while_waiting_cancels_the_build_and_goes_on():
    checks = []

    def build(check):
        while True:
            check()
            checks.append(1)
            time.sleep(0.01)

    def interrupted():
        raise KeyboardInterrupt("the user pressed cancel")

    started = BackgroundBuild("model", build, torch.device("cpu")).start()
    with pytest.raises(KeyboardInterrupt):
        started.result(interrupted)
    assert not _build_threads() and checks


@pytest.fixture(scope="module")
def edit_inputs(tmp_path_factory):
    from PIL import Image
    from qwen_edit_hopper.qwen_edit.checkpoints.layouts import resolve_single_files
    from qwen_edit_hopper.qwen_edit.plan import PipePlan, Variant
    from qwen_edit_hopper.qwen_edit.sampling import EditRequest

    written = tiny("comfy_single", "edit_2509", tmp_path_factory)
    files = resolve_single_files(dit=written["dit"][0], text_encoder=written["text_encoder"][0],
                                 vae=written["vae"][0])
    plan = PipePlan(files=files, variant=Variant.EDIT_2509, variant_reason="test")
    picture = Image.new("RGB", (64, 48), (200, 30, 40))
    request = EditRequest(images=(picture,), prompt="make it blue", negative_prompt=" ", seed=3, steps=2, cfg=4.0,
                          width=64, height=48, reference_pixels=64 * 48)
    return plan, request


def _runtime():
    from qwen_edit_hopper.qwen_edit.runtime import PlanRuntime

    return PlanRuntime("cpu", torch.float32, comfy_tokenizer_dir=COMFY_TOKENIZER_DIR)


def test_the_dit_is_built_on_a_worker_while_the_text_encoder_loads(edit_inputs, caplog):
    from qwen_edit_hopper.qwen_edit.edit import run_edit

    plan, request = edit_inputs
    runtime = _runtime()
    with caplog.at_level(logging.INFO, logger="qwen_edit_hopper.qwen_edit.runtime"), torch.inference_mode():
        image, timings = run_edit(runtime, plan, request)
        loading = {record.getMessage().split()[1]: record for record in caplog.records
                   if record.getMessage().startswith("loading ")}
        again, second = run_edit(runtime, plan, request)
    assert loading["DiT"].threadName.startswith("build DiT") and loading["text"].threadName == "MainThread"
    assert loading["DiT"].created <= loading["text"].created  # started before the text encoder's load
    assert [kind for kind, _ in timings.extra["loads"]] == ["text encoder", "VAE", "DiT"]
    assert timings.extra["dit_waited_s"] >= 0
    assert "dit_waited_s" not in second.extra and second.extra["loads"] == []  # held: nothing built or waited for
    assert torch.equal(image, again)  # the same model, whichever thread built it
    assert not _build_threads()


def test_an_interrupt_before_the_dit_is_used_leaves_no_dit_and_no_build(edit_inputs):
    from qwen_edit_hopper.qwen_edit.edit import run_edit
    from qwen_edit_hopper.qwen_edit.sampling import Callbacks

    plan, request = edit_inputs
    runtime = _runtime()

    def interrupted():
        raise InterruptedError("interrupted by the user")

    with torch.inference_mode(), pytest.raises(InterruptedError):
        run_edit(runtime, plan, request, Callbacks(check_interrupt=interrupted))
    assert not _build_threads()
    assert [resident.key[0] for resident in runtime.residents()] == ["text_encoder", "vae"]
    with torch.inference_mode():
        _, timings = run_edit(runtime, plan, request)  # the next prompt builds the DiT afresh
    assert [kind for kind, _ in timings.extra["loads"]] == ["DiT"]

