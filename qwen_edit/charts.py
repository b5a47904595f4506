"""Benchmark charts (matplotlib, Agg): time per image with speedups, and the memory timeline."""

from __future__ import annotations

import io

import numpy as np
import torch

from .benchmark import BenchmarkResult


def render_chart(result: BenchmarkResult, width_px: int = 1400, height_px: int = 560) -> torch.Tensor:
    """The chart as a ComfyUI IMAGE: (1, H, W, 3) float32 in [0, 1]."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from PIL import Image

    figure = Figure(figsize=(width_px / 100, height_px / 100), dpi=100)
    speed, memory = figure.subplots(1, 2, gridspec_kw={"width_ratios": [1.1, 1]})
    labels = [v.label for v in result.variants]
    seconds = [v.seconds_per_image for v in result.variants]
    base = seconds[0] if seconds else 1.0
    bars = speed.barh(range(len(labels)), seconds, color="#4c72b0")
    speed.set_yticks(range(len(labels)), labels=labels, fontsize=8)
    speed.invert_yaxis()
    speed.set_xlabel("seconds per image (lower is better)")
    where = "CPU figures (tiny model: not Hopper speed)" if result.cpu else result.device_name
    speed.set_title(f"{result.width}x{result.height}, {result.steps} steps, cfg {result.cfg:g} - {where}",
                    fontsize=9)
    for bar, value in zip(bars, seconds, strict=True):
        speed.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value:.2f} s  {base / value:.2f}x",
                   va="center", fontsize=8)
    speed.set_xlim(0, max(seconds) * 1.45 if seconds else 1)
    for variant in result.variants:
        if variant.memory_timeline:
            t = [p[0] for p in variant.memory_timeline]
            allocated = [p[1] / 2**30 for p in variant.memory_timeline]
            memory.plot(t, allocated, label=variant.label, linewidth=1.2)
    memory.set_xlabel("seconds since the variant started")
    memory.set_ylabel("GiB allocated" if not result.cpu else "GiB resident (process)")
    memory.set_title("memory per denoising step", fontsize=9)
    if any(v.memory_timeline for v in result.variants):
        memory.legend(fontsize=7)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    image = np.asarray(Image.open(buffer).convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(image)[None]
