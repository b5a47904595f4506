"""Compare pipe plans side by side on one loaded base: speed, memory, and image difference.

Each variant runs ``warmup`` untimed edits (the first one includes any
compile), then ``repeats`` timed edits with the same seed; the first
variant's image is the reference for PSNR/SSIM. Memory is sampled once per
denoising step (allocated/reserved on CUDA, resident set size on CPU) for
the timeline chart.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .compute_dtype import compute_note, dtype_label
from .edit import run_edit
from .metrics import psnr, ssim
from .plan import PipePlan
from .runtime import PlanRuntime
from .sampling import Callbacks, EditRequest

logger = logging.getLogger(__name__)


@dataclass
class VariantResult:
    """Measured figures of one variant (seconds; bytes; dB)."""

    label: str
    attention: str
    seconds_per_image: float
    seconds_per_step: float
    denoise_s: float
    first_run_s: float
    compile_s: float | None
    peak_bytes: int | None
    psnr_db: float | None
    ssim: float | None
    memory_timeline: list[tuple[float, int, int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    kernels: str = ""
    """The denoising forward's kernel choice (``KernelPlan.summary``: used, and left out with reasons)."""


@dataclass
class BenchmarkResult:
    device: str
    device_name: str
    steps: int
    width: int
    height: int
    cfg: float
    warmup: int
    repeats: int
    variants: list[VariantResult]
    images: list[torch.Tensor] = field(default_factory=list, repr=False)
    diagnosis: str = ""
    compute: str = ""
    """The run's compute dtype line (``qwen_edit.compute_dtype.compute_note``)."""

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"

    def to_markdown(self) -> str:
        base = self.variants[0].seconds_per_image if self.variants else 0.0
        lines = []
        if self.cpu:
            lines.append("**CPU figures** (no GPU here): they show the pipeline works, not Hopper speed.\n")
        lines += [f"{self.width}x{self.height}, {self.steps} steps, cfg {self.cfg:g}, {self.warmup} warm-up + "
                  f"{self.repeats} timed run(s) on {self.device_name}", *([self.compute] if self.compute else []), "",
                  "| variant | attention | s/image | s/step | speedup | compile s | peak GiB | PSNR dB | SSIM |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for v in self.variants:
            speedup = base / v.seconds_per_image if v.seconds_per_image else float("nan")
            peak = f"{v.peak_bytes / 2**30:.2f}" if v.peak_bytes is not None else "n/a"
            comp = f"{v.compile_s:.1f}" if v.compile_s is not None else "-"
            p = "ref" if v.psnr_db is None else ("inf" if v.psnr_db == float("inf") else f"{v.psnr_db:.1f}")
            s = "ref" if v.ssim is None else f"{v.ssim:.4f}"
            lines.append(f"| {v.label} | {v.attention} | {v.seconds_per_image:.3f} | {v.seconds_per_step:.4f} | "
                         f"{speedup:.2f}x | {comp} | {peak} | {p} | {s} |")
        kernels = [f"- {v.label}: {v.kernels}" for v in self.variants if v.kernels]
        if kernels:
            lines += ["", "Fast forward kernels per variant:", *kernels]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("images", None)
        return data


def _memory_now(device: torch.device) -> tuple[int, int]:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
            return rss, rss
    return 0, 0


def run_benchmark(runtime: PlanRuntime, plans: list[PipePlan], request: EditRequest, *, warmup: int = 1,
                  repeats: int = 2, check_interrupt: Callable[[], None] = lambda: None,
                  on_progress: Callable[[int, int], None] = lambda done, total: None,
                  host_lines: tuple = ()) -> BenchmarkResult:
    """Run every plan on the same request; returns figures, images (1, H, W, 3) and a diagnosis text.

    ``host_lines``: ``fp8.diagnose.DiagnosticLine`` facts about the host (ComfyUI's version), put first in the
    diagnosis.
    """
    from ..fp8 import diagnose

    device = runtime.device
    total_runs = len(plans) * (warmup + repeats)
    done = 0
    variants: list[VariantResult] = []
    images: list[torch.Tensor] = []
    for plan in plans:
        timeline: list[tuple[float, int, int]] = []
        started_at = time.perf_counter()

        def on_step(step: int, total: int, latents: torch.Tensor, timeline=timeline, started_at=started_at) -> None:
            allocated, reserved = _memory_now(device)
            timeline.append((time.perf_counter() - started_at, allocated, reserved))

        callbacks = Callbacks(on_step=on_step, check_interrupt=check_interrupt)
        first_run = None
        notes: list[str] = []
        for _ in range(warmup):
            image, timings = run_edit(runtime, plan, request, callbacks)
            first_run = first_run if first_run is not None else timings
            done += 1
            on_progress(done, total_runs)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        per_image, per_step, denoise = [], [], []
        for _ in range(repeats):
            image, timings = run_edit(runtime, plan, request, callbacks)
            per_image.append(timings.total_s)
            denoise.append(timings.denoise_s)
            per_step.append(timings.denoise_s / request.steps)
            first_run = first_run if first_run is not None else timings
            done += 1
            on_progress(done, total_runs)
        if "calibration" in first_run.extra:
            notes.append(first_run.extra["calibration"])
        kernels = timings.extra.get("kernels")
        steady = statistics.median(denoise)
        compile_s = None
        if plan.compile is not None:
            compile_s = max(0.0, first_run.denoise_s - steady)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        images.append(image)
        reference = images[0]
        variants.append(VariantResult(
            label=plan.short_label(dtype_label(runtime.dtype),
                                   cuda_graphs_ran=timings.extra.get("cuda_graphs") == "on"),
            attention=plan.attention,
            seconds_per_image=statistics.median(per_image),
            seconds_per_step=statistics.median(per_step), denoise_s=steady, first_run_s=first_run.total_s,
            compile_s=compile_s, peak_bytes=peak,
            psnr_db=None if len(images) == 1 else psnr(image, reference),
            ssim=None if len(images) == 1 else ssim(image, reference),
            memory_timeline=timeline, notes=notes, kernels=kernels.summary() if kernels is not None else ""))
        logger.info("benchmark %s: %.3f s/image", variants[-1].label, variants[-1].seconds_per_image)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return BenchmarkResult(device=device.type, device_name=name, steps=request.steps, width=request.width,
                           height=request.height, cfg=request.cfg, warmup=warmup, repeats=repeats,
                           variants=variants, images=images, diagnosis=diagnose(device, host_lines).to_text(),
                           compute=compute_note(device, runtime.dtype))


def write_json(result: BenchmarkResult, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json(), indent=2, default=str))
    return path
