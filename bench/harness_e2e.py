"""End to end: the whole edit through ``qwen_edit.edit.run_edit`` with a ``PlanRuntime``, random weights.

Components are built here (meta, then random weights on the GPU: DiT 20.4 B, Qwen2.5-VL text
encoder 8.3 B with its vision tower, VAE) and handed to the runtime instead of files. What this
relies on in ``qwen_edit/runtime.py`` (checked at run time; a change fails loudly, see
:func:`inject_components`):

* ``PlanRuntime.adopt(key, module, label)`` holds a built module under the key its getters look up
  (``runtime.dit_key`` / ``text_encoder_key`` / ``vae_key``); ``files_identity`` stats the files, so
  each slot names a small placeholder file that exists.
* ``runtime.processor(plan)`` builds the Qwen2-VL processor from ``comfy_tokenizer_dir`` (ComfyUI's
  ``comfy/text_encoders/qwen25_tokenizer``) when the plan's files have no processor/tokenizer folder.
* ``runtime.use(residents)`` is called before each stage (text encoder, VAE encode, DiT, VAE decode):
  the hooks given to the runtime see it, and mark the memory timeline there.

Presets: the baseline, bf16 eager with DiffSynth's ``model_fn_qwen_image`` and sequential true CFG
(:class:`DiffSynthSampler`; 40 steps, CFG 4); the pack's default (its own sampler: ``fast_model_fn``,
cond and uncond as one batch-2 forward, bf16, no compile); the fastest preset (a ``fast`` variant as a
plan: FP8 config, the pack's regional compile, attention backend; fused QKV is injected as a prebuilt
variant); and Lightning (4 steps, cfg 1, the ``lightning`` scheduler; no LoRA file is needed for
timing) for the baseline and the fastest. Each preset runs once with 2 steps (compile, first-use
costs, FP8 build), then once timed with a fresh conditioning cache.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness_models as hm
import numpy as np
import torch
from harness_core import OK, UNAVAILABLE, Runner, free_memory, guarded, load_pack, log, memory_now, synchronize

load_pack()

from qwen_edit_hopper.qwen_edit.sampling import EditSampler  # noqa: E402

PLACEHOLDER = "RANDOM_WEIGHTS_PLACEHOLDER.safetensors"
PROMPT = "Replace the sky with a warm sunset, add a red kite above the roof, keep the house unchanged"
NEGATIVE = " "


# ----------------------------------------------------------------------------- memory timeline


class MemorySampler:
    """Samples (seconds, allocated, reserved, peak allocated) every ``interval_s`` on a thread, and takes
    labelled marks. On CPU allocated = reserved = peak = the process's resident set size."""

    def __init__(self, device: torch.device, interval_s: float = 0.05):
        self.device = device
        self.interval_s = interval_s
        self.samples: list[tuple[float, int, int, int]] = []
        self.marks: list[tuple[float, str, int, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.perf_counter()

    def _peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return memory_now(self.device)[0]

    def sample(self) -> None:
        allocated, reserved = memory_now(self.device)
        self.samples.append((time.perf_counter() - self._t0, allocated, reserved, self._peak()))

    def mark(self, label: str) -> None:
        allocated, reserved = memory_now(self.device)
        self.marks.append((time.perf_counter() - self._t0, label, allocated, reserved))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> MemorySampler:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._t0 = time.perf_counter()
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="bench-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def to_json(self) -> dict[str, Any]:
        gib = 2**30
        return {"samples": [[round(t, 3), a / gib, r / gib, p / gib] for t, a, r, p in self.samples],
                "marks": [[round(t, 3), label, a / gib, r / gib] for t, label, a, r in self.marks]}

    def peak_gib(self) -> float:
        return max((p for *_, p in self.samples), default=0) / 2**30


class MarkerHooks:
    """``MemoryHooks`` for the runtime: no host; each ``use()`` (the start of a stage) syncs and marks the
    timeline with the models' labels. ``current`` is the sampler of the run in progress (or None)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.current: MemorySampler | None = None
        self.stage_times: list[tuple[float, str]] = []

    def register(self, resident) -> None:
        return None

    def use(self, residents) -> None:
        if self.current is None:
            return
        synchronize(self.device)
        label = ", ".join(r.label for r in residents)
        self.current.mark(label)
        self.stage_times.append((time.perf_counter(), label))

    def forget(self, resident) -> None:
        return None

    def reserve(self, nbytes: int) -> None:
        return None


# ----------------------------------------------------------------------------- runtime with built components


def placeholder_files(folder: Path):
    """``ModelFiles`` whose three slots name small placeholder files (the runtime stats them for its keys)."""
    from qwen_edit_hopper.qwen_edit.checkpoints.layouts import LAYOUT_SINGLE_FILES, ModelFiles

    paths = {}
    for part in ("dit", "text_encoder", "vae"):
        path = Path(folder) / part / PLACEHOLDER
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file():
            path.write_text("random weights are injected by bench/harness_e2e.py; this file is never read\n")
        paths[part] = (path,)
    return ModelFiles(layout=LAYOUT_SINGLE_FILES, **paths)


def inject_components(runtime, plan, *, dit: torch.nn.Module, text_encoder: torch.nn.Module, vae: torch.nn.Module
                      ) -> dict[str, Any]:
    """Hand built modules to the runtime (``PlanRuntime.adopt`` under the keys its getters use); verify the
    getters return them. Returns the residents by part. Raises RuntimeError when they do not."""
    from qwen_edit_hopper.qwen_edit.runtime import dit_key, text_encoder_key, vae_key

    base = dataclasses.replace(plan, fp8=None, loras=(), compile=None)
    parts = {"dit": (dit_key(base), dit, runtime.dit), "text_encoder": (text_encoder_key(plan), text_encoder,
             runtime.text_encoder), "vae": (vae_key(plan), vae, runtime.vae)}
    residents = {part: runtime.adopt(key, module, f"{part} (random weights)") for part, (key, module, _) in
                 parts.items()}
    for part, (_, module, getter) in parts.items():
        if getter(base).module is not module:
            raise RuntimeError(f"PlanRuntime.{getter.__name__} returned another module than the injected {part}")
    return residents


def inject_variant(runtime, plan, module: torch.nn.Module):
    """Put a prebuilt FP8 DiT (e.g. fused QKV) where ``runtime.dit(plan)`` looks for ``plan.fp8``'s variant."""
    from qwen_edit_hopper.qwen_edit.runtime import dit_key

    resident = runtime.adopt(dit_key(plan), module, f"DiT {plan.short_label()} (prebuilt)")
    if runtime.dit(plan).module is not module:
        raise RuntimeError("runtime.dit(plan) did not return the injected FP8 variant: dit_key changed")
    return resident


class DiffSynthSampler(EditSampler):
    """The pack's sampler with DiffSynth's ``model_fn_qwen_image`` and sequential true CFG (two batch-1
    forwards per step): the baseline, DiffSynth's own denoising. Scheduler, noise, combine and callbacks
    are the pack's."""

    def denoise(self, request, conditioning, **kwargs):
        from diffsynth.pipelines.qwen_image import model_fn_qwen_image

        kwargs.pop("attention", None)
        kwargs.update(model_fn=model_fn_qwen_image, batched_cfg=False)
        return super().denoise(request, conditioning, **kwargs)


# ----------------------------------------------------------------------------- presets


@dataclass(frozen=True)
class E2EPreset:
    """One end-to-end configuration. ``variant`` is a forward-part variant id (``ds/...`` or ``fast/...``)."""

    id: str
    variant: str
    steps: int
    cfg: float
    scheduler: str = "default"

    @property
    def fast(self) -> bool:
        return self.variant.startswith("fast/")


VARIANT_SPECS: dict[str, dict[str, Any]] = {
    "ds/bf16-eager": {"compile": False},
    "fast/bf16-eager": {"compile": False},
    "fast/bf16-compiled": {"compile": True},
    "fast/fp8-rowwise-eager": {"backend": "scaled_mm_rowwise", "compile": False},
    "fast/fp8-rowwise-compiled": {"backend": "scaled_mm_rowwise", "compile": True},
    "fast/fastest-compiled": {"backend": "scaled_mm_rowwise", "preset": "attn+mlp+mod compute",
                              "fast_accum": True, "gemm_kernel": "cublaslt", "compile": True,
                              "attention": "cudnn_fp8", "cuda_graphs": True},
    "fast/fastest-nographs-compiled": {"backend": "scaled_mm_rowwise", "preset": "attn+mlp+mod compute",
                                       "fast_accum": True, "gemm_kernel": "cublaslt", "compile": True,
                                       "attention": "cudnn_fp8"},
    "fast/fp8-tensorwise-compiled": {"backend": "scaled_mm_tensorwise", "compile": True},
    "fast/te-current-compiled": {"backend": "te", "recipe": "current", "compile": True},
    "fast/weight-only-eager": {"backend": "weight_only", "compile": False},
    "fast/fp8-rowwise-qkv-compiled": {"backend": "scaled_mm_rowwise", "qkv": True, "compile": True},
    "fast/fp8-rowwise-qkv-triton-compiled": {"backend": "scaled_mm_rowwise", "qkv": True, "attention": "triton_fp8",
                                             "compile": True},
}
"""Variants the e2e part can run (``--fastest``): the baseline and the pack's own paths."""

FALLBACK_FASTEST = "fast/fp8-rowwise-qkv-compiled"


def choose_fastest(store, requested: str, max_rel_err: float = 0.05) -> tuple[str, str]:
    """(variant id, why). ``requested`` is a variant id or ``auto``: the lowest forward time among the
    pack's fp8 variants measured ok (this run or --prior) with rel_err below ``max_rel_err``; without
    any, the fused-QKV fp8 row-wise compiled path."""
    if requested != "auto":
        if requested not in VARIANT_SPECS:
            raise ValueError(f"--fastest {requested!r} is not one of: auto, {', '.join(VARIANT_SPECS)}")
        return requested, "chosen with --fastest"
    candidates = []
    for vid, spec in VARIANT_SPECS.items():
        if "backend" not in spec:
            continue
        ms = store.figure(f"forward/{vid}", "ms")
        err = store.figure(f"forward/{vid}", "rel_err")
        if isinstance(ms, (int, float)) and isinstance(err, (int, float)) and err < max_rel_err:
            candidates.append((ms, vid))
    if candidates:
        ms, vid = min(candidates)
        return vid, f"fastest fp8 forward measured ({ms:.1f} ms, rel. error < {max_rel_err:g})"
    return FALLBACK_FASTEST, "no fp8 forward measured yet: default choice"


def presets(fastest: str, steps: int, lightning_steps: int) -> list[E2EPreset]:
    """Baseline first (every speedup is against it), then the pack's default, then the fastest."""
    return [
        E2EPreset(f"e2e/bf16-eager-cfg4-{steps}", "ds/bf16-eager", steps, 4.0),
        E2EPreset(f"e2e/bf16-eager-lightning-{lightning_steps}", "ds/bf16-eager", lightning_steps, 1.0, "lightning"),
        E2EPreset(f"e2e/pack-default-cfg4-{steps}", "fast/bf16-eager", steps, 4.0),
        E2EPreset(f"e2e/fastest-cfg4-{steps}", fastest, steps, 4.0),
        E2EPreset(f"e2e/fastest-lightning-{lightning_steps}", fastest, lightning_steps, 1.0, "lightning"),
    ]


def plan_for(base_plan, variant: str, compile_choice=None):
    """The ``PipePlan`` of a variant: FP8 config, the pack's regional compile (``compile_choice``, default
    ``CompileChoice()``) and attention backend."""
    from qwen_edit_hopper.fp8 import Fp8Config, TeRecipeConfig
    from qwen_edit_hopper.qwen_edit.plan import CompileChoice

    spec = VARIANT_SPECS[variant]
    fp8 = None
    if "backend" in spec:
        kwargs: dict[str, Any] = {"backend": spec["backend"]}
        if "recipe" in spec:
            kwargs["te_recipe"] = TeRecipeConfig(name=spec["recipe"])
        if "preset" in spec:
            kwargs["preset"] = spec["preset"]
        if spec.get("fast_accum"):
            kwargs["fast_accum"] = True
        if "gemm_kernel" in spec:
            kwargs["gemm_kernel"] = spec["gemm_kernel"]
        if spec.get("qkv"):
            import harness_forward

            kwargs["preset"] = harness_forward.qkv_preset()
        fp8 = Fp8Config(**kwargs)
    plan = base_plan.with_fp8(fp8)
    if spec["compile"]:
        choice = compile_choice or CompileChoice()
        if spec.get("cuda_graphs"):
            choice = dataclasses.replace(choice, cuda_graphs=True)
        plan = plan.with_compile(choice)
    if "attention" in spec:
        plan = dataclasses.replace(plan, attention=spec["attention"])
    return plan


def reference_image(size: int, seed: int = 7):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8), "RGB")


@dataclass
class E2EContext:
    device: torch.device
    dtype: torch.dtype
    size: str
    runner: Runner
    forward_ctx: Any  # harness_forward.ForwardContext (shares the base DiT)
    resolution: int = 1024
    steps: int = 40
    lightning_steps: int = 4
    warmup_steps: int = 2
    fastest: str = "auto"
    no_compile: bool = False
    compile_choice: Any = None
    placeholder_dir: Path = Path("/tmp/qeh_bench_placeholders")


def run_e2e(ctx: E2EContext) -> None:
    """Every selected e2e preset; one record each, with the memory timeline in its figures."""
    from qwen_edit_hopper.qwen_edit.plan import PipePlan, Variant
    from qwen_edit_hopper.qwen_edit.runtime import PlanRuntime
    from qwen_edit_hopper.qwen_edit.sampling import EditRequest

    runner = ctx.runner
    ff, ff_reason = ctx.forward_ctx.fast()
    fastest, why = choose_fastest(runner.store, ctx.fastest)
    chosen = presets(fastest, ctx.steps, ctx.lightning_steps)
    wanted = [p for p in chosen if runner.wants(p.id)]
    if not wanted:
        return
    log(f"e2e: fastest preset {fastest} ({why})")
    for preset in wanted:
        if preset.fast and ff is None:
            runner.skip(preset.id, UNAVAILABLE, ff_reason)
        elif ctx.no_compile and VARIANT_SPECS[preset.variant]["compile"]:
            runner.skip(preset.id, "not run", "--no-compile")
    wanted = [p for p in wanted if runner.wants(p.id) and p.id not in runner.recorded]
    if not wanted:
        return

    with guarded(runner, [p.id for p in wanted], "building the e2e components (text encoder, VAE)"):
        base = ctx.forward_ctx.get_base()
        log(f"building text encoder and VAE ({ctx.size}, random weights)")
        text_encoder = hm.build_text_encoder(ctx.size, ctx.device, ctx.dtype)
        vae = hm.build_vae(ctx.size, ctx.device, ctx.dtype)
        log(f"text encoder {hm.parameter_count(text_encoder) / 1e9:.2f} B, VAE {hm.parameter_count(vae) / 1e6:.0f} M "
            f"parameters")
        hooks = MarkerHooks(ctx.device)
        comfy_tok = hm.comfy_dir() / "comfy" / "text_encoders" / "qwen25_tokenizer"
        runtime = PlanRuntime(ctx.device, ctx.dtype, hooks=hooks, comfy_tokenizer_dir=comfy_tok)
        base_plan = PipePlan(files=placeholder_files(ctx.placeholder_dir), variant=Variant.EDIT_2509,
                             variant_reason="benchmark: random weights at the released sizes")
        inject_components(runtime, base_plan, dit=base, text_encoder=text_encoder, vae=vae)
        request = EditRequest(images=(reference_image(ctx.resolution),), prompt=PROMPT, negative_prompt=NEGATIVE,
                              seed=42, steps=ctx.steps, cfg=4.0, width=ctx.resolution, height=ctx.resolution,
                              reference_pixels=ctx.resolution * ctx.resolution)
        by_variant: dict[str, list[E2EPreset]] = {}
        for preset in wanted:
            by_variant.setdefault(preset.variant, []).append(preset)
        for variant, group in by_variant.items():
            _run_variant(ctx, runtime, hooks, base_plan, request, variant, group, why)
        runtime.evict_all()
        del runtime, text_encoder, vae
    free_memory()


def _run_variant(ctx, runtime, hooks, base_plan, request, variant, group, why) -> None:
    runner = ctx.runner
    spec = VARIANT_SPECS[variant]
    plan = plan_for(base_plan, variant, ctx.compile_choice)
    estimate = 240.0 if spec["compile"] else 100.0
    baseline = f"e2e/bf16-eager-cfg4-{ctx.steps}"
    with guarded(runner, [p.id for p in group], f"preparing {variant} for e2e"):
        if spec.get("qkv"):
            import harness_forward

            inject_variant(runtime, plan, harness_forward.build_fast_qkv_fp8(ctx.forward_ctx))
        elif plan.fp8 is not None:  # the runtime builds fp8 DiTs from files; these weights live in memory
            from qwen_edit_hopper.qwen_edit.fp8_dit import build_fp8_dit
            from qwen_edit_hopper.qwen_edit.runtime import dit_key

            base = runtime.dit(base_plan).module
            inject_variant(runtime, plan, build_fp8_dit(base, plan.fp8))
        sampler = DiffSynthSampler() if variant.startswith("ds/") else EditSampler()
        for preset in group:
            note = f"variant {variant}" + (f" ({why})" if preset.id.startswith("e2e/fastest") else "")
            runner.run(preset.id, lambda preset=preset: _measure(ctx, runtime, hooks, plan, request, preset, sampler),
                       estimate_s=estimate if preset.steps > 8 else estimate / 2,
                       compared_with=f"{baseline} (bf16 eager, DiffSynth's model_fn, {ctx.steps} steps, true CFG 4 as "
                                     "two batch-1 forwards per step)",
                       notes=[note, plan.describe().replace("\n", "; ")])
        if plan.fp8 is not None:
            from qwen_edit_hopper.qwen_edit.runtime import dit_key

            runtime.evict(dit_key(plan))
    runtime.dit(base_plan)  # back to the eager base (drops the regional compile)
    torch._dynamo.reset()
    free_memory()


def _measure(ctx, runtime, hooks, plan, request, preset: E2EPreset, sampler) -> dict[str, Any]:
    from qwen_edit_hopper.qwen_edit.edit import run_edit
    from qwen_edit_hopper.qwen_edit.sampling import Callbacks

    timed = dataclasses.replace(request, steps=preset.steps, cfg=preset.cfg, scheduler=preset.scheduler)
    warm = dataclasses.replace(timed, steps=min(ctx.warmup_steps, preset.steps))
    started = time.perf_counter()
    run_edit(runtime, plan, warm, sampler=sampler)
    synchronize(ctx.device)
    first_run_s = time.perf_counter() - started
    sampler.cache.clear()
    free_memory()

    with MemorySampler(ctx.device) as memory:
        hooks.current, hooks.stage_times = memory, []

        def on_step(done: int, total: int, latents: torch.Tensor) -> None:
            memory.mark(f"step {done}/{total}")

        try:
            image, timings = run_edit(runtime, plan, timed, Callbacks(on_step=on_step), sampler=sampler)
        finally:
            hooks.current = None
    figures = _timing_figures(timings, hooks.stage_times, preset)
    figures.update({"preset_variant": preset.variant, "first_run_s": first_run_s, "peak_gib": memory.peak_gib(),
                    "image_std": float(image.float().std()), "image_finite": bool(torch.isfinite(image).all()),
                    "timeline": memory.to_json()})
    if not figures["image_finite"]:
        raise FloatingPointError("the decoded image holds NaN or inf")
    baseline = ctx.runner.store.figure(f"e2e/bf16-eager-cfg4-{ctx.steps}", "total_s")
    if baseline:
        figures["speedup_vs_baseline"] = baseline / figures["total_s"]
    return figures


def _timing_figures(timings, stage_times: list[tuple[float, str]], preset: E2EPreset) -> dict[str, Any]:
    """Stage seconds from ``Timings``; the encode split at the stage marks: text encoder (its mark to the
    first VAE mark) and VAE encode of the reference (the rest of ``encode_s``)."""
    steps = list(timings.extra.get("step_s", []))
    figures: dict[str, Any] = {"encode_s": timings.encode_s, "denoise_s": timings.denoise_s,
                               "decode_s": timings.decode_s, "total_s": timings.total_s, "steps": preset.steps,
                               "cfg": preset.cfg, "scheduler": preset.scheduler,
                               "forwards_per_step": 1 if preset.cfg == 1.0 else 2,
                               "step_median_s": float(np.median(steps)) if steps else None}
    text_start = next((t for t, label in stage_times if label.startswith("text_encoder")), None)
    vae_start = next((t for t, label in stage_times if label.startswith("vae")), None)
    if text_start is not None and vae_start is not None and vae_start >= text_start:
        figures["text_encode_s"] = vae_start - text_start
        figures["vae_encode_s"] = max(0.0, timings.encode_s - figures["text_encode_s"])
    return figures


# ----------------------------------------------------------------------------- chart


def draw_memory_chart(records, path, title: str = "") -> bool:
    """PNG: allocated / reserved memory over each e2e run, stage marks as vertical lines, peak annotated."""
    runs = [r for r in records if r.id.startswith("e2e/") and r.status == OK and isinstance(
        r.figures.get("timeline"), dict)]
    if not runs:
        return False
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 3.4 * len(runs) + 0.6), dpi=100, layout="constrained")
    axes = figure.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, record in zip(axes, runs, strict=True):
        timeline = record.figures["timeline"]
        samples = timeline.get("samples", [])
        if samples:
            t = [s[0] for s in samples]
            ax.plot(t, [s[1] for s in samples], label="allocated", linewidth=1.2)
            ax.plot(t, [s[2] for s in samples], label="reserved", linewidth=1.0, alpha=0.7)
            peak = max(samples, key=lambda s: s[1])
            ax.annotate(f"peak {peak[1]:.1f} GiB", (peak[0], peak[1]), fontsize=8)
        ax.set_ylim(bottom=0)
        for when, label, *_ in timeline.get("marks", []):
            if label.startswith("step"):
                ax.plot([when], [0], marker="|", color="black", markersize=6)
                continue
            ax.axvline(when, color="grey", linewidth=0.6, linestyle="--")
            ax.text(when, 0.97, " " + label[:40], fontsize=7, va="top", transform=ax.get_xaxis_transform())
        f = record.figures
        ax.set_title(f"{record.id} ({f.get('preset_variant')}): total {f.get('total_s', 0):.1f} s = encode "
                     f"{f.get('encode_s', 0):.1f} + denoise {f.get('denoise_s', 0):.1f} + decode "
                     f"{f.get('decode_s', 0):.1f}", fontsize=9)
        ax.set_ylabel("GiB")
        ax.legend(fontsize=7, loc="lower right")
    axes[-1].set_xlabel("seconds since the timed run started")
    if title:
        figure.suptitle(title, fontsize=10)
    figure.savefig(path)
    return True
