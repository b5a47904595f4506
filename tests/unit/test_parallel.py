"""CFG-parallel and Ulysses sequence parallel on the CPU: the same worker processes, engine and collectives (gloo)
as on GPUs (NCCL), on a tiny DiT written to a real checkpoint file, against the one-process denoising loop.

The tiny DiT is "livened" (weights N(0, 1/fan_in), norms ~1.5, as in test_fast_forward) so that attention and the
blocks change the result; 2 heads, so Ulysses runs at degree 2 (with CFG-parallel: 4 processes).
"""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch
from qwen_edit_hopper.qwen_edit.checkpoints.layouts import LAYOUT_SINGLE_FILES, ModelFiles
from qwen_edit_hopper.qwen_edit.parallel.engine import WorkerDiedError, engine_for, stop_engine
from qwen_edit_hopper.qwen_edit.parallel.layout import ParallelChoice, ParallelInputError
from qwen_edit_hopper.qwen_edit.parallel.worker import job
from qwen_edit_hopper.qwen_edit.plan import PipePlan, Variant
from qwen_edit_hopper.qwen_edit.runtime import PlanRuntime
from qwen_edit_hopper.qwen_edit.sampling import Callbacks, Conditioning, EditRequest, EditSampler
from qwen_edit_hopper.qwen_edit.tiny import dit_file_name, tiny_configs, tiny_state_dicts
from safetensors.torch import save_file

DTYPE = torch.float32


def _livened(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = {}
    for name, p in sorted(state.items()):
        if p.ndim >= 2:
            q = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])
            q = q * (2.0 if ("_mod." in name or "norm_out" in name) else 1.0)
            q = q * (0.2 if name.startswith("img_in") else 1.0)
        elif "norm" in name:
            q = 1.5 * (1 + 0.2 * torch.randn(p.shape, generator=g))
        else:
            q = 0.1 * torch.randn(p.shape, generator=g)
        out[name] = q.to(p.dtype).contiguous()
    return out


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> PipePlan:
    root = tmp_path_factory.mktemp("parallel_dit")
    path = root / dit_file_name("edit_2511")
    save_file(_livened(tiny_state_dicts()["dit"]), str(path))
    files = ModelFiles(layout=LAYOUT_SINGLE_FILES, dit=(path,), text_encoder=(path,), vae=(path,))
    return PipePlan(files=files, variant=Variant.EDIT_2511, variant_reason="test")


@pytest.fixture(scope="module")
def edit() -> tuple[EditRequest, Conditioning]:
    """64x64 (16 target tokens) and a 48x80 reference (15 tokens: the image sequence needs padding for 2 shards);
    prompts of 7 and 5 tokens."""
    g = torch.Generator().manual_seed(5)
    text_dim = tiny_configs()[0].text_dim

    def prompt(n):
        return {"prompt_emb": torch.randn(1, n, text_dim, generator=g), "prompt_emb_mask": torch.ones(1, n,
                                                                                                       dtype=torch.long)}

    conditioning = Conditioning(positive=prompt(7), negative=prompt(5),
                                edit_latents=[torch.randn(1, 16, 6, 10, generator=g)])
    request = EditRequest(images=(), prompt="", negative_prompt="", seed=3, steps=3, cfg=4.0, width=64, height=64)
    return request, conditioning


@pytest.fixture(scope="module")
def one_process(plan, edit) -> torch.Tensor:
    """The one-process loop with true CFG as two batch-1 forwards (the kernels CFG-parallel runs)."""
    request, conditioning = edit
    runtime = PlanRuntime("cpu", DTYPE)
    dit = runtime.dit(plan)
    return EditSampler().denoise(request, conditioning, dit=dit.prepared, variant=plan.variant,
                                 device=torch.device("cpu"), dtype=DTYPE, callbacks=Callbacks(), batched_cfg=False)


@pytest.fixture(autouse=True, scope="module")
def _stop_workers():
    yield
    stop_engine()


def _run(plan, edit, layout, callbacks=None):
    request, conditioning = edit
    engine = engine_for(layout, "cpu", DTYPE)
    return engine, *engine.run(job(plan.with_parallel(layout), request, conditioning), callbacks)


def test_cfg_parallel_equals_one_process_bit_for_bit(plan, edit, one_process):
    steps = []
    _, latents, notes = _run(plan, edit, ParallelChoice(cfg=2),
                             Callbacks(on_step=lambda done, total, lat: steps.append((done, total))))
    assert torch.equal(latents, one_process)
    assert steps == [(1, 3), (2, 3), (3, 3)]
    assert any("kernels" in note or "used" in note for note in notes)


def test_interrupt_stops_every_rank_and_the_group_stays(plan, edit, one_process):
    class StopError(Exception):
        pass

    calls = {"steps": 0}

    def check():
        if calls["steps"] >= 1:
            raise StopError("interrupted by the user")

    callbacks = Callbacks(on_step=lambda done, total, lat: calls.__setitem__("steps", done), check_interrupt=check)
    engine = engine_for(ParallelChoice(cfg=2), "cpu", DTYPE)
    with pytest.raises(StopError):
        _run(plan, edit, ParallelChoice(cfg=2), callbacks)
    again, latents, _ = _run(plan, edit, ParallelChoice(cfg=2))  # the same workers run the next edit
    assert again is engine and engine.alive and torch.equal(latents, one_process)


def test_cfg_x_ulysses_on_four_processes_matches_one_process(plan, edit, one_process):
    """CFG-parallel 2 x Ulysses 2: image (31 tokens) and text padded for 2 shards, all-to-all around attention."""
    engine, latents, _ = _run(plan, edit, ParallelChoice(cfg=2, ulysses=2))
    err = ((latents - one_process).norm() / one_process.norm()).item()
    assert err < 1e-5, err  # fp32; only the attention's summation order differs from the one-process call
    assert len(engine.procs) == 4


def test_a_dead_worker_ends_the_edit_with_a_clear_error(plan, edit):
    engine = engine_for(ParallelChoice(cfg=2, ulysses=2), "cpu", DTYPE)
    victim = engine.procs[3].pid

    def kill_at_step(done, total, latents):
        if done == 1:
            os.kill(victim, signal.SIGKILL)

    with pytest.raises(WorkerDiedError, match=r"rank 3 \(cpu\).*killed by signal 9.*next edit starts new ones"):
        _run(plan, edit, ParallelChoice(cfg=2, ulysses=2), Callbacks(on_step=kill_at_step))
    assert not engine.alive and not engine.procs  # every worker stopped: nothing half-alive stays behind


def test_layouts_that_cannot_run_are_refused_naming_the_input():
    with pytest.raises(ParallelInputError, match="cfg_parallel"):
        ParallelChoice(cfg=3)
    with pytest.raises(ParallelInputError, match="ulysses: the sequence-parallel degree is one of 1, 2, 4, 8, got 3"):
        ParallelChoice(ulysses=3)
    with pytest.raises(ParallelInputError, match="ulysses: 4 does not divide the model's 2 attention heads"):
        ParallelChoice(ulysses=4).check(heads=2, available=8)
    with pytest.raises(ParallelInputError, match=r"gpus: .* needs 8 GPUs .* sees 2"):
        ParallelChoice(cfg=2, ulysses=4).check(heads=24, available=2)
    with pytest.raises(ParallelInputError, match="gpus: 1 devices listed"):
        ParallelChoice(cfg=2, gpus=(0,))
    ParallelChoice(cfg=2, ulysses=4).check(heads=24, available=8)
