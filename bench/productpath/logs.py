"""What bench/product_path.py reads from the Sampler's report and the server log: stages, s/step, compile and
memory lines."""

from __future__ import annotations

import re
from typing import Any

STAGES = {
    "encode_s": r"prompt encoding: ([0-9.]+) s",
    "denoise_s": r"denoising: ([0-9.]+) s",
    "s_per_step": r"denoising: [0-9.]+ s \(([0-9.]+) s/step\)",
    "decode_s": r"VAE decode: ([0-9.]+) s",
    "total_s": r"total: ([0-9.]+) s",
    "node_s": r"Sampler node: ([0-9.]+) s",
    "first_step_s": r"compiled: first step ([0-9.]+) s",
    "graphs_compiled": r"graphs compiled this run: (\d+)",
    "torch_peak_GiB": r"GPU memory \(PyTorch's allocator\): peak ([0-9.]+) GiB",
    "torch_held_GiB": r"GiB during this prompt, ([0-9.]+) GiB held after it",
    "dit_waited_s": r"the Sampler waited ([0-9.]+) s for it after the encoding",
}
TQDM = re.compile(r"(\d+)/(\d+) \[(\d+):(\d+)<[0-9:?]+,\s*([0-9.]+)(s/it|it/s)\]")
EXECUTED = re.compile(r"Prompt executed in ([0-9.]+) seconds")
SAMPLER_WALL = re.compile(r"Qwen Edit Sampler ran from ([0-9.]+) to ([0-9.]+) \(wall clock")


def parse_stages(info: str) -> dict[str, Any]:
    """The Qwen Edit Sampler's info text -> stage figures (absent lines are left out)."""
    out: dict[str, Any] = {}
    for key, pattern in STAGES.items():
        if m := re.search(pattern, info):
            out[key] = int(m.group(1)) if key == "graphs_compiled" else float(m.group(1))
    if "prompt encoding:" in info:
        out["encode_cached"] = bool(re.search(r"prompt encoding: [0-9.]+ s \(cached\)", info))
    if m := re.search(r"models loaded this prompt: (.*)", info):
        loads = re.findall(r"([A-Za-z ]+?) ([0-9.]+) s", m.group(1))
        out["loads_s"] = {kind.strip(): float(seconds) for kind, seconds in loads}
    if m := re.search(r"CUDA graphs: (.*)", info):
        out["cuda_graphs"] = m.group(1).strip()
    return out


def parse_log(text: str) -> dict[str, Any]:
    """A server log's new part -> the last progress bar (steps, its s/step), ComfyUI's 'Prompt executed in' and when
    the Qwen Edit Sampler ran (wall clock, the clock of ComfyUI's timestamps)."""
    out: dict[str, Any] = {}
    bars = TQDM.findall(text)
    if bars:
        done, total, minutes, seconds, rate, unit = bars[-1]
        rate = float(rate)
        out["progress"] = f"{done}/{total}"
        out["s_per_step"] = round(rate if unit == "s/it" else 1.0 / rate, 4) if rate else None
        out["progress_elapsed_s"] = int(minutes) * 60 + int(seconds)
    if m := EXECUTED.findall(text):
        out["executed_s"] = float(m[-1])
    if m := SAMPLER_WALL.findall(text):
        out["sampler_wall"] = [float(m[-1][0]), float(m[-1][1])]
    return out


