"""One edit from a plan: runtime materializes the models, the sampler runs the stages."""

from __future__ import annotations

import time

import torch

from .compile import compiled_forward_context, compiled_graph_count
from .fit import check_fits
from .latents_check import check_latents
from .memory import Resident
from .plan import PipePlan
from .runtime import PlanRuntime
from .sampling import Callbacks, Conditioning, EditRequest, EditSampler, Timings, _sync, make_scheduler


def needs_calibration(plan: PipePlan, dit: Resident | None) -> bool:
    """DelayedScaling TE layers start with unit scales: they need one calibration pass first (``dit`` None: a model
    not built yet)."""
    fp8 = plan.fp8
    return (fp8 is not None and fp8.backend == "te" and fp8.te_recipe.name == "delayed"
            and (dit is None or not dit.extra.get("calibrated")))


def calibrate(plan: PipePlan, dit: Resident, request: EditRequest, conditioning: Conditioning,
              runtime: PlanRuntime) -> str:
    """Fill DelayedScaling amax histories with real activations: the first two steps' forwards."""
    from ..fp8 import calibrate_delayed_scaling
    from .fast_forward import fast_model_fn

    scheduler = make_scheduler(request.scheduler, request.steps, request.width, request.height)
    generator = torch.Generator("cpu").manual_seed(request.seed)
    latents = torch.randn((1, 16, request.height // 8, request.width // 8), generator=generator,
                          dtype=runtime.dtype).to(runtime.device)
    forwards = []
    for timestep in scheduler.timesteps[:2]:
        t = timestep.unsqueeze(0).to(dtype=runtime.dtype, device=runtime.device)
        forwards.append(lambda t=t: fast_model_fn(
            dit=dit.prepared, latents=latents, timestep=t, height=request.height, width=request.width,
            edit_latents=conditioning.edit_latents, zero_cond_t=plan.variant.zero_cond_t,
            attention_backend=attention_backend(plan), options=plan.forward, **conditioning.positive))
    report = calibrate_delayed_scaling(dit.module, forwards)
    dit.extra["calibrated"] = True
    return str(report)


def attention_backend(plan: PipePlan) -> str:
    """The plan's attention backend name for ``fp8.attention`` ("auto" is PyTorch SDPA's own choice)."""
    return plan.attention_backend


def run_edit(runtime: PlanRuntime, plan: PipePlan, request: EditRequest, callbacks: Callbacks | None = None,
             sampler: EditSampler | None = None, batched_cfg: bool = True) -> tuple[torch.Tensor, Timings]:
    """Encode (cached), denoise and decode one edit. Returns (IMAGE (1, H, W, 3) in [0, 1], timings).

    Non-finite latents are refused before the decode (``latents_check.NonFiniteLatentsError``), never saved
    as a black image.

    ``timings.extra["step_s"]`` holds seconds per denoising step (the first includes any compile);
    ``timings.extra["kernels"]`` the denoising forward's kernel plan (``fast.kernel_plan.KernelPlan``);
    ``timings.extra["loads"]`` the ``(kind, seconds)`` of each model built for this edit.

    A DiT that is not held yet is built on a worker thread while the text encoder loads and the prompt is
    encoded here (``PlanRuntime.start_dit``); ``timings.extra["dit_waited_s"]`` is how long the edit then waited
    for it. A failure or an interrupt before that cancels the build and drops what it built.
    Raises ``fit.NotEnoughMemoryError`` before loading anything when the prompt cannot fit the device.
    """
    callbacks = callbacks or Callbacks()
    sampler = sampler or EditSampler(runtime.conditioning)
    device, dtype = runtime.device, runtime.dtype
    timings = Timings(steps=request.steps)
    timings.extra["memory_need"] = check_fits(runtime, plan, request).describe()
    runtime.loads.clear()  # from here: this edit's builds
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    pending = runtime.start_dit(plan) if plan.parallel is None else None
    try:
        text_encoder = runtime.text_encoder(plan)
        vae = runtime.vae(plan)
        processor = runtime.processor(plan)
        encoder_key = (text_encoder.key, vae.key, id(processor))
        started = time.perf_counter()
        conditioning, cached = sampler.condition(
            request, variant=plan.variant, text_encoder=text_encoder.module, processor=processor, vae=vae.module,
            device=device, dtype=dtype, encoder_key=encoder_key,
            before_text=lambda: runtime.use([text_encoder]), before_vae=lambda: runtime.use([vae]),
        )
        _sync(device)
        timings.encode_s, timings.encode_cached = time.perf_counter() - started, cached
        callbacks.check_interrupt()
    except BaseException:
        if pending is not None:
            pending.cancel()
        raise

    if plan.parallel is not None:
        timings.extra["loads"] = list(runtime.loads)
        latents = _denoise_parallel(runtime, plan, request, conditioning, callbacks, timings)
        return _decode(runtime, plan, request, conditioning, latents, sampler, timings)
    dit = runtime.dit(plan, pending, check_interrupt=callbacks.check_interrupt)
    runtime.use([dit])
    timings.extra["loads"] = list(runtime.loads)
    if pending is not None:
        timings.extra["dit_waited_s"] = pending.build.waited_s
    if "cuda_graphs" in dit.extra:
        timings.extra["cuda_graphs"] = dit.extra["cuda_graphs"]
    if needs_calibration(plan, dit):
        timings.extra["calibration"] = calibrate(plan, dit, request, conditioning, runtime)
    step_times: list[float] = []
    last = [time.perf_counter()]

    def on_step(done: int, total: int, latents: torch.Tensor) -> None:
        _sync(device)
        now = time.perf_counter()
        step_times.append(now - last[0])
        last[0] = now
        callbacks.on_step(done, total, latents)

    graphs_before = compiled_graph_count()
    started = last[0] = time.perf_counter()
    with compiled_forward_context(plan.compile):
        latents = sampler.denoise(request, conditioning, dit=dit.prepared, variant=plan.variant, device=device,
                                  dtype=dtype, callbacks=Callbacks(on_step=on_step,
                                                                   check_interrupt=callbacks.check_interrupt),
                                  attention=attention_backend(plan), batched_cfg=batched_cfg, options=plan.forward)
    if dit.prepared.last_plan is not None:
        timings.extra["kernels"] = dit.prepared.last_plan
    _sync(device)
    timings.denoise_s = time.perf_counter() - started
    timings.extra["step_s"] = step_times
    timings.extra["graphs_compiled"] = compiled_graph_count() - graphs_before

    callbacks.check_interrupt()
    return _decode(runtime, plan, request, conditioning, latents, sampler, timings)


def _denoise_parallel(runtime: PlanRuntime, plan: PipePlan, request: EditRequest, conditioning: Conditioning,
                      callbacks: Callbacks, timings: Timings) -> torch.Tensor:
    """The denoising loop on the plan's parallel workers (:mod:`.parallel.engine`); latents on this device."""
    from .parallel.engine import engine_for
    from .parallel.worker import job

    if needs_calibration(plan, None):
        raise ValueError("fp8: Transformer Engine's delayed scaling needs a calibration pass, which the parallel "
                         "workers do not run; use another fp8 recipe, or one GPU (parallel: off)")
    step_times: list[float] = []
    last = [time.perf_counter()]

    def on_step(done: int, total: int, latents: torch.Tensor) -> None:
        now = time.perf_counter()
        step_times.append(now - last[0])
        last[0] = now
        callbacks.on_step(done, total, latents)

    started = last[0] = time.perf_counter()
    engine = engine_for(plan.parallel, runtime.device.type, runtime.dtype)
    timings.extra["parallel_start_s"] = time.perf_counter() - started
    started = last[0] = time.perf_counter()
    latents, notes = engine.run(job(plan, request, conditioning),
                                Callbacks(on_step=on_step, check_interrupt=callbacks.check_interrupt))
    timings.denoise_s = time.perf_counter() - started
    timings.extra["step_s"] = step_times
    timings.extra["graphs_compiled"] = 0
    timings.extra["parallel"] = plan.parallel.describe()
    timings.extra["parallel_notes"] = notes
    return latents.to(runtime.device)


def _decode(runtime: PlanRuntime, plan: PipePlan, request: EditRequest, conditioning: Conditioning,
            latents: torch.Tensor, sampler: EditSampler, timings: Timings) -> tuple[torch.Tensor, Timings]:
    device = runtime.device
    check_latents(latents, plan=plan, conditioning=conditioning, cfg=request.cfg)
    vae = runtime.vae(plan)
    runtime.use([vae])
    started = time.perf_counter()
    image = sampler.decode(latents, vae.module)
    _sync(device)
    timings.decode_s = time.perf_counter() - started
    if device.type == "cuda":
        timings.extra["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        timings.extra["gpu_held_bytes"] = torch.cuda.memory_allocated(device)
    return image, timings
