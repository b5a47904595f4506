"""The product path at full size: a real ComfyUI server with this pack, the shipped workflows over HTTP, what users see.

What runs: ComfyUI (0.3.75 or 0.33.0, its source folder given by ``--comfyui``) started the usual way
(``python main.py`` with ComfyUI's defaults: its own allocator choice, dynamic VRAM where 0.33 turns it on; only the
arguments a plan or ``--server-arg`` adds), this checkout as a custom-node pack, the model files of a ComfyUI
``models`` folder (``--models``, through extra_model_paths.yaml; bench/full_size_files.py writes full-size
random-weight ones). Jobs are queued over HTTP one after another:

* a shipped API workflow (``example_workflows/api/<name>.json``: ``fastest``, ``lightning_4step``, ``low_vram``,
  ``lora_fused``, ``bf16_baseline``, ``te_fp8``, ``benchmark``, ``comfy_model_fp8``) with the written files' names
  put in, a new seed for every job (ComfyUI serves an identical prompt from its cache) and, with ``:vary``, a new
  prompt text; ``comfy_model_fp8`` (ComfyUI core's nodes with Apply TE-FP8 and Compile Model on the MODEL)
  quantizes the bf16 DiT, so its plans (``v075-model``, ``v033-model``) run with ``--dit bf16``;
* ``core``: ComfyUI core's own Qwen-Image-Edit-2509 graph on the same files (UNETLoader, CLIPLoader type
  qwen_image, VAELoader, ImageScaleToTotalPixels 1 MP, TextEncodeQwenImageEditPlus, VAEEncode,
  ModelSamplingAuraFlow shift 3.1, KSampler euler/simple 40 steps cfg 4, VAEDecode, SaveImage); ``core:compile``
  puts TorchCompileModel (inductor) after the UNETLoader;
* ``free``: POST /free (unload models, free memory), as ComfyUI's "free model and node cache" button does.

A job spec is ``name[:option[:option...]][*repeat]``; options: ``vary`` (new prompt text), ``lora=4|8`` (which
Lightning LoRA file), ``strength=X``, ``graphs=off`` (CUDA graphs off in the Compile node), ``compile`` (core),
``seed=N``, ``host_blocks=N`` (the Load node's DiT blocks kept in host memory). Plans (``--plan``; ``plan NAME``
prints one) are lists of servers, each with its arguments, its Inductor/Triton caches (fresh empty folders, or the
previous server's) and its jobs.

Recorded per job (``results.json``, rewritten after every job): queue-to-image seconds (the POST to ComfyUI's own
``execution_success`` timestamp) and execution seconds; the Qwen Edit Sampler's reported stages (prompt encoding,
denoising and s/step, VAE decode, total, first step and graphs compiled this run, CUDA graphs, PyTorch's GPU peak
and held memory); for ``core`` the s/step of the KSampler's progress line in the server log; GPU memory used on the
card (nvidia-smi every 0.25 s: before, peak during, held one second after; under 0.33's dynamic VRAM PyTorch's
counters miss ComfyUI's own weights, the card does not); the server's anonymous host memory (``RssAnon`` of
/proc/PID/status every 0.25 s: before, peak, after; its process tree's too); errors with their traceback; whether the
server survived. Per server: arguments, caches, start seconds, idle GPU and host memory, ComfyUI's /system_stats
(the device line names the allocator). Summary: cold time to the first image (server start + first prompt, fresh
caches), the same with the caches warm (a second server on the first one's caches), each repeated series (e.g. 20
prompts in a row: failures, median, growth of held GPU and host memory from its first to its last prompt), LoRA
changes (time, graphs compiled). A markdown table goes to ``table.md`` and is printed last.

``--keep-caches`` puts every server's Inductor/Triton caches in one folder under ``--work`` that no run empties, so
a later call on the same warm GPU machine starts where an earlier one left off: ComfyUI core's TorchCompileModel
prompt compiles for 330 to 380 s the first time, too long to share one 600 s call with the prompts it is compared
with. Such a server's caches read ``kept`` (with the files they held at its start), and its first image counts
neither as an empty-cache nor as a warm-cache start.

``--deadline S`` ends a run cleanly S seconds after it started: a job (or a server start) that would not finish in
the time left, by its duration measured earlier in the run or a full-size estimate, is recorded as skipped.

On the GPU machine bench/product_path_device.sh does everything in one command (wheels, ComfyUI source, files,
this tool); here::

    python3 bench/product_path.py run --comfyui .testenv/comfyui --models M --out O --plan tiny-smoke --tiny
    python3 bench/product_path.py table O/results.json
    python3 bench/product_path.py targets O/results.json [O2/results.json ...]  # the issue's targets, one card
    python3 bench/product_path.py record O/results.json [O2/results.json ...]  # docs/performance/<card>-product-path.md
    python3 bench/product_path.py integrity --device cuda --synthetic-blocks 6  # the load check's cost
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from comfy_server import ComfyInstall, ComfyServer, PromptFailedError, PromptRejectedError  # noqa: E402
from main_job import example_image, write_extra_model_paths  # noqa: E402
from workflows import CORE_SHIFT, INPUT_IMAGE, PROMPT  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from harness_core import card_name  # noqa: E402

API_DIR = ROOT / "example_workflows" / "api"
PERFORMANCE_DIR = ROOT / "docs" / "performance"
RESULTS_DIR = PERFORMANCE_DIR / "results"
"""Where the results.json files behind the product path records are kept (one per run, named CARD-DATE-PLAN-COMMIT)."""
GIB, MIB = 2**30, 2**20
SAMPLE_S = 0.25
HELD_AFTER_S = 1.0
"""Seconds after a prompt ends at which the memory it left held is read."""
RESERVE_S = 20.0
"""Seconds kept at the end of a deadline for stopping the server and writing results."""
FULL_SIZE, FULL_STEPS = 1024, 40
TINY_SIZE, TINY_STEPS = 128, 2
CORE_CFG = 4.0

SHIPPED = ("fastest", "lightning_4step", "low_vram", "lora_fused", "bf16_baseline", "te_fp8", "benchmark",
           "comfy_model_fp8")
MODEL_PATH = "comfy_model_fp8"
"""The shipped workflow of ComfyUI core's nodes with Apply TE-FP8 and Compile Model on its MODEL: it quantizes
high-precision weights, so its plans run on the bf16 DiT (``--dit bf16``)."""
ALIASES = {"lightning": "lightning_4step"}
PROMPTS = (
    PROMPT,
    "Turn the sky into a clear night full of stars.",
    "Make it look like a watercolor painting.",
    "Add a red hot-air balloon high in the sky.",
    "Change the season to winter with snow on the ground.",
    "Make the sun a deep orange and lower it to the horizon.",
    "Add a small wooden house on the hill.",
    "Turn the grass golden as in late autumn.",
    "Add soft fog over the ground.",
    "Make the scene look like a pencil sketch.",
    "Add a flock of birds flying to the left.",
    "Replace the sun with a full moon.",
    "Make the colors pastel and soft.",
    "Add a rainbow across the sky.",
    "Turn it into a pixel-art scene.",
    "Add a lake reflecting the sky in the foreground.",
    "Make the sky stormy with dark clouds.",
    "Add a road leading to the horizon.",
    "Render it in the style of a vintage postcard.",
    "Add a lighthouse on the right.",
    "Make it look like a sunrise over the sea.",
)

# Seconds a job takes at full size on an H100 (first on its server, later), for the deadline before a job of that
# kind has run in this run; measured durations replace them.
ESTIMATE_S = {
    "fastest": (110, 20), "lightning_4step": (80, 6), "low_vram": (90, 45), "lora_fused": (90, 20),
    "bf16_baseline": (110, 45), "te_fp8": (110, 45), "benchmark": (240, 120), "core": (110, 45),
    "core:compile": (220, 45), "free": (10, 10), "lora_change": (45, 45), MODEL_PATH: (220, 45),
}
SERVER_START_ESTIMATE_S = 30.0
KEPT_CACHES = "kept-caches"
"""``--keep-caches``' folder under ``--work``: Inductor's and Triton's caches kept between runs."""


# ----------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class ServerSpec:
    """One ComfyUI process: its label, extra arguments, caches (``fresh`` or ``reuse``: the previous server's)."""

    label: str
    jobs: str
    args: tuple[str, ...] = ()
    caches: str = "fresh"


@dataclass(frozen=True)
class Plan:
    """What one device command runs: the ComfyUI version it needs, the files it uses, its servers in order."""

    comfyui: str
    servers: tuple[ServerSpec, ...]
    description: str = ""


def _every_workflow_twice() -> str:
    order = ("fastest", "lightning_4step", "low_vram", "lora_fused", "te_fp8", "benchmark", "bf16_baseline")
    return ",".join(f"{name}*2,free" for name in order)


def _model_path_plan(comfyui: str) -> Plan:
    """ComfyUI core's own workflow with and without TorchCompileModel, the MODEL path and the pack's fastest on one
    server (the bf16 DiT: ``--dit bf16``)."""
    return Plan(comfyui, (
        ServerSpec("model", f"core*2,free,core:compile*2,free,{MODEL_PATH}*3,free,fastest*2"),
    ), description=f"{comfyui} defaults, the bf16 DiT (--dit bf16): ComfyUI core's own workflow x2, with "
                   "TorchCompileModel x2, the same graph with Apply TE-FP8 and Compile Model on its MODEL x3, "
                   "then the pack's fastest x2 on the same card")


PLANS: dict[str, Plan] = {
    "v075-first-images": Plan("0.3.75", (
        ServerSpec("cold", "fastest,fastest*3,lightning*2,lightning:lora=8"),
        ServerSpec("warm-cache", "fastest,free,low_vram*2", caches="reuse"),
    ), description="0.3.75 defaults: cold fastest, warm fastest x3, Lightning x2 and a LoRA change; a second server "
                    "on the first one's Inductor/Triton caches: its first fastest image, then low VRAM x2"),
    "v075-twenty": Plan("0.3.75", (
        ServerSpec("twenty", "fastest:vary*20"),
    ), description="0.3.75 defaults: 20 fastest prompts in a row on a fresh server, each with a new "
                    "seed and prompt (the first one compiles)"),
    "v075-twenty-warm-cache": Plan("0.3.75", (
        ServerSpec("twenty", "fastest:vary*20"),
        ServerSpec("warm-cache", "fastest,fastest", caches="reuse"),
    ), description="0.3.75 defaults: 20 fastest prompts in a row on a fresh server, each with a new seed and "
                    "prompt (the first one compiles); a second server on the first one's Inductor/Triton caches: "
                    "its first fastest image and one more"),
    "v075-start": Plan("0.3.75", (
        ServerSpec("cold", "fastest,fastest"),
        ServerSpec("warm-cache", "fastest,fastest", caches="reuse"),
    ), description="0.3.75 defaults: the cold-start rows alone: a fresh server's first fastest image with empty "
                    "Inductor/Triton caches and one more, then a second server on those caches: its first and one "
                    "more"),
    "v075-core": Plan("0.3.75", (
        ServerSpec("core", "core*2,free,core:compile*2,free,fastest*2"),
    ), description="0.3.75 defaults: ComfyUI core's own workflow x2, with TorchCompileModel x2, "
                                 "then the pack's fastest x2 on the same card"),
    "v033-defaults": Plan("0.33.0", (
        ServerSpec("dynamic-vram", _every_workflow_twice()),
    ), description="0.33.0 defaults (dynamic VRAM on): every shipped workflow twice with new seeds, /free between"),
    "v033-no-dynamic-vram": Plan("0.33.0", (
        ServerSpec("no-dynamic-vram", _every_workflow_twice(), args=("--disable-dynamic-vram",)),
    ), description="0.33.0 with --disable-dynamic-vram: every shipped workflow twice with new seeds, /free between"),
    "v033-core": Plan("0.33.0", (
        ServerSpec("core", "core*2,free,core:compile*2,free,fastest*2"),
    ), description="0.33.0 defaults: ComfyUI core's own workflow x2, with TorchCompileModel x2, "
                                 "then the pack's fastest x2 on the same card"),
    "v075-model": _model_path_plan("0.3.75"),
    "v033-model": _model_path_plan("0.33.0"),
    "v033-model-vram": Plan("0.33.0", (
        ServerSpec("no-dynamic-vram", f"{MODEL_PATH}*2,free,fastest", args=("--disable-dynamic-vram",)),
        ServerSpec("dynamic-vram", f"{MODEL_PATH}*2,free,fastest"),
    ), description="0.33.0, the bf16 DiT (--dit bf16): the same graph with Apply TE-FP8 and Compile Model on its "
                   "MODEL x2, /free, then the pack's fastest, first with --disable-dynamic-vram, then with dynamic "
                   "VRAM (0.33's default)"),
    "tiny-smoke": Plan("any", (
        ServerSpec("smoke", "low_vram,free,lora_fused"),
    ), description="two workflows without compilation (the CPU test)"),
    "tiny-all": Plan("any", (
        ServerSpec("cold", "fastest,fastest:vary*2,lightning,lightning:lora=8,free,low_vram,free,lora_fused,"
                           "bf16_baseline,te_fp8,benchmark,free,core"),
        ServerSpec("warm-cache", "fastest", caches="reuse"),
    ), description="every kind of job once or twice (a rehearsal at the tiny sizes)"),
}


@dataclass
class Job:
    """One expanded job of a spec."""

    name: str
    options: dict[str, str]
    series: str
    index: int
    repeat: int

    @property
    def kind(self) -> str:
        if self.name in ("core", "free"):
            return self.name
        return "shipped"

    @property
    def estimate_key(self) -> str:
        if "lora" in self.options or "strength" in self.options:
            return "lora_change"
        if self.name == "core" and "compile" in self.options:
            return "core:compile"
        return self.name

    @property
    def label(self) -> str:
        return ":".join([self.name, *(k if v == "" else f"{k}={v}" for k, v in self.options.items())])


def parse_jobs(spec: str) -> list[Job]:
    """``"fastest*3,lightning:lora=8,free"`` -> jobs; raises ValueError naming a bad item."""
    jobs: list[Job] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        body, _, repeat = item.partition("*")
        name, *opts = body.split(":")
        name = ALIASES.get(name, name)
        if name not in (*SHIPPED, "core", "free"):
            raise ValueError(f"job {item!r}: unknown name {name!r}; expected one of {(*SHIPPED, 'core', 'free')}")
        options = {}
        for opt in opts:
            key, _, value = opt.partition("=")
            if key not in ("vary", "lora", "strength", "graphs", "compile", "seed", "host_blocks"):
                raise ValueError(f"job {item!r}: unknown option {key!r}")
            options[key] = value
        count = int(repeat) if repeat else 1
        jobs += [Job(name, options, item, i, count) for i in range(count)]
    return jobs


# ----------------------------------------------------------------------------- sampling


class MemorySampler:
    """GPU memory used on the card (nvidia-smi, every 0.25 s) and one process's anonymous host memory (/proc).

    Samples are ``(time, value)`` in wall-clock seconds, the clock of ComfyUI's timestamps; nvidia-smi's samples
    carry its own timestamps, so a late line still lands at the time it was taken.
    """

    def __init__(self, gpu: bool):
        self.gpu: list[tuple[float, float]] = []  # MiB used on GPU 0
        self.anon: list[tuple[float, float, float]] = []  # (t, server RssAnon bytes, tree RssAnon bytes)
        self.pid: int | None = None
        self._stop = threading.Event()
        self._smi: subprocess.Popen | None = None
        if gpu and shutil.which("nvidia-smi"):
            command = ["nvidia-smi", "-i", "0", "--query-gpu=timestamp,memory.used", "--format=csv,noheader,nounits",
                       "-lms", str(int(SAMPLE_S * 1000))]
            if shutil.which("stdbuf"):
                command = ["stdbuf", "-oL", *command]  # a line as soon as it is sampled
            self._smi = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            threading.Thread(target=self._read_smi, daemon=True).start()
        threading.Thread(target=self._read_proc, daemon=True).start()

    def _read_smi(self) -> None:
        for line in self._smi.stdout:
            stamp, _, used = line.strip().rpartition(",")
            try:
                when = datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
            except ValueError:
                when = time.time()
            with contextlib.suppress(ValueError):
                self.gpu.append((when, float(used)))

    def _read_proc(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            if self.pid is not None:
                own = rss_anon(self.pid)
                if own is not None:
                    self.anon.append((time.time(), own, own + sum(rss_anon(p) or 0 for p in descendants(self.pid))))

    def settle(self, t: float, timeout: float = 3.0) -> None:
        """Wait (at most ``timeout`` s) until the GPU samples reach time ``t``."""
        deadline = time.monotonic() + timeout
        while self._smi is not None and (not self.gpu or self.gpu[-1][0] < t) and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        if self._smi is not None:
            self._smi.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._smi.wait(timeout=5)

    @staticmethod
    def _last_before(samples: list, t: float, column: int = 1) -> float | None:
        found = None
        for sample in samples:
            if sample[0] > t:
                break
            found = sample[column]
        return found

    @staticmethod
    def _peak(samples: list, t0: float, t1: float, column: int = 1) -> float | None:
        values = [s[column] for s in samples if t0 <= s[0] <= t1]
        return max(values) if values else None

    def gpu_at(self, t: float) -> float | None:
        """MiB used on the card at ``t`` (the last sample before it)."""
        return self._last_before(self.gpu, t)

    def gpu_window(self, t0: float, t1: float, t_after: float) -> dict[str, float | None]:
        """MiB used: the last sample before ``t0``, the peak in [t0, max(t1, t_after)] (so it bounds the held
        reading), the last sample at ``t_after``."""
        if not self.gpu:
            return {}
        t1 = max(t1, t_after)
        return {"before_MiB": self._last_before(self.gpu, t0), "peak_MiB": self._peak(self.gpu, t0, t1),
                "held_MiB": self._last_before(self.gpu, t_after)}

    def anon_window(self, t0: float, t1: float, t_after: float) -> dict[str, float | None]:
        """GiB of the server's RssAnon: before, peak (up to the after reading, which it bounds), after; and the
        peak of its process tree's."""
        if not self.anon:
            return {}
        t1 = max(t1, t_after)
        gib = lambda v: None if v is None else round(v / GIB, 3)  # noqa: E731
        return {"before_GiB": gib(self._last_before(self.anon, t0)), "peak_GiB": gib(self._peak(self.anon, t0, t1)),
                "after_GiB": gib(self._last_before(self.anon, t_after)),
                "tree_peak_GiB": gib(self._peak(self.anon, t0, t1, column=2))}


def rss_anon(pid: int) -> int | None:
    """Anonymous resident memory of ``pid`` in bytes (``RssAnon`` of /proc/PID/status), None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (compile workers and the like), from /proc/*/stat."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


# ----------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class ModelFiles:
    """File names ComfyUI lists for the workflows' loaders (found in the models folder)."""

    dit: str
    text_encoder: str
    vae: str
    loras: dict[int, str]

    @classmethod
    def find(cls, models: Path) -> ModelFiles:
        def first(folder: str, pattern: str, required: bool = True) -> str | None:
            found = sorted(p.name for p in (models / folder).glob(pattern))
            if not found and required:
                raise SystemExit(f"no {pattern} in {models / folder}: write the files first "
                                 "(bench/full_size_files.py)")
            return found[0] if found else None

        loras = {steps: name for steps in (4, 8)
                 if (name := first("loras", f"*Lightning-{steps}steps*.safetensors", required=False))}
        return cls(first("diffusion_models", "qwen_image_edit*.safetensors"),
                   first("text_encoders", "qwen_2.5_vl*.safetensors"), first("vae", "qwen_image_vae*.safetensors"),
                   loras)


def shipped_prompt(job: Job, files: ModelFiles, seed: int, text: str | None, tiny: bool) -> dict[str, Any]:
    """The shipped API workflow with the written files, ``seed`` and (if given) prompt ``text`` put in."""
    name = f"qwen_edit_{job.name}"
    prompt = json.loads((API_DIR / f"{name}.json").read_text())
    for node in prompt.values():
        inputs, kind = node["inputs"], node["class_type"]
        if kind == "QwenEditHopper_Load":
            inputs.update(diffusion_model=files.dit, text_encoder=files.text_encoder, vae=files.vae)
            if "host_blocks" in job.options:
                inputs["host_blocks"] = int(job.options["host_blocks"])
        elif kind == "QwenEditHopper_FuseLoRA":
            steps = int(job.options.get("lora") or (8 if "8steps" in inputs["lora_name"] else 4))
            if steps not in files.loras:
                raise SystemExit(f"{job.label}: no {steps}-step Lightning LoRA among the written files")
            inputs["lora_name"] = files.loras[steps]
            if "strength" in job.options:
                inputs["strength"] = float(job.options["strength"])
        elif kind == "QwenEditHopper_Compile" and job.options.get("graphs") == "off":
            inputs["cuda_graphs"] = False
        elif kind == "UNETLoader":
            inputs["unet_name"] = files.dit
        elif kind == "CLIPLoader":
            inputs["clip_name"] = files.text_encoder
        elif kind == "VAELoader":
            inputs["vae_name"] = files.vae
        elif kind == "KSampler":
            inputs["seed"] = seed
            if text is not None:
                prompt[inputs["positive"][0]]["inputs"]["prompt"] = text
            if tiny:
                inputs["steps"] = min(inputs["steps"], TINY_STEPS)
        elif kind in ("QwenEditHopper_Sampler", "QwenEditHopper_Benchmark"):
            inputs["seed"] = seed
            if text is not None:
                inputs["prompt"] = text
            if tiny:
                inputs["steps"] = min(inputs["steps"], TINY_STEPS)
                inputs["width"] = inputs["height"] = TINY_SIZE
                inputs["reference_megapixels"] = round(max(0.01, TINY_SIZE * TINY_SIZE / MIB), 4)
                if kind == "QwenEditHopper_Benchmark":
                    inputs.update(warmup=0, repeats=1)
    return prompt


def core_prompt(job: Job, files: ModelFiles, seed: int, text: str, tiny: bool,
                object_info: dict[str, Any]) -> dict[str, Any]:
    """ComfyUI core's Qwen-Image-Edit-2509 graph on the same files (module docstring); inputs a version lacks
    (``resolution_steps`` before 0.33) are left out, as its /object_info says."""
    steps = TINY_STEPS if tiny else FULL_STEPS
    megapixels = round(max(0.01, TINY_SIZE * TINY_SIZE / MIB), 4) if tiny else 1.0
    scale = {"image": ["1", 0], "upscale_method": "lanczos", "megapixels": megapixels}
    scale_inputs = object_info.get("ImageScaleToTotalPixels", {}).get("input", {})
    if "resolution_steps" in {**scale_inputs.get("required", {}), **scale_inputs.get("optional", {})}:
        scale["resolution_steps"] = 1
    prompt = {
        "1": {"class_type": "LoadImage", "inputs": {"image": INPUT_IMAGE}},
        "2": {"class_type": "ImageScaleToTotalPixels", "inputs": scale},
        "3": {"class_type": "UNETLoader", "inputs": {"unet_name": files.dit, "weight_dtype": "default"}},
        "4": {"class_type": "CLIPLoader", "inputs": {"clip_name": files.text_encoder, "type": "qwen_image"}},
        "5": {"class_type": "VAELoader", "inputs": {"vae_name": files.vae}},
        "6": {"class_type": "ModelSamplingAuraFlow", "inputs": {"model": ["3", 0], "shift": CORE_SHIFT}},
        "7": {"class_type": "TextEncodeQwenImageEditPlus",
              "inputs": {"clip": ["4", 0], "prompt": text, "vae": ["5", 0], "image1": ["2", 0]}},
        "8": {"class_type": "TextEncodeQwenImageEditPlus",
              "inputs": {"clip": ["4", 0], "prompt": "", "vae": ["5", 0], "image1": ["2", 0]}},
        "9": {"class_type": "VAEEncode", "inputs": {"pixels": ["2", 0], "vae": ["5", 0]}},
        "10": {"class_type": "KSampler", "inputs": {
            "model": ["6", 0], "seed": seed, "steps": steps, "cfg": CORE_CFG, "sampler_name": "euler",
            "scheduler": "simple", "positive": ["7", 0], "negative": ["8", 0], "latent_image": ["9", 0],
            "denoise": 1.0}},
        "11": {"class_type": "VAEDecode", "inputs": {"samples": ["10", 0], "vae": ["5", 0]}},
        "12": {"class_type": "SaveImage", "inputs": {"images": ["11", 0], "filename_prefix": "core"}},
    }
    if "compile" in job.options:
        prompt["13"] = {"class_type": "TorchCompileModel", "inputs": {"model": ["3", 0], "backend": "inductor"}}
        prompt["6"]["inputs"]["model"] = ["13", 0]
    return prompt


# ----------------------------------------------------------------------------- parsing

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


# ----------------------------------------------------------------------------- the run


def commit_of(root: Path) -> str:
    """``git describe``-like id of the checkout (short hash, ``+dirty`` when files differ), or ``unknown``."""
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=10", "HEAD"], capture_output=True,
                             text=True, check=True, timeout=20).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=20).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def comfyui_version(comfyui: Path) -> str:
    text = (comfyui / "comfyui_version.py").read_text()
    m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", text)
    return m.group(1) if m else "unknown"


def card() -> dict[str, str]:
    """GPU 0's name, memory and driver from nvidia-smi (empty without one)."""
    if not shutil.which("nvidia-smi"):
        return {}
    try:
        line = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=name,memory.total,driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout
        name, memory, driver = (s.strip() for s in line.strip().split(","))
        return {"name": name, "memory": memory, "driver": driver}
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}


class Deadline:
    """Seconds left until the run's deadline (None: no deadline)."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.monotonic() - RESERVE_S


class Run:
    """Servers and jobs of one plan; ``results`` is the JSON written after every job."""

    def __init__(self, args: argparse.Namespace, plan_name: str, plan: Plan):
        self.args = args
        self.plan = plan
        self.out: Path = args.out
        self.work: Path = args.work
        self.deadline = Deadline(args.deadline)
        self.files = ModelFiles.find(args.models.resolve())
        uses_model_path = any(job.name == MODEL_PATH for spec in plan.servers for job in parse_jobs(spec.jobs))
        if uses_model_path and "fp8" in self.files.dit:
            raise SystemExit(f"plan {plan_name} runs {MODEL_PATH}, which quantizes high-precision weights; the "
                             f"models folder holds {self.files.dit}: write the bf16 DiT (--dit bf16)")
        self.sampler = MemorySampler(gpu=not args.cpu)
        self.durations: dict[tuple[str, bool], float] = {}
        self.seed = args.seed
        self.prompt_index = 0
        self.server: ComfyServer | None = None
        self.log_offset = 0
        self.object_info: dict[str, Any] = {}
        self.loaded: set[str] = set()
        version = comfyui_version(args.comfyui)
        if plan.comfyui not in ("any", version):
            raise SystemExit(f"plan {plan_name} runs on ComfyUI {plan.comfyui}; {args.comfyui} is {version}")
        self.results: dict[str, Any] = {
            "tool": "bench/product_path.py", "plan": plan_name, "description": plan.description,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": args.commit or commit_of(ROOT),
            "card": card(), "comfyui_version": version, "sizes": "tiny" if args.tiny else "full",
            "device": "cpu" if args.cpu else "gpu", "files": {**self.files.__dict__, "models": str(args.models)},
            "written": json.loads(args.written.read_text()) if args.written and args.written.exists() else None,
            "servers": [], "summary": {},
        }

    # -- bookkeeping

    def save(self) -> None:
        """results.json and the running server's log so far, in ``--out``: a run stopped from outside (the device
        call's limit) still leaves both behind."""
        self.results["summary"] = summarize(self.results)
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1) + "\n")
        tmp.replace(self.out / "results.json")
        self.keep_server_log()

    def keep_server_log(self) -> None:
        """The current server's log (its last 2 MB) as ``--out``/server-N.log, N its place in the plan."""
        if self.server is None:
            return
        with contextlib.suppress(OSError):
            log = self.server.log_path.read_text(errors="replace")
            (self.out / f"server-{len(self.results['servers'])}.log").write_text(log[-2_000_000:])

    def estimate(self, job: Job) -> float:
        first = job.kind != "free" and job.estimate_key not in self.loaded
        measured = self.durations.get((job.estimate_key, first))
        if measured is not None:
            return measured
        full = ESTIMATE_S.get(job.estimate_key, (120, 45))[0 if first else 1]
        return full * (0.5 if self.args.tiny else 1.0)

    # -- servers

    def start_server(self, spec: ServerSpec, index: int, record: dict[str, Any]) -> bool:
        base = self.work / f"{index}-{spec.label}"
        if base.exists():
            shutil.rmtree(base)
        (base / "input").mkdir(parents=True)
        example_image(base / "input" / INPUT_IMAGE, TINY_SIZE if self.args.tiny else FULL_SIZE)
        (base / "frontend").mkdir()
        cache = self.cache_dirs(spec, index, record)
        env = {"TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton")}
        if self.args.cpu:
            env["QWEN_EDIT_FP8_EMULATE"] = "1"  # FP8 kernels that cannot run on a CPU run as their mirrors, said
        args = ("--extra-model-paths-config", str(write_extra_model_paths(base, self.args.models.resolve())),
                "--front-end-root", str(base / "frontend"), *spec.args, *self.args.server_arg)
        installation = ComfyInstall(self.results["comfyui_version"], self.args.comfyui, Path(sys.executable))
        self.server = ComfyServer(base, extra_args=args, cpu=self.args.cpu, env=env, installation=installation)
        record.update(args=list(args), command=self.server.command[1:], env=env, cpu=self.args.cpu, base=str(base))
        started = time.perf_counter()
        try:
            self.server.start(timeout=max(30.0, min(300.0, self.deadline.left())))
        except (RuntimeError, TimeoutError, OSError) as exc:
            record["start_error"] = str(exc)[-4000:]
            print(f"server {spec.label} did not start: {str(exc)[-2000:]}", flush=True)
            return False
        record["start_s"] = round(time.perf_counter() - started, 2)
        self.sampler.pid = self.server.process.pid
        self.log_offset = self.server.log_path.stat().st_size
        self.loaded.clear()
        time.sleep(HELD_AFTER_S)
        now = time.time()
        self.sampler.settle(now)
        record["idle"] = {"gpu_MiB": self.sampler.gpu_at(now),
                          "anon_GiB": round((rss_anon(self.server.process.pid) or 0) / GIB, 3)}
        with contextlib.suppress(Exception):
            record["system_stats"] = self.server.get("/system_stats", timeout=10).json()
        with contextlib.suppress(Exception):
            self.object_info = self.server.object_info()
        print(f"server {spec.label} ready in {record['start_s']} s (pid {self.server.process.pid}); "
              f"idle {record['idle']}", flush=True)
        return True

    def cache_dirs(self, spec: ServerSpec, index: int, record: dict[str, Any]) -> Path:
        if self.args.keep_caches:
            cache = self.work / KEPT_CACHES
            cache.mkdir(parents=True, exist_ok=True)
            record["caches"] = "kept"
            record["kept_cache_files"] = sum(1 for path in cache.rglob("*") if path.is_file())
            return cache
        if spec.caches == "reuse" and index > 0:
            return self.work / f"cache-{index - 1}"
        cache = self.work / f"cache-{index}"
        if cache.exists():
            shutil.rmtree(cache)
        cache.mkdir(parents=True)
        return cache

    def stop_server(self, record: dict[str, Any]) -> None:
        if self.server is None:
            return
        process = self.server.process
        record["alive_at_end"] = process is not None and process.poll() is None
        if process is not None and process.poll() is not None:
            record["returncode"] = process.returncode
        self.server.stop()
        self.sampler.pid = None
        self.keep_server_log()
        self.server = None

    def alive(self) -> bool:
        if self.server is None or self.server.process is None or self.server.process.poll() is not None:
            return False
        try:
            return self.server.get("/system_stats", timeout=15).ok
        except Exception:  # any failure to answer: not alive
            return False

    def new_log(self) -> str:
        with open(self.server.log_path, "rb") as handle:
            handle.seek(self.log_offset)
            data = handle.read()
        self.log_offset += len(data)
        return data.decode(errors="replace")

    # -- jobs

    def run_job(self, job: Job, number: int) -> dict[str, Any]:
        record: dict[str, Any] = {"n": number, "job": job.label, "series": job.series, "index": job.index}
        if job.kind == "free":
            t0 = time.time()
            self.server.free()
            time.sleep(2.0)
            self.server.wait_idle(timeout=60)
            time.sleep(HELD_AFTER_S)
            after = time.time()
            self.sampler.settle(after)
            record.update(ok=True, seconds=round(after - t0, 2), gpu=self.sampler.gpu_window(t0, after, after),
                          host=self.sampler.anon_window(t0, after, after))
            self.loaded.clear()
            with contextlib.suppress(Exception):  # what PyTorch's allocator holds: live tensors or its cache
                record["torch_after"] = torch_memory(self.server.get("/system_stats", timeout=10).json())
            record["survived"] = self.alive()
            return record
        self.seed = int(job.options["seed"]) if job.options.get("seed") else self.seed + 1
        text = None
        if "vary" in job.options:
            self.prompt_index += 1
            text = PROMPTS[self.prompt_index % len(PROMPTS)]
        if job.kind == "core":
            prompt = core_prompt(job, self.files, self.seed, text or PROMPT, self.args.tiny, self.object_info)
        else:
            prompt = shipped_prompt(job, self.files, self.seed, text, self.args.tiny)
        record.update(seed=self.seed, prompt_text=text or PROMPT, first_on_server=job.estimate_key not in self.loaded)
        timeout = max(10.0, min(self.args.job_timeout, self.deadline.left()))
        t0 = time.time()
        try:
            entry = self.server.run(prompt, timeout=timeout)
            record["ok"] = True
            record["images"] = [str(p) for p in self.server.output_files(entry)]
            record["info"] = [t for out in entry.get("outputs", {}).values() for t in out.get("text", [])]
            messages = dict(entry.get("status", {}).get("messages", []))
        except PromptRejectedError as exc:
            record.update(ok=False, error="rejected: " + exc.messages()[:2000])
            messages = {}
        except PromptFailedError as exc:
            event = exc.event("execution_error") or {}
            interrupted = exc.event("execution_interrupted")
            record.update(ok=False, error=f"{event.get('exception_type')}: {event.get('exception_message')}"
                          if event else ("interrupted" if interrupted else str(exc)[:2000]),
                          error_node=event.get("node_type"), traceback="".join(event.get("traceback", []))[-6000:])
            messages = dict(exc.messages)
        except TimeoutError as exc:
            record.update(ok=False, error=f"timeout after {timeout:.0f} s: {exc}")
            messages = {}
            with contextlib.suppress(Exception):
                self.server.interrupt()
                self.server.wait_idle(timeout=15)
        except Exception as exc:  # the server died or hung: recorded
            record.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[-3000:]}")
            messages = {}
        t1 = time.time()
        record["poll_wall_s"] = round(t1 - t0, 2)
        end = messages.get("execution_success") or messages.get("execution_error") or {}
        start = messages.get("execution_start") or {}
        if "timestamp" in end:
            record["queue_to_image_s" if record["ok"] else "queue_to_end_s"] = round(end["timestamp"] / 1000 - t0, 3)
            if "timestamp" in start:
                record["exec_s"] = round((end["timestamp"] - start["timestamp"]) / 1000, 3)
            t1 = min(t1, end["timestamp"] / 1000)
        time.sleep(HELD_AFTER_S)
        after = time.time()
        self.sampler.settle(after)
        record["gpu"] = self.sampler.gpu_window(t0, t1, after)
        record["host"] = self.sampler.anon_window(t0, t1, after)
        info = "\n".join(record.get("info", []))
        record["stages"] = parse_stages(info)
        with contextlib.suppress(OSError):
            log = self.new_log()
            record["log"] = parse_log(log)
            wall = record["log"].get("sampler_wall")
            if wall and "timestamp" in start and "timestamp" in end:
                record["around_sampler"] = {"before_s": round(wall[0] - start["timestamp"] / 1000, 3),
                                            "after_s": round(end["timestamp"] / 1000 - wall[1], 3)}
            if not record["ok"]:
                record["log_tail"] = log[-4000:]
        record["survived"] = self.alive()
        if record["ok"]:
            self.durations[(job.estimate_key, record["first_on_server"])] = record["poll_wall_s"] + HELD_AFTER_S
            self.loaded.add(job.estimate_key)
        return record

    def run(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        number = 0
        for index, spec in enumerate(self.plan.servers):
            jobs = parse_jobs(spec.jobs)
            record: dict[str, Any] = {"label": spec.label, "caches": spec.caches, "jobs_planned": spec.jobs,
                                      "jobs": [], "restarts": []}
            self.results["servers"].append(record)
            first = jobs[0] if jobs else None
            needed = SERVER_START_ESTIMATE_S + (self.estimate(first) if first else 0)
            if self.deadline.left() < needed:
                record["skipped"] = f"{self.deadline.left():.0f} s left, a start and its first job need ~{needed:.0f}"
                self.save()
                continue
            if not self.start_server(spec, index, record):
                self.save()
                continue
            self.save()
            try:
                for job in jobs:
                    number += 1
                    if not self.alive() and not self.restart(spec, index, record):
                        record["jobs"].append({"n": number, "job": job.label, "series": job.series,
                                               "index": job.index, "skipped": "the server is gone"})
                        continue
                    need = self.estimate(job)
                    if self.deadline.left() < need:
                        record["jobs"].append({"n": number, "job": job.label, "series": job.series,
                                               "index": job.index,
                                               "skipped": f"{self.deadline.left():.0f} s left, needs ~{need:.0f}"})
                        print(f"skip {job.label}: {self.deadline.left():.0f} s left, needs ~{need:.0f}", flush=True)
                        self.save()
                        continue
                    # in the results until it ends: a run stopped from outside shows the prompt it stopped in
                    record["jobs"].append({"n": number, "job": job.label, "series": job.series, "index": job.index,
                                           "ok": False, "unfinished": True, "stages": {},
                                           "error": "unfinished: the run stopped while this prompt ran"})
                    self.save()
                    print(f"[{spec.label} {number}] {job.label} ({self.deadline.left():.0f} s left)", flush=True)
                    try:
                        result = self.run_job(job, number)
                    except Exception as exc:  # the tool's own failure (the server stopped answering): recorded
                        result = {"n": number, "job": job.label, "series": job.series, "index": job.index,
                                  "ok": False, "error": f"{type(exc).__name__}: {exc}"[-3000:], "stages": {},
                                  "survived": self.alive()}
                    record["jobs"][-1] = result
                    self.save()
                    print("  " + one_line(result), flush=True)
                    if not result.get("ok"):
                        print(textwrap_error(result), flush=True)
            finally:
                self.stop_server(record)
                self.save()

    def restart(self, spec: ServerSpec, index: int, record: dict[str, Any]) -> bool:
        """After the server died: record how, start it again on the same caches if there is time."""
        process = self.server.process if self.server else None
        event = {"returncode": None if process is None else process.poll()}
        with contextlib.suppress(OSError):
            event["log_tail"] = self.new_log()[-4000:]
        record["restarts"].append(event)
        if self.deadline.left() < SERVER_START_ESTIMATE_S + 30:
            return False
        self.server.stop()
        started = time.perf_counter()
        try:
            self.server.start(timeout=max(30.0, min(300.0, self.deadline.left())))
        except (RuntimeError, TimeoutError, OSError) as exc:
            event["start_error"] = str(exc)[-2000:]
            return False
        event["start_s"] = round(time.perf_counter() - started, 2)
        self.sampler.pid = self.server.process.pid
        self.log_offset = self.server.log_path.stat().st_size
        self.loaded.clear()
        return True


# ----------------------------------------------------------------------------- summaries and tables


def _num(value: Any, digits: int = 2) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return f"{value:.{digits}f}" if isinstance(value, float) else str(value)
    return str(value)


def _shown_arg(arg: str) -> str:
    """A server argument as the table shows it: paths by their last part (``.../extra_model_paths.yaml``)."""
    return f".../{Path(arg).name}" if arg.startswith("/") else arg


def torch_memory(system_stats: dict[str, Any]) -> dict[str, float] | None:
    """PyTorch's memory on the server's first CUDA device from ComfyUI's ``/system_stats`` (its ``torch_vram_total``
    is what the allocator reserved, ``torch_vram_free`` the reserved part no tensor uses): ``allocated_MiB`` (live
    tensors) and ``reserved_MiB``; None without a CUDA device."""
    for device in system_stats.get("devices", []):
        if device.get("type") == "cuda":
            reserved, unused = device["torch_vram_total"], device["torch_vram_free"]
            return {"allocated_MiB": round((reserved - unused) / 2**20, 1), "reserved_MiB": round(reserved / 2**20, 1)}
    return None


def _gib(mib: float | None) -> float | None:
    return None if mib is None else round(mib / 1024, 2)


def _growth(first: float | None, last: float | None) -> float | None:
    if first is None or last is None or first == 0:
        return None
    return round(100.0 * (last - first) / first, 2)


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Figures across jobs: first images per server, repeated series, LoRA changes."""
    summary: dict[str, Any] = {"servers": [], "series": [], "lora_changes": []}
    for server in results["servers"]:
        jobs = [j for j in server["jobs"] if "skipped" not in j]
        first = next((j for j in jobs if not j["job"].startswith("free")), None)
        entry = {"label": server["label"], "caches": server["caches"], "start_s": server.get("start_s"),
                 "idle_anon_GiB": (server.get("idle") or {}).get("anon_GiB"),
                 "idle_gpu_GiB": _gib((server.get("idle") or {}).get("gpu_MiB")),
                 "jobs_ok": sum(1 for j in jobs if j.get("ok")), "jobs_failed": sum(1 for j in jobs if not j.get("ok")),
                 "jobs_skipped": len(server["jobs"]) - len(jobs), "restarts": len(server.get("restarts", [])),
                 "alive_at_end": server.get("alive_at_end")}
        if first is not None and first.get("ok") and server.get("start_s") is not None:
            entry["first_job"] = first["job"]
            entry["first_image_s"] = round(server["start_s"] + first["queue_to_image_s"], 2)
        peaks = [(j.get("host") or {}).get("peak_GiB") for j in jobs]
        peaks = [p for p in peaks if p is not None]
        if peaks and entry["idle_anon_GiB"] is not None:
            entry["anon_peak_above_idle_GiB"] = round(max(peaks) - entry["idle_anon_GiB"], 2)
        summary["servers"].append(entry)
        series: dict[str, list[dict[str, Any]]] = {}
        for job in server["jobs"]:
            series.setdefault(job["series"], []).append(job)
        for name, members in series.items():
            ran = [j for j in members if "skipped" not in j]
            if len(members) < 2 or name.startswith("free") or not ran:
                continue
            walls = [j["queue_to_image_s"] for j in ran if j.get("ok")]
            steps = [j["stages"].get("s_per_step") or (j.get("log") or {}).get("s_per_step")
                     for j in ran if j.get("ok")]
            steps = [s for s in steps if s]
            held = [(j.get("gpu") or {}).get("held_MiB") for j in ran]
            anon = [(j.get("host") or {}).get("after_GiB") for j in ran]
            summary["series"].append({
                "server": server["label"], "series": name, "planned": len(members), "ran": len(ran),
                "ok": len(walls), "failed": len(ran) - len(walls), "skipped": len(members) - len(ran),
                "wall_median_s": round(statistics.median(walls), 3) if walls else None,
                "wall_min_s": min(walls) if walls else None, "wall_max_s": max(walls) if walls else None,
                "s_per_step_median": round(statistics.median(steps), 4) if steps else None,
                "gpu_held_first_GiB": _gib(held[0]), "gpu_held_last_GiB": _gib(held[-1]),
                "gpu_held_growth_pct": _growth(held[0], held[-1]),
                "gpu_peak_max_GiB": _gib(max((p for j in ran if (p := (j.get("gpu") or {}).get("peak_MiB"))),
                                             default=None)),
                "anon_after_first_GiB": anon[0], "anon_after_last_GiB": anon[-1],
                "anon_growth_pct": _growth(anon[0], anon[-1]),
                "survived_all": all(j.get("survived") for j in ran if not j.get("unfinished")),
            })
        for job in jobs:
            if "lora=" in job["job"] or "strength=" in job["job"]:
                summary["lora_changes"].append({
                    "server": server["label"], "job": job["job"], "ok": job.get("ok"),
                    "queue_to_image_s": job.get("queue_to_image_s"),
                    "graphs_compiled": job["stages"].get("graphs_compiled"),
                    "first_step_s": job["stages"].get("first_step_s")})
    return summary


def one_line(job: dict[str, Any]) -> str:
    """A job's main figures on one line (progress output)."""
    stages, gpu, host = job.get("stages", {}), job.get("gpu", {}), job.get("host", {})
    parts = [f"ok={job.get('ok')}", f"queue->image {job.get('queue_to_image_s', job.get('poll_wall_s'))} s"]
    for key in ("encode_s", "denoise_s", "s_per_step", "decode_s", "first_step_s", "graphs_compiled"):
        if key in stages:
            parts.append(f"{key} {stages[key]}")
    if (job.get("log") or {}).get("s_per_step") and "s_per_step" not in stages:
        parts.append(f"log s/step {job['log']['s_per_step']}")
    if gpu:
        parts.append(f"GPU peak/held {_gib(gpu.get('peak_MiB'))}/{_gib(gpu.get('held_MiB'))} GiB")
    if host:
        parts.append(f"anon peak/after {host.get('peak_GiB')}/{host.get('after_GiB')} GiB")
    parts.append(f"survived={job.get('survived')}")
    return ", ".join(parts)


def textwrap_error(job: dict[str, Any]) -> str:
    return f"  error: {job.get('error')}\n{job.get('traceback') or job.get('log_tail', '')[-1500:]}"


def markdown(results: dict[str, Any], heading: str = "###") -> str:
    """The run as markdown: what ran where, one row per job, the summary."""
    c = results.get("card") or {}
    where = f"{c['name']} ({c['memory']}, driver {c['driver']})" if c else results.get("device", "")
    lines = [f"{heading} {results['plan']}: {results.get('description', '')}", "",
             f"- card: {where}; "
             f"date {results['date']}; commit {results['commit']}; ComfyUI {results['comfyui_version']}; "
             f"{results['sizes']} sizes; files: {results['files']['dit']}, {results['files']['text_encoder']}, "
             f"{results['files']['vae']}"]
    if results.get("note"):
        lines.append(f"- note: {results['note']}")
    written = results.get("written")
    if written:
        lines.append(f"- files written in {written.get('seconds')} s ({written.get('bytes', 0) / 1e9:.1f} GB, "
                     f"drawn on {written.get('device')})")
    lines.append("- every server: `python main.py --listen 127.0.0.1 --port P --base-directory B "
                 "--disable-auto-launch --disable-api-nodes --database-url sqlite:///:memory:` plus the arguments "
                 "below (the models through extra_model_paths.yaml, an empty --front-end-root); the rest is "
                 "ComfyUI's default")
    for server in results["servers"]:
        if server.get("skipped"):
            lines.append(f"- server `{server['label']}` (caches {server['caches']}): skipped, {server['skipped']}")
            continue
        stats = server.get("system_stats") or {}
        device = ((stats.get("devices") or [{}])[0]).get("name", "")
        args = " ".join(_shown_arg(a) for a in [*(["--cpu"] if server.get("cpu") else []), *server.get("args", [])])
        idle = server.get("idle") or {}
        gpu_idle = f"idle GPU {_num(_gib(idle.get('gpu_MiB')))} GiB, " if idle.get("gpu_MiB") is not None else "idle "
        caches = server["caches"] + (f", {server['kept_cache_files']} files at its start from earlier runs"
                                     if "kept_cache_files" in server else "")
        lines.append(f"- server `{server['label']}` (Inductor/Triton caches {caches}): `{args}`; "
                     f"start {_num(server.get('start_s'))} s; {gpu_idle}host anon {_num(idle.get('anon_GiB'))} GiB; "
                     f"device `{device}`"
                     + (f"; did not start: {' '.join(server['start_error'].split())[-300:]}"
                        if server.get("start_error") else ""))
    lines += ["", "| server | # | job | ok | queue->image s | encode s | denoise s | s/step | decode s | first step s "
              "/ graphs | GPU peak / held GiB (card) | torch peak / held GiB | anon peak / after GiB | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for server in results["servers"]:
        for job in server["jobs"]:
            st, gpu, host, log = job.get("stages", {}), job.get("gpu", {}), job.get("host", {}), job.get("log", {})
            if "skipped" in job:
                note = "skipped: " + job["skipped"]
            elif not job.get("ok"):
                note = " ".join((job.get("error") or "").split())[:160].replace("|", "/")
            else:
                note = "survived" if job.get("survived") else "server gone after it"
                if st.get("cuda_graphs"):
                    note = f"CUDA graphs: {st['cuda_graphs'][:100]}"
            if job["job"].startswith("free") and "skipped" not in job:
                torch_after = job.get("torch_after") or {}
                torch_held = (f"{_num(_gib(torch_after['allocated_MiB']))} / {_num(_gib(torch_after['reserved_MiB']))}"
                              " (allocated / reserved)" if torch_after else "")
                lines.append(f"| {server['label']} | {job['n']} | free | {_num(job.get('ok'))} | "
                             f"{_num(job.get('seconds'))} | | | | | | held {_num(_gib(gpu.get('held_MiB')))} | "
                             f"{torch_held} | after {_num(host.get('after_GiB'))} | |")
                continue
            step = st.get("s_per_step") or log.get("s_per_step")
            encode = _num(st.get("encode_s")) + (" (cached)" if st.get("encode_cached") else "")
            first = "" if "first_step_s" not in st else f"{_num(st['first_step_s'])} / {st.get('graphs_compiled')}"
            lines.append(
                f"| {server['label']} | {job['n']} | {job['job']} | {_num(job.get('ok'))} | "
                f"{_num(job.get('queue_to_image_s'))} | {encode} | {_num(st.get('denoise_s'))} | {_num(step, 3)} | "
                f"{_num(st.get('decode_s'))} | {first} | {_num(_gib(gpu.get('peak_MiB')))} / "
                f"{_num(_gib(gpu.get('held_MiB')))} | {_num(st.get('torch_peak_GiB'))} / "
                f"{_num(st.get('torch_held_GiB'))} | {_num(host.get('peak_GiB'))} / {_num(host.get('after_GiB'))} | "
                f"{note} |")
    summary = results.get("summary") or summarize(results)
    lines.append("")
    for s in summary["servers"]:
        if "first_image_s" in s:
            lines.append(f"- `{s['label']}` (caches {s['caches']}): server start {s['start_s']} s + first "
                         f"{s['first_job']} prompt = first image after **{s['first_image_s']} s**")
        if "anon_peak_above_idle_GiB" in s:
            lines.append(f"- `{s['label']}`: host anonymous memory peak {s['anon_peak_above_idle_GiB']} GiB above the "
                         f"idle server ({s['idle_anon_GiB']} GiB); jobs ok {s['jobs_ok']}, failed {s['jobs_failed']}, "
                         f"skipped {s['jobs_skipped']}; restarts {s['restarts']}; alive at the end: "
                         f"{_num(s['alive_at_end'])}")
    for s in summary["series"]:
        lines.append(f"- series `{s['series']}` on `{s['server']}`: {s['ok']} of {s['planned']} ok ({s['failed']} "
                     f"failed, {s['skipped']} skipped), queue->image median {_num(s['wall_median_s'])} s "
                     f"(min {_num(s['wall_min_s'])}, max {_num(s['wall_max_s'])}), s/step median "
                     f"{_num(s['s_per_step_median'], 3)}; "
                     + (f"GPU held {_num(s['gpu_held_first_GiB'])} -> {_num(s['gpu_held_last_GiB'])} GiB "
                        f"({_num(s['gpu_held_growth_pct'])}%), peak max {_num(s['gpu_peak_max_GiB'])} GiB; "
                        if s["gpu_held_first_GiB"] is not None else "")
                     + f"host anon {_num(s['anon_after_first_GiB'])} -> "
                     f"{_num(s['anon_after_last_GiB'])} GiB ({_num(s['anon_growth_pct'])}%); server survived every "
                     f"prompt: {_num(s['survived_all'])}")
    for s in summary["lora_changes"]:
        lines.append(f"- LoRA change `{s['job']}` on `{s['server']}`: {_num(s['queue_to_image_s'])} s queue->image, "
                     f"graphs compiled {s['graphs_compiled']}, first step {_num(s['first_step_s'])} s")
    errors = [(server["label"], job) for server in results["servers"] for job in server["jobs"]
              if "skipped" not in job and not job.get("ok")]
    for label, job in errors[:6]:
        error = " ".join((job.get("error") or "").split())[:400]
        lines.append(f"- error in `{job['job']}` (#{job['n']}, `{label}`): {error}")
    return "\n".join(lines) + "\n"


def _jobs(runs: list[dict[str, Any]], version: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(server, job) of every job that ran on ComfyUI ``version``."""
    return [(server, job) for run in runs if run["comfyui_version"] == version for server in run["servers"]
            for job in server["jobs"] if "skipped" not in job]


def _job_kind(job: str) -> str:
    """``fastest``, ``core`` (ComfyUI core's own workflow), ``model`` (ComfyUI's loaders with the pack's nodes on
    the MODEL), ``free``, or ``other`` (the pack's other workflows)."""
    if job.split(":")[0] == MODEL_PATH:
        return "model"
    for kind in ("fastest", "core", "free"):
        if job.startswith(kind):
            return kind
    return "other"


COMFY_LOADER_KINDS = ("core", "model")
"""Job kinds whose models ComfyUI's own loaders hold, and keep (in GPU or host memory) after the prompt."""


def _after_comfy_loaders(server: dict[str, Any], job: dict[str, Any]) -> bool:
    """Whether a job of :data:`COMFY_LOADER_KINDS` ran on ``server`` before ``job``: then the card and the server's
    host memory also hold what ComfyUI keeps of that model, and ``job``'s peaks are not its own."""
    return any(_job_kind(j["job"]) in COMFY_LOADER_KINDS and "skipped" not in j
               for j in server["jobs"][:server["jobs"].index(job)])


def _anon_above_idle(runs: list[dict[str, Any]], version: str, kind: str) -> float | None:
    """The highest host anonymous memory of a server during prompts of ``kind`` (:func:`_job_kind`), above that
    server when idle (GiB); for the pack's own workflows, only prompts that no ComfyUI-loader prompt preceded on
    their server (:func:`_after_comfy_loaders`)."""
    above = []
    for run in runs:
        if run["comfyui_version"] != version:
            continue
        for server in run["servers"]:
            idle = (server.get("idle") or {}).get("anon_GiB")
            peaks = [(j.get("host") or {}).get("peak_GiB") for j in server["jobs"]
                     if "skipped" not in j and _job_kind(j["job"]) == kind
                     and (kind in COMFY_LOADER_KINDS or not _after_comfy_loaders(server, j))]
            peaks = [p for p in peaks if p is not None]
            if idle is not None and peaks:
                above.append(round(max(peaks) - idle, 2))
    return max(above, default=None)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def _check(value: float | None, limit: float) -> str:
    return "" if value is None else ("yes" if value <= limit else "no")


def _across_runs(verdict: str, sides: list[list[dict[str, Any]]], commit_of: dict[int, str]) -> str:
    """``verdict``, saying so where the two sides of a ratio ran in different calls (commits named)."""
    commits = [sorted({commit_of.get(id(j), "?") for j in side}) for side in sides]
    if verdict and (len(commits[0]) != 1 or commits[0] != commits[1]):
        return f"{verdict} (a ratio across runs: {', '.join(commits[0])} / {', '.join(commits[1])})"
    return verdict


def _model_path_rows(ok: list[tuple[dict, dict]], of: Callable[..., list[dict[str, Any]]],
                     commit_of: dict[int, str]) -> list[tuple[str, str, str]]:
    """The MODEL path's targets: warm s/step (KSampler's progress line) against ComfyUI core's best warm s/step on
    the same files (with or without TorchCompileModel) and against the pack's own fastest workflow."""
    model_jobs = [j for j in of(MODEL_PATH, warm=True) if (j.get("log") or {}).get("s_per_step")]
    if not model_jobs:
        return []
    step = statistics.median(j["log"]["s_per_step"] for j in model_jobs)
    core_jobs = [j for _, j in ok if _job_kind(j["job"]) == "core"
                 and not j.get("first_on_server") and (j.get("log") or {}).get("s_per_step")]
    core = [j["log"]["s_per_step"] for j in core_jobs]
    fastest_jobs = [j for j in of("fastest", warm=True) if "s_per_step" in j["stages"]]
    model_commits = {commit_of.get(id(j)) for j in model_jobs}
    fastest_jobs = [j for j in fastest_jobs if commit_of.get(id(j)) in model_commits] or fastest_jobs  # same run first
    fastest = [j["stages"]["s_per_step"] for j in fastest_jobs]
    rows = [("ComfyUI core nodes + FP8 (KSampler on the pack's MODEL), warm s/step", f"median {_num(step, 3)}", "")]
    compiled = [j for _, j in ok if j["job"].startswith("core:compile") and not j.get("first_on_server")
                and (j.get("log") or {}).get("s_per_step")]
    if core:
        ratio = round(step / min(core), 3)
        measured = f"{ratio}x ({_num(step, 3)} / {_num(min(core), 3)})"
        if compiled:
            best = min(core_jobs, key=lambda j: j["log"]["s_per_step"])
            rows.append(("its s/step <= 0.55x core's best warm s/step on the same files", measured,
                         _across_runs(_check(ratio, 0.55), [model_jobs, [best]], commit_of)))
        else:  # core's best is its compiled step: without it the target cannot be judged
            rows.append(("its s/step against core's warm s/step without TorchCompileModel (the target, 0.55x "
                         "core's best, needs core's compiled warm step, not measured here)", measured, ""))
    if fastest:
        pack = statistics.median(fastest)
        ratio = round(step / pack, 3)
        rows.append(("its s/step within 10% of the pack's fastest workflow",
                     f"{ratio}x ({_num(step, 3)} / {_num(pack, 3)})",
                     _across_runs(_check(ratio, 1.10), [model_jobs, fastest_jobs], commit_of)))
    return rows


def targets(runs: list[dict[str, Any]]) -> str:
    """The issue's targets against what the runs of one card measured, per ComfyUI version, as markdown."""
    lines = ["| ComfyUI | target | measured | met |", "|---|---|---|---|"]
    for version in sorted({r["comfyui_version"] for r in runs}):
        jobs = _jobs(runs, version)
        ok = [(srv, j) for srv, j in jobs if j.get("ok")]

        def of(name: str, warm: bool | None = None, plain: bool = True, ok=ok) -> list[dict[str, Any]]:
            return [j for _, j in ok if j["job"].split(":")[0] == name
                    and (not plain or j["job"] in (name, f"{name}:vary"))
                    and (warm is None or j.get("first_on_server") is not warm)]

        def newest(name: str, warm: bool | None = None, plain: bool = True, version: str = version,
                   keep: Callable[[dict[str, Any], dict[str, Any]], bool] = lambda srv, j: True
                   ) -> tuple[list[dict[str, Any]], str]:
            """:func:`of`'s jobs (those ``keep(server, job)`` takes) from the newest run of ``version`` that has any
            (the pack's build changes between runs; its memory and times are those of the newest code measured),
            and that run's date and commit."""
            for run in sorted((r for r in runs if r["comfyui_version"] == version), key=lambda r: r["date"],
                              reverse=True):
                picked = of(name, warm, plain, ok=[(srv, j) for srv in run["servers"] for j in srv["jobs"]
                                                   if "skipped" not in j and j.get("ok") and keep(srv, j)])
                if picked:
                    return picked, f" (newest run: {run['date'][:10]}, {run['commit'][:7]})"
            return [], ""

        series = [{**s, "run": f" ({r['date'][:10]}, {r['commit'][:7]})"}  # each 20-prompt series, its run named
                  for r in sorted(runs, key=lambda r: r["date"]) if r["comfyui_version"] == version
                  for s in summarize(r)["series"] if s["series"].startswith("fastest:vary") and s["planned"] >= 20]
        rows: list[tuple[str, str, str]] = []
        for s in series:
            rows.append(("20 fastest prompts in a row, new seeds and prompts: nothing lost, no crash",
                         f"{s['ok']} of {s['planned']} ok, server survived each: {_num(s['survived_all'])}{s['run']}",
                         "yes" if s["ok"] == s["planned"] and s["survived_all"] else "no"))
        alone, fastest_run = newest("fastest", keep=lambda srv, j: not _after_comfy_loaders(srv, j))
        peak = max((j["gpu"]["peak_MiB"] for j in alone if (j.get("gpu") or {}).get("peak_MiB")), default=None)
        torch_peak = max((j["stages"]["torch_peak_GiB"] for j in alone if "torch_peak_GiB" in j["stages"]),
                         default=None)
        rows.append(("GPU peak of a fastest prompt <= 28 GiB (card; PyTorch's allocator), on servers where no "
                     "ComfyUI-loader prompt ran before it",
                     f"{_num(_gib(peak))} GiB; {_num(torch_peak)} GiB{fastest_run}", _check(_gib(peak), 28.0)))
        held = [j["gpu"]["held_MiB"] for j in alone if (j.get("gpu") or {}).get("held_MiB")]
        rows.append(("GPU memory held between fastest prompts (card): the fp8 DiT + what ComfyUI keeps",
                     f"median {_num(_gib(_median(held)))} GiB{fastest_run}", ""))
        low, low_run = newest("low_vram")
        low = [j["gpu"]["peak_MiB"] for j in low if (j.get("gpu") or {}).get("peak_MiB")]
        rows.append(("GPU peak of a low VRAM prompt <= 20 GiB (card)",
                     f"{_num(_gib(max(low, default=None)))} GiB{low_run}", _check(_gib(max(low, default=None)), 20.0)))
        warm_jobs, warm_run = newest("fastest", warm=True)
        seeds_only = [j["queue_to_image_s"] for j in warm_jobs if j["job"] == "fastest"]
        new_prompts = [j["queue_to_image_s"] for j in of("fastest", warm=True) if j["job"] == "fastest:vary"]
        warm = _median(seeds_only or new_prompts)
        rows.append(("warm fastest, queue to image <= 14.0 s (H100)" + ("" if seeds_only else
                     ", each prompt a new text (its encoding included)"), f"median {_num(warm)} s{warm_run}",
                     _check(warm, 14.0)))
        if seeds_only and new_prompts:
            rows.append(("warm fastest with a new prompt text each time (its encoding included)",
                         f"median {_num(_median(new_prompts))} s", ""))
        commit_of = {id(j): r["commit"][:7] for r in runs for srv in r["servers"] for j in srv["jobs"]}
        core_jobs = [j for _, j in ok if _job_kind(j["job"]) == "core" and not j.get("first_on_server")]
        if warm is not None and core_jobs:
            best = min(core_jobs, key=lambda j: j["queue_to_image_s"])
            ratio = round(warm / best["queue_to_image_s"], 3)
            measured = f"{ratio}x ({warm} s / {best['queue_to_image_s']} s)"
            if any(j["job"].startswith("core:compile") for j in core_jobs):
                rows.append(("warm fastest <= 0.42x core's best warm prompt (core's workflow on the runs' fp8 or bf16 "
                             "DiT file, whichever was faster)", measured,
                             _across_runs(_check(ratio, 0.42), [warm_jobs, [best]], commit_of)))
            else:  # core's best is its compiled prompt: without it the target cannot be judged
                rows.append(("warm fastest against core's warm prompt without TorchCompileModel (the target, 0.42x "
                             "core's best, needs core's compiled warm prompt, not measured on this version)",
                             measured, ""))
        rows += _model_path_rows(ok, of, commit_of)
        lightning, lightning_run = newest("lightning_4step", warm=True)
        lightning = _median([j["queue_to_image_s"] for j in lightning])
        rows.append(("Lightning 4-step warm, queue to image <= 1.2 s", f"median {_num(lightning)} s{lightning_run}",
                     _check(lightning, 1.2)))
        above = _anon_above_idle(runs, version, "fastest")
        rows.append(("server anonymous host memory peak <= 10 GiB above the idle server (fastest prompts)",
                     f"{_num(above)} GiB", _check(above, 10.0)))
        for kind, label in (("other", "the same during the pack's other workflows (low VRAM keeps DiT blocks in "
                                      "pinned host memory)"),
                            ("model", "the same during ComfyUI core nodes + FP8 prompts (ComfyUI's loaders keep the "
                                      "bf16 model in host memory)"),
                            ("core", "the same during ComfyUI core's own prompts (for comparison)")):
            if (other := _anon_above_idle(runs, version, kind)) is not None:
                rows.append((label, f"{_num(other)} GiB", ""))
        for s in series:
            growth = max(abs(g) for g in (s["gpu_held_growth_pct"] or 0, s["anon_growth_pct"] or 0))
            rows.append(("growth over 20 prompts <= 2% (GPU held; host anonymous)",
                         f"{_num(s['gpu_held_growth_pct'])}%; {_num(s['anon_growth_pct'])}%{s['run']}",
                         _check(growth, 2.0)))
        dated = sorted(((r["date"], r["commit"][:7], summarize(r)["servers"]) for r in runs
                        if r["comfyui_version"] == version), key=lambda d: d[0])
        for caches, limit, label in (("fresh", 75.0, "empty"), ("reuse", 40.0, "warm")):
            firsts = [(s["first_image_s"], commit) for _, commit, run_servers in dated for s in run_servers
                      if s["caches"] == caches and s.get("first_job", "").startswith("fastest")]
            if firsts:  # every run's, oldest first; judged on the newest run's (the build changes between runs)
                newest_commit = firsts[-1][1]
                rows.append((f"server start to first fastest image, {label} Inductor cache <= {limit:g} s "
                             "(judged on the newest run)", ", ".join(f"{v} s ({c})" for v, c in firsts),
                             _check(max(v for v, c in firsts if c == newest_commit), limit)))
        changes = [j for _, j in ok if "lora=" in j["job"] or "strength=" in j["job"]]
        for j in changes:
            rows.append(("a LoRA change: time, recompiles (none expected)",
                         f"{j['queue_to_image_s']} s, graphs compiled {j['stages'].get('graphs_compiled')}",
                         "yes" if j["stages"].get("graphs_compiled") == 0 else "no"))
        for core, label in ((False, "every prompt of the pack's workflows ran (failures by job)"),
                            (True, "ComfyUI core's own prompts (for comparison)")):
            mine = [(srv, j) for srv, j in jobs if (_job_kind(j["job"]) == "core") == core]
            if core and not mine:
                continue
            failed = [(srv["label"], j) for srv, j in mine if not j.get("ok")]
            rows.append((label, f"{len(mine) - len(failed)} of {len(mine)} ok" + "".join(
                f"; {j['job']} on {srv}: {' '.join((j.get('error') or '').split())[:120]}" for srv, j in failed[:4]),
                ("yes" if not failed else "no") if not core else ""))
        rows = [(t, m if any(c.isdigit() for c in m) else "not measured in these runs", met) for t, m, met in rows]
        lines += [f"| {version} | {t} | {m.replace('|', '/')} | {met} |" for t, m, met in rows]
    return "\n".join(lines) + "\n"


def _shown_path(path: Path) -> str:
    """``path`` relative to the checkout when inside it."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def write_record(paths: list[Path], folder: Path = PERFORMANCE_DIR) -> Path:
    """Rewrite ``<folder>/<card>-product-path.md`` with the results ``paths`` (runs on one card); returns the file.

    The card is named as the harness's records are (``harness_core.card_name``: ``H100``, ``H200``)."""
    runs = [json.loads(p.read_text()) for p in paths]
    c = runs[0].get("card") or {}
    versions = sorted({r["comfyui_version"] for r in runs})
    dates = sorted({r["date"][:10] for r in runs})
    gpu = str(c.get("name") or runs[0].get("device") or "unknown")
    commits = sorted({str(r.get("commit") or "unknown") for r in runs})
    section = [f"# Product path on {card_name(gpu)}: ComfyUI {' and '.join(versions)} servers", "",
               f"Written by `python3 bench/product_path.py record {' '.join(_shown_path(p) for p in paths)}` (the "
               f"runs' results.json files; {_shown_path(RESULTS_DIR)} keeps them); a new record replaces this file. "
               f"GPU: {gpu}. Dates: {', '.join(dates)}. Commit: {', '.join(commits)}. Commands: "
               f"`bash bench/product_path_device.sh PLAN` on the GPU machine (plans: "
               f"{', '.join(sorted({str(r.get('plan')) for r in runs}))}).", "",
               "Full-size random-weight files in the Comfy-Org layout written on the GPU by "
               "`bench/full_size_files.py`, a real ComfyUI server with the pack started with ComfyUI's defaults "
               "(plus the arguments named), the shipped API workflows and ComfyUI core's own workflow queued over "
               "HTTP (`bash bench/product_path_device.sh PLAN` on the GPU machine). queue->image: from the POST to "
               "ComfyUI's `execution_success`; stages: the Sampler's own report; GPU memory: nvidia-smi on the card "
               "every 0.25 s (held: one second after the prompt); host: the server's RssAnon. The model files sit in "
               "the page cache (written just before).", ""]
    section += ["### Targets", "", targets(runs)]
    for run in runs:
        section.append(markdown(run, heading="###"))
    path = Path(folder) / f"{card_name(gpu)}-product-path.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(section).rstrip() + "\n", encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- load-time integrity check's cost
# What the load-time NaN/Inf check costs: ``load_tensors`` (checked) against a plain read of the same files
# (``python3 bench/product_path.py integrity ...``). Every checkpoint tensor goes through
# ``qwen_edit.checkpoints.safetensors_io.load_tensors``, which checks each tensor for NaN/Inf on the device it lands
# on (one reduction per tensor, one host sync per file). The same files are read onto ``--device`` alternately
# without the check (``safe_open`` + ``get_tensor``) and with it, ``--repeats`` times each; reported: the median
# seconds of both, the check alone over tensors already on the device, and the check's share of the checked load.
# Files: ``--file`` (repeatable, e.g. every shard of the real DiT), or written at full DiT width
# (``--synthetic-blocks N``: N blocks at dim 3072, about 680 MB each in bf16). ``--model-files DIT TEXT_ENCODER VAE``
# also times loading the three as models through the pack's loaders against the check alone over their tensors.
# After the first read the files sit in the page cache, so the loads measured are the fastest a load can be; a cold
# read from disk is slower and the check is not, so the share reported is its upper bound. The JSON record goes to
# ``$OUT/integrity.json`` (and ``$OUT/integrity_models.json``) when ``$OUT`` is set.


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_read(paths: list[Path], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of ``paths`` onto ``device`` with safetensors alone (no check)."""
    from safetensors import safe_open

    tensors = {}
    for path in paths:
        with safe_open(str(path), framework="pt", device=str(device)) as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
                tensors[name] = handle.get_tensor(name)
    _sync_device(device)
    return tensors


def checked_read(paths: list[Path], device: torch.device) -> dict[str, torch.Tensor]:
    """The same through the pack's ``load_tensors`` (dtype and NaN/Inf checks included)."""
    from qwen_edit_hopper.qwen_edit.checkpoints.safetensors_io import load_tensors

    tensors = {}
    for path in paths:
        tensors.update(load_tensors(path, device=device))
    _sync_device(device)
    return tensors


def check_only(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The check alone over tensors already in memory (one sync); returns the non-finite names."""
    from qwen_edit_hopper.qwen_edit.checkpoints.integrity import FiniteCheck

    check = FiniteCheck()
    for name, tensor in tensors.items():
        check.add(name, tensor)
    return check.nonfinite()


def _timed_call(fn, *args):
    started = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - started, result


def measure_integrity(paths: list[Path], device: torch.device | str, repeats: int = 3) -> dict:
    """Median seconds of plain and checked reads of ``paths`` and of the check alone, and the check's share.

    The first read of each kind is a warm-up (it fills the page cache and the allocator) and is not counted.
    """
    device = torch.device(device)
    plain_s, checked_s, check_s = [], [], []
    for index in range(repeats + 1):
        seconds, tensors = _timed_call(plain_read, paths, device)
        del tensors
        seconds_checked, tensors = _timed_call(checked_read, paths, device)
        seconds_check, bad = _timed_call(check_only, tensors)
        if bad:
            raise ValueError(f"{paths}: non-finite tensors {bad[:5]}: measure on a good file")
        if index:
            plain_s.append(seconds)
            checked_s.append(seconds_checked)
            check_s.append(seconds_check)
        count, nbytes = len(tensors), sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
        if device.type == "cuda":
            torch.cuda.empty_cache()
    plain, checked, check = (statistics.median(v) for v in (plain_s, checked_s, check_s))
    return {
        "files": [str(p) for p in paths],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "tensors": count,
        "gbytes": nbytes / 1e9,
        "repeats": repeats,
        "plain_read_s": plain,
        "checked_read_s": checked,
        "check_alone_s": check,
        "check_share_of_load": check / checked,
        "checked_minus_plain_share": (checked - plain) / plain,
        "check_gbytes_per_s": nbytes / 1e9 / check if check else float("inf"),
    }


def measure_model_loads(dit: Path, text_encoder: Path, vae: Path, device: torch.device | str, repeats: int = 3) -> dict:
    """Median seconds to load the three models through the pack's loaders (checks included), and the check
    alone over the same files' tensors on the device: the check's share of a whole model load (read, fp8
    dequantization, key conversion, building the modules)."""
    from qwen_edit_hopper.qwen_edit.checkpoints import load_dit, load_text_encoder, load_vae, resolve_single_files

    device = torch.device(device)
    files = resolve_single_files(dit, text_encoder, vae)
    load_s, check_s = [], []
    for index in range(repeats + 1):
        started = time.perf_counter()
        models = [load(files, device=device) for load in (load_dit, load_text_encoder, load_vae)]
        _sync_device(device)
        seconds = time.perf_counter() - started
        del models
        tensors = plain_read([dit, text_encoder, vae], device)
        seconds_check, _ = _timed_call(check_only, tensors)
        del tensors
        if index:
            load_s.append(seconds)
            check_s.append(seconds_check)
    load, check = statistics.median(load_s), statistics.median(check_s)
    return {"files": [str(dit), str(text_encoder), str(vae)], "device": str(device),
            "threads": torch.get_num_threads(), "repeats": repeats, "model_load_s": load, "check_alone_s": check,
            "check_share_of_load": check / load}


def write_synthetic_dit(path: Path, blocks: int, dim: int = 3072, seed: int = 0) -> Path:
    """A DiT at width ``dim`` with ``blocks`` transformer blocks, random bf16 weights (N(0, 0.02), norms 1)."""
    from qwen_edit_hopper.qwen_edit.checkpoints.dit import DiTConfig, create_dit
    from safetensors.torch import save_file

    heads = max(1, dim // 128)
    config = DiTConfig(dim=dim, num_layers=blocks, num_heads=heads, head_dim=dim // heads, text_dim=3584)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, meta in create_dit(config).state_dict(keep_vars=True).items():
        shape = tuple(meta.shape)
        if len(shape) == 1 and "norm" in name:
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
    save_file(tensors, str(path))
    return path


def integrity_report(record: dict) -> str:
    return (f"{record['tensors']} tensors, {record['gbytes']:.2f} GB on {record['device']} "
            f"({record['threads']} CPU threads), median of {record['repeats']}:\n"
            f"  plain read     {record['plain_read_s']:.3f} s\n"
            f"  checked read   {record['checked_read_s']:.3f} s "
            f"({100 * record['checked_minus_plain_share']:+.1f}% vs plain)\n"
            f"  check alone    {record['check_alone_s']:.4f} s ({record['check_gbytes_per_s']:.1f} GB/s), "
            f"{100 * record['check_share_of_load']:.2f}% of the checked load")


def integrity_main(argv: list[str]) -> int:
    """``product_path.py integrity ...``: the load-time check's cost (see the section comment above)."""
    parser = argparse.ArgumentParser(prog="product_path.py integrity",
                                     description="what the load-time NaN/Inf check costs against a plain read")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--file", type=Path, action="append", default=[], help="a safetensors file (repeatable)")
    parser.add_argument("--synthetic-blocks", type=int, default=0, help="write a DiT at dim 3072 with this many blocks")
    parser.add_argument("--dim", type=int, default=3072, help="width of the synthetic DiT")
    parser.add_argument("--model-files", type=Path, nargs=3, metavar=("DIT", "TEXT_ENCODER", "VAE"),
                        help="also time loading these three single files as models")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from pack import load_pack

    load_pack()
    if args.model_files:
        models = measure_model_loads(*args.model_files, args.device, args.repeats)
        print(f"models {[Path(f).name for f in models['files']]} on {models['device']} ({models['threads']} CPU "
              f"threads), median of {models['repeats']}: load {models['model_load_s']:.3f} s, check alone "
              f"{models['check_alone_s']:.4f} s = {100 * models['check_share_of_load']:.2f}% of the load")
        out = os.environ.get("OUT")
        if out:
            Path(out, "integrity_models.json").write_text(json.dumps(models, indent=2))
        if not (args.file or args.synthetic_blocks):
            return 0
    paths = list(args.file)
    with tempfile.TemporaryDirectory() as scratch:
        if args.synthetic_blocks:
            synthetic = Path(scratch) / "synthetic_dit.safetensors"
            paths.append(write_synthetic_dit(synthetic, args.synthetic_blocks, args.dim))
        if not paths:
            parser.error("give --file or --synthetic-blocks")
        record = measure_integrity(paths, args.device, args.repeats)
    print(integrity_report(record))
    out = os.environ.get("OUT")
    if out:
        Path(out, "integrity.json").write_text(json.dumps(record, indent=2))
    return 0


# ----------------------------------------------------------------------------- command line


def main() -> int:
    if sys.argv[1:2] == ["integrity"]:
        return integrity_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="start servers and run a plan's jobs")
    run.add_argument("--comfyui", type=Path, required=True, help="ComfyUI's source folder (holds main.py)")
    run.add_argument("--models", type=Path, required=True, help="a ComfyUI models folder with the files")
    run.add_argument("--out", type=Path, required=True, help="results.json, table.md and server logs go here")
    run.add_argument("--work", type=Path, help="server folders and Inductor/Triton caches (default OUT/../work)")
    run.add_argument("--plan", choices=sorted(PLANS), help="a named plan (see 'plan NAME')")
    run.add_argument("--jobs", help="one server with these jobs (with --plan: its first server's arguments)")
    run.add_argument("--server-arg", action="append", default=[], help="one more ComfyUI argument (repeatable)")
    run.add_argument("--tiny", action="store_true", help="tiny files: small images and steps")
    run.add_argument("--cpu", action="store_true", help="start ComfyUI with --cpu (FP8 kernels emulated, said)")
    run.add_argument("--keep-caches", action="store_true",
                     help="Inductor/Triton caches in WORK/kept-caches, kept between runs on this machine")
    run.add_argument("--deadline", type=float, help="end cleanly this many seconds after the start")
    run.add_argument("--job-timeout", type=float, default=900.0, help="seconds one prompt may take")
    run.add_argument("--seed", type=int, default=1000, help="jobs get seeds after this one")
    run.add_argument("--commit", help="the checkout's commit, where git cannot tell (no .git on the machine)")
    run.add_argument("--written", type=Path, help="bench/full_size_files.py's --json, recorded with the results")
    table = sub.add_parser("table", help="print a results file as markdown")
    table.add_argument("results", type=Path)
    record = sub.add_parser("record", help="rewrite docs/performance/<card>-product-path.md with results (one card)")
    record.add_argument("results", type=Path, nargs="+")
    record.add_argument("--to", type=Path, default=PERFORMANCE_DIR, help="the folder of the record")
    check = sub.add_parser("targets", help="print the targets against results (one card)")
    check.add_argument("results", type=Path, nargs="+")
    sub.add_parser("integrity", help="what the load-time NaN/Inf check costs (its own options: integrity --help)")
    show = sub.add_parser("plan", help="print a plan, or one field of it")
    show.add_argument("name", choices=sorted(PLANS))
    show.add_argument("--field", choices=("comfyui", "description"))
    args = parser.parse_args()

    if args.command == "table":
        print(markdown(json.loads(args.results.read_text())))
        return 0
    if args.command == "targets":
        print(targets([json.loads(p.read_text()) for p in args.results]))
        return 0
    if args.command == "record":
        path = write_record(args.results, args.to)
        print(path.read_text())
        print(f"wrote {path}")
        return 0
    if args.command == "plan":
        plan = PLANS[args.name]
        if args.field:
            print(getattr(plan, args.field))
        else:
            print(f"{args.name}: ComfyUI {plan.comfyui}; {plan.description}")
            for spec in plan.servers:
                print(f"  server {spec.label} (caches {spec.caches}, args {' '.join(spec.args) or '-'}): {spec.jobs}")
        return 0

    if not (args.plan or args.jobs):
        parser.error("give --plan, --jobs or both (a plan's first server with these jobs)")
    if args.plan and args.jobs:
        plan_name, plan = args.plan, PLANS[args.plan]
        plan = Plan(plan.comfyui, (dataclasses.replace(plan.servers[0], jobs=args.jobs),),
                    description=f"{plan.description}; here only the jobs {args.jobs}")
    elif args.plan:
        plan_name, plan = args.plan, PLANS[args.plan]
    else:
        plan_name, plan = "jobs", Plan("any", (ServerSpec("jobs", args.jobs),), description=f"jobs {args.jobs}")
    for spec in plan.servers:
        parse_jobs(spec.jobs)
    args.comfyui = args.comfyui.resolve()
    args.work = (args.work or args.out.resolve().parent / "work").resolve()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    runner = Run(args, plan_name, plan)
    try:
        runner.run()
    finally:
        runner.sampler.stop()
        runner.save()
        table_text = markdown(runner.results)
        (args.out / "table.md").write_text(table_text)
        print("\n" + table_text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
