"""The Qwen-Image-Edit sampling loop on DiffSynth's models, scheduler and encoders.

DiffSynth's own ``QwenImagePipeline.__call__`` re-encodes the prompt on every
call and has no hooks for progress or interrupt, so this module drives the
same pieces itself: DiffSynth's prompt-embedding unit (its templates and
token dropping), its VAE, its ``FlowMatchScheduler`` and its
``model_fn_qwen_image``, with callbacks for progress and interrupt, and a
cache of encoded conditioning.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from .fast.options import SHIPPED, ForwardOptions
from .plan import Variant

logger = logging.getLogger(__name__)

SCHEDULERS = {"default": "Qwen-Image", "lightning": "Qwen-Image-Lightning"}

MIN_STEPS = {"default": 2, "lightning": 1}
"""Fewest steps each schedule runs: DiffSynth's Qwen-Image schedule gives NaN timesteps for one step (its
terminal shift divides by zero), which would denoise into NaN latents."""


def steps_problem(scheduler: str, steps: int) -> str | None:
    """Why ``steps`` cannot run with ``scheduler`` ("default" / "lightning"), or None."""
    fewest = MIN_STEPS[scheduler]
    if steps >= fewest:
        return None
    return (f"steps {steps} with the {scheduler} ({SCHEDULERS[scheduler]}) schedule: it needs at least {fewest} "
            "(one step gives NaN timesteps, its terminal shift divides by zero); use 2 or more steps, or the "
            "lightning scheduler with a Lightning LoRA")


@dataclass(frozen=True)
class EditRequest:
    """One edit. ``images`` are RGB PIL images (1 for Edit, up to 3 for 2509/2511).

    ``width``/``height`` are multiples of 16. Reference images are resized to
    ``reference_pixels`` (keeping their aspect ratio, sides multiples of 32)
    before the VAE, as DiffSynth does at 1024*1024.
    """

    images: tuple[Image.Image, ...]
    prompt: str
    negative_prompt: str
    seed: int
    steps: int
    cfg: float
    width: int
    height: int
    scheduler: str = "default"
    reference_pixels: int = 1024 * 1024


@dataclass
class Callbacks:
    """Hooks the host gives the loop: ``on_step(done, total, latents)`` and ``check_interrupt()``."""

    on_step: Callable[[int, int, torch.Tensor], None] = lambda done, total, latents: None
    check_interrupt: Callable[[], None] = lambda: None


@dataclass
class Timings:
    """Seconds spent per stage of one edit (host clock, synchronized on CUDA)."""

    encode_s: float = 0.0
    denoise_s: float = 0.0
    decode_s: float = 0.0
    encode_cached: bool = False
    steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return self.encode_s + self.denoise_s + self.decode_s


def default_output_size(image: Image.Image, megapixels: float = 1.0) -> tuple[int, int]:
    """The reference image's aspect ratio at about ``megapixels``, sides multiples of 16: (width, height)."""
    ratio = image.width / image.height
    target = megapixels * 1024 * 1024
    width = math.sqrt(target * ratio)
    height = width / ratio
    return max(16, round(width / 16) * 16), max(16, round(height / 16) * 16)


def reference_size(image: Image.Image, pixels: int) -> tuple[int, int]:
    """DiffSynth's reference resize: aspect kept, area ``pixels``, sides multiples of 32."""
    ratio = image.width / image.height
    width = math.sqrt(pixels * ratio)
    height = width / ratio
    return max(32, round(width / 32) * 32), max(32, round(height / 32) * 32)


def image_digest(image: Image.Image) -> str:
    """Content hash of an image (for the conditioning cache)."""
    digest = hashlib.sha256(np.asarray(image).tobytes())
    digest.update(f"{image.size}{image.mode}".encode())
    return digest.hexdigest()


class _PipeShell:
    """The attributes DiffSynth's pipeline units read (processor, text encoder, VAE, device, dtype)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, text_encoder=None, processor=None, vae=None):
        self.device = device
        self.torch_dtype = dtype
        self.text_encoder = text_encoder
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", None)
        self.vae = vae
        self.vram_management_enabled = False

    def load_models_to_device(self, names) -> None:
        return None

    def preprocess_image(self, image: Image.Image) -> torch.Tensor:
        """PIL RGB -> (1, 3, H, W) in [-1, 1] on the device, as DiffSynth's BasePipeline does."""
        array = torch.from_numpy(np.asarray(image, dtype=np.float32))
        tensor = array.to(dtype=self.torch_dtype, device=self.device) * (2 / 255) - 1
        return tensor.permute(2, 0, 1).unsqueeze(0)


@dataclass
class Conditioning:
    """Encoded prompt(s) and reference latents, ready for the DiT."""

    positive: dict[str, torch.Tensor]
    negative: dict[str, torch.Tensor] | None
    edit_latents: list[torch.Tensor]


class ConditioningCache:
    """LRU cache of encoded conditioning, keyed by prompt, images and the encoders that made it."""

    def __init__(self, capacity: int = 8):
        self.capacity = capacity
        self._items: OrderedDict[tuple, Conditioning] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> Conditioning | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def put(self, key: tuple, value: Conditioning) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


def encode_prompt(shell: _PipeShell, prompt: str, images: list[Image.Image], variant: Variant) -> dict:
    """DiffSynth's prompt embedding for edits: ``{"prompt_emb": (1, L, D), "prompt_emb_mask": (1, L)}``."""
    from diffsynth.pipelines.qwen_image import QwenImageUnit_PromptEmbedder

    unit = QwenImageUnit_PromptEmbedder()
    edit_image: Any = list(images) if variant.multi_image_prompt else images[0]
    return unit.process(shell, prompt, edit_image=edit_image)


def encode_references(shell: _PipeShell, images: list[Image.Image]) -> list[torch.Tensor]:
    """VAE latents of the reference images, each (1, 16, h/8, w/8)."""
    return [shell.vae.encode(shell.preprocess_image(image)) for image in images]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_scheduler(name: str, steps: int, width: int, height: int):
    """DiffSynth's FlowMatchScheduler for Qwen-Image (``default``) or Lightning (``lightning``).

    Raises:
        ValueError: ``steps`` below the schedule's minimum (:data:`MIN_STEPS`), or timesteps that are not
            finite for another reason.
    """
    from diffsynth.diffusion import FlowMatchScheduler

    problem = steps_problem(name, steps)
    if problem:
        raise ValueError(problem)
    scheduler = FlowMatchScheduler(SCHEDULERS[name])
    scheduler.set_timesteps(steps, denoising_strength=1.0, dynamic_shift_len=(height // 16) * (width // 16))
    if not bool(torch.isfinite(scheduler.timesteps).all()):
        raise ValueError(f"the {SCHEDULERS[name]} schedule gives non-finite timesteps for {steps} steps at "
                         f"{width}x{height}: choose another number of steps or size")
    return scheduler



def start_denoising(request: EditRequest, conditioning: Conditioning, variant: Variant, device: torch.device,
                    dtype: torch.dtype) -> tuple[object, torch.Tensor, dict]:
    """What every denoising loop starts from: the request's scheduler, its seeded initial noise (1, 16, H/8, W/8)
    in ``dtype`` on ``device`` (drawn on the CPU, so every device and rank gets the same noise), and the forward's
    arguments shared by both CFG branches (output size, reference latents, 2511's zero-timestep flag)."""
    scheduler = make_scheduler(request.scheduler, request.steps, request.width, request.height)
    generator = torch.Generator("cpu").manual_seed(request.seed)
    latents = torch.randn((1, 16, request.height // 8, request.width // 8), generator=generator,
                          dtype=dtype).to(device)
    shared = {"height": request.height, "width": request.width, "edit_latents": conditioning.edit_latents,
              "zero_cond_t": variant.zero_cond_t}
    return scheduler, latents, shared

class EditSampler:
    """Runs edits with given components; owns the conditioning cache.

    Components are passed per call (the runtime may swap DiT variants between
    calls); ``encoder_key`` identifies the text encoder + VAE + processor so
    cached conditioning is never reused across different encoders.
    """

    def __init__(self, cache: ConditioningCache | None = None):
        self.cache = cache or ConditioningCache()

    def condition(self, request: EditRequest, *, variant: Variant, text_encoder, processor, vae,
                  device: torch.device, dtype: torch.dtype, encoder_key: tuple,
                  before_text=None, before_vae=None) -> tuple[Conditioning, bool]:
        """Encode prompt, negative prompt and references, or return them from the cache."""
        refs = [image.resize(reference_size(image, request.reference_pixels), Image.LANCZOS)
                for image in request.images]
        use_negative = request.cfg != 1.0
        key = (encoder_key, variant, request.prompt, request.negative_prompt if use_negative else None,
               request.reference_pixels, tuple(image_digest(image) for image in request.images))
        cached = self.cache.get(key)
        if cached is not None:
            return cached, True
        shell = _PipeShell(device, dtype, text_encoder=text_encoder, processor=processor, vae=vae)
        if before_text:
            before_text()
        positive = encode_prompt(shell, request.prompt, refs, variant)
        negative = encode_prompt(shell, request.negative_prompt, refs, variant) if use_negative else None
        if before_vae:
            before_vae()
        latents = encode_references(shell, refs)
        conditioning = Conditioning(positive=positive, negative=negative, edit_latents=latents)
        self.cache.put(key, conditioning)
        return conditioning, False

    def denoise(self, request: EditRequest, conditioning: Conditioning, *, dit, variant: Variant,
                device: torch.device, dtype: torch.dtype, callbacks: Callbacks, attention: str = "sdpa",
                batched_cfg: bool = True, model_fn: Callable | None = None,
                options: ForwardOptions = SHIPPED) -> torch.Tensor:
        """The denoising loop; returns latents (1, 16, H/8, W/8). Interrupt is checked before each step.

        True CFG runs the positive and negative prompts as one batch-2 forward (``batched_cfg``; the
        text is right-padded and kept out of attention), or as two batch-1 forwards like DiffSynth.
        ``dit``: a ``fast.prepared.PreparedDit`` (or the bare module). ``model_fn`` defaults to
        ``fast_forward.fast_model_fn`` (same function as DiffSynth's ``model_fn_qwen_image``; tests hold them equal)
        with the ``attention`` backend and the fast forward's ``options``; another ``model_fn`` (DiffSynth's) gets
        the bare module as ``dit``.
        """
        from .fast_forward import PreparedDit, batch_prompts, fast_model_fn

        if model_fn is None:
            def model_fn(**kwargs):
                return fast_model_fn(attention_backend=attention, options=options, **kwargs)
        elif isinstance(dit, PreparedDit):
            dit = dit.module
        scheduler, latents, shared = start_denoising(request, conditioning, variant, device, dtype)
        total = len(scheduler.timesteps)
        batched = batched_cfg and conditioning.negative is not None
        if batched:
            both = batch_prompts([conditioning.positive, conditioning.negative])
        for index, timestep in enumerate(scheduler.timesteps):
            callbacks.check_interrupt()
            t = timestep.unsqueeze(0).to(dtype=dtype, device=device)
            if batched:
                pair = model_fn(dit=dit, latents=latents.expand(2, -1, -1, -1), timestep=t, **both, **shared)
                prediction, negative = pair[0:1], pair[1:2]
                prediction = negative + request.cfg * (prediction - negative)
            else:
                prediction = model_fn(dit=dit, latents=latents, timestep=t, **conditioning.positive, **shared)
                if conditioning.negative is not None:
                    negative = model_fn(dit=dit, latents=latents, timestep=t, **conditioning.negative, **shared)
                    prediction = negative + request.cfg * (prediction - negative)
            latents = scheduler.step(prediction, timestep, latents)
            callbacks.on_step(index + 1, total, latents)
        return latents

    @staticmethod
    def decode(latents: torch.Tensor, vae) -> torch.Tensor:
        """VAE decode to a ComfyUI IMAGE: (1, H, W, 3) float32 in [0, 1] on the CPU."""
        image = vae.decode(latents)
        image = ((image.float() + 1) / 2).clamp(0, 1)
        return image[0].permute(1, 2, 0).unsqueeze(0).cpu()
