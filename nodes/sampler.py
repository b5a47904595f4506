"""Sampler: edit an image with a prompt; progress per denoising step, interrupt within the running step."""

from __future__ import annotations

import logging
import time

import comfy.model_management as mm
import comfy.utils
import numpy as np
import torch
from comfy_api.latest import io, ui
from PIL import Image

from ..qwen_edit.compute_dtype import compute_note, dtype_label
from ..qwen_edit.plan import PipePlan
from ..qwen_edit.sampling import EditRequest, default_output_size, steps_problem
from .comfy_compat import check_choices
from .comfy_memory import runtime
from .common import CATEGORY, PIPE, NodeInputError

logger = logging.getLogger(__name__)

SCHEDULER_CHOICES = ["auto", "default", "lightning"]
MAX_SIDE = 4096


def tensor_to_pil(image: torch.Tensor, input_name: str) -> Image.Image:
    """A ComfyUI IMAGE (1, H, W, 3) float in [0, 1] as an RGB PIL image; other shapes are refused."""
    if image.ndim != 4:
        raise NodeInputError(f"{input_name}: expected an IMAGE tensor (batch, height, width, channels), "
                             f"got shape {tuple(image.shape)}")
    if image.shape[0] != 1:
        raise NodeInputError(f"{input_name}: got a batch of {image.shape[0]} images; the Sampler edits one image: "
                             "pass a single image (split the batch, e.g. with an 'Image From Batch' node), and use "
                             "image_2 / image_3 for extra references with Edit-2509/2511")
    if image.shape[-1] == 4:
        raise NodeInputError(f"{input_name}: the image has an alpha channel (RGBA); Qwen-Image-Edit takes RGB: "
                             "drop or flatten the alpha first (ComfyUI's Load Image already gives RGB + a mask)")
    if image.shape[-1] != 3:
        raise NodeInputError(f"{input_name}: expected 3 color channels (RGB), got {image.shape[-1]}")
    if min(image.shape[1], image.shape[2]) < 16:
        raise NodeInputError(f"{input_name}: the image is {image.shape[2]}x{image.shape[1]}; it needs at least "
                             "16 pixels per side")
    array = (image[0].float().clamp(0, 1).cpu().numpy() * 255).round().astype(np.uint8)
    return Image.fromarray(array, "RGB")


def resolve_size(width: int, height: int, reference: Image.Image) -> tuple[int, int, str]:
    """Output size: explicit sides rounded to multiples of 16 (said in the note), or 0 = from the reference."""
    if width == 0 and height == 0:
        w, h = default_output_size(reference)
        return w, h, f"output size {w}x{h}: the reference's aspect ratio at about 1 megapixel"
    if width == 0 or height == 0:
        ratio = reference.width / reference.height
        width = width or round(height * ratio)
        height = height or round(width / ratio)
    w, h = max(16, round(width / 16) * 16), max(16, round(height / 16) * 16)
    note = f"output size {w}x{h}"
    if (w, h) != (width, height):
        note += f" (asked {width}x{height}, rounded to multiples of 16 as the model needs)"
    return w, h, note


def resolve_schedule(plan: PipePlan, scheduler: str, cfg: float, steps: int) -> tuple[str, float, list[str]]:
    """'auto' picks Lightning's scheduler and cfg 1 when a Lightning LoRA is fused, else the model's own."""
    notes = []
    lightning = plan.lightning_steps
    if scheduler == "auto":
        scheduler = "lightning" if lightning else "default"
        notes.append(f"scheduler: {scheduler} (auto{', Lightning LoRA fused' if lightning else ''})")
    if cfg == 0:
        cfg = 1.0 if lightning else 4.0
        notes.append(f"true cfg: {cfg:g} (auto)")
    if lightning and steps != lightning:
        notes.append(f"note: the fused Lightning LoRA is made for {lightning} steps, running {steps}")
    return scheduler, cfg, notes


class QwenEditSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QwenEditHopper_Sampler",
            display_name="Qwen Edit Sampler",
            category=CATEGORY,
            description="Edits the image with the prompt (true CFG, DiffSynth's Qwen-Image-Edit pipeline). "
            "Prompt encoding is cached while prompt and images are unchanged.",
            inputs=[
                PIPE.Input("pipe", tooltip="Pipe from Load Qwen Edit (optionally through Fuse LoRA, Apply TE-FP8, "
                           "Compile Model)."),
                io.Image.Input("image", tooltip="The image to edit (RGB, one image)."),
                io.String.Input("prompt", multiline=True, default="",
                                tooltip="What to change, e.g. 'make the sky a sunset'."),
                io.String.Input("negative_prompt", multiline=True, default=" ",
                                tooltip="Used by true CFG (ignored when cfg is 1)."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                             tooltip="Noise seed; the same seed, inputs and pipe give the same image."),
                io.Int.Input("steps", default=40, min=1, max=200,
                             tooltip="Denoising steps: 40-50 for Qwen-Image-Edit, 4 or 8 with a Lightning LoRA."),
                io.Float.Input("cfg", default=0.0, min=0.0, max=20.0, step=0.1,
                               tooltip="True CFG scale (two model passes per step when > 1). 0 = auto: 4.0, or 1.0 "
                               "when a Lightning LoRA is fused. Values between 0 and 1 are refused."),
                io.Int.Input("width", default=0, min=0, max=MAX_SIDE, step=16,
                             tooltip="Output width; 0 = from the image's aspect ratio at about 1 megapixel. Other "
                             "values are rounded to a multiple of 16 (the node says so)."),
                io.Int.Input("height", default=0, min=0, max=MAX_SIDE, step=16,
                             tooltip="Output height; 0 = from the image's aspect ratio at about 1 megapixel."),
                io.Combo.Input("scheduler", options=SCHEDULER_CHOICES, default="auto",
                               tooltip="auto = the model's FlowMatch schedule, or Lightning's when a Lightning "
                               "LoRA is fused; 'default' / 'lightning' force one."),
                io.Float.Input("reference_megapixels", default=1.0, min=0.01, max=4.0, step=0.05,
                               tooltip="Reference images are resized to this many megapixels before the VAE "
                               "(aspect kept, sides multiples of 32), as DiffSynth does at 1.0."),
                io.Image.Input("image_2", optional=True,
                               tooltip="Second reference image (Edit-2509/2511 only)."),
                io.Image.Input("image_3", optional=True,
                               tooltip="Third reference image (Edit-2509/2511 only)."),
            ],
            outputs=[
                io.Image.Output("edited", display_name="image", tooltip="The edited image."),
                io.String.Output("info", tooltip="Size, schedule, seconds per stage, and the fast forward's kernels "
                                 "(used, and left out with the reason) of this run."),
            ],
        )

    @classmethod
    def validate_inputs(cls, steps, cfg, scheduler):
        problem = check_choices(scheduler=(scheduler, SCHEDULER_CHOICES))
        if problem:
            return problem
        if steps < 1:
            return f"steps must be at least 1 (got {steps}): use 40 for Qwen-Image-Edit, 4 or 8 with Lightning"
        if scheduler == "default" and steps_problem(scheduler, steps):
            return steps_problem(scheduler, steps)
        if cfg != 0 and cfg < 1:
            return (f"cfg must be 1 or more, or 0 for auto (got {cfg}): below 1 true CFG pushes away from the "
                    "prompt; use 4.0 (1.0 with a Lightning LoRA)")
        return True

    @classmethod
    def execute(cls, pipe, image, prompt, negative_prompt, seed, steps, cfg, width, height, scheduler,
                reference_megapixels, image_2=None, image_3=None) -> io.NodeOutput:
        from ..qwen_edit.edit import run_edit
        from ..qwen_edit.sampling import Callbacks

        started, started_wall = time.perf_counter(), time.time()
        if not isinstance(pipe, PipePlan):
            raise NodeInputError("pipe: expected the output of Load Qwen Edit")
        images = [tensor_to_pil(image, "image")]
        for name, extra in (("image_2", image_2), ("image_3", image_3)):
            if extra is not None:
                images.append(tensor_to_pil(extra, name))
        if len(images) > pipe.variant.max_images:
            raise NodeInputError(f"image_2/image_3: {pipe.variant.value} takes {pipe.variant.max_images} reference "
                                 f"image(s), got {len(images)}: disconnect the extra images or load Edit-2509/2511")
        w, h, size_note = resolve_size(width, height, images[0])
        scheduler, cfg, notes = resolve_schedule(pipe, scheduler, cfg, steps)
        if steps_problem(scheduler, steps):
            raise NodeInputError(steps_problem(scheduler, steps))
        request = EditRequest(images=tuple(images), prompt=prompt, negative_prompt=negative_prompt, seed=seed,
                              steps=steps, cfg=cfg, width=w, height=h, scheduler=scheduler,
                              reference_pixels=int(reference_megapixels * 1024 * 1024))
        progress = comfy.utils.ProgressBar(steps)
        callbacks = Callbacks(on_step=lambda done, total, latents: progress.update_absolute(done, total),
                              check_interrupt=mm.throw_exception_if_processing_interrupted)
        rt = runtime()
        result, timings = run_edit(rt, pipe, request, callbacks)
        node_s = time.perf_counter() - started
        lines = [size_note, *notes, f"steps: {steps}, cfg: {cfg:g}, seed: {seed}",
                 pipe.short_label(dtype_label(rt.dtype), cuda_graphs_ran=timings.extra.get("cuda_graphs") == "on"),
                 compute_note(rt.device, rt.dtype),
                 f"prompt encoding: {timings.encode_s:.2f} s{' (cached)' if timings.encode_cached else ''}",
                 f"denoising: {timings.denoise_s:.2f} s ({timings.denoise_s / steps:.3f} s/step)",
                 f"VAE decode: {timings.decode_s:.2f} s", f"total: {timings.total_s:.2f} s",
                 f"Sampler node: {node_s:.2f} s (the total plus {max(node_s - timings.total_s, 0):.2f} s of set-up: "
                 "memory check, models loaded or looked up, image conversion)"]
        if timings.extra.get("loads"):
            lines.append("models loaded this prompt: " + ", ".join(f"{kind} {seconds:.2f} s"
                                                               for kind, seconds in timings.extra["loads"]))
        if "dit_waited_s" in timings.extra:
            lines.append(f"DiT built alongside the text encoder's load and the prompt's encoding: the Sampler "
                         f"waited {timings.extra['dit_waited_s']:.2f} s for it after the encoding")
        if pipe.compile is not None:
            step_s = timings.extra["step_s"]
            lines.append(f"compiled: first step {step_s[0]:.2f} s (includes any compile), graphs compiled this run: "
                         f"{timings.extra['graphs_compiled']}")
            lines.append(f"CUDA graphs: {timings.extra.get('cuda_graphs', 'off')}")
        if "gpu_peak_bytes" in timings.extra:
            lines.append(f"GPU memory (PyTorch's allocator): peak {timings.extra['gpu_peak_bytes'] / 2**30:.2f} GiB "
                         f"during this prompt, {timings.extra['gpu_held_bytes'] / 2**30:.2f} GiB held after it")
        if "parallel" in timings.extra:
            lines.append(f"parallel: {timings.extra['parallel']} (workers started in "
                         f"{timings.extra['parallel_start_s']:.2f} s this prompt)")
            lines.extend(timings.extra["parallel_notes"])
        if "calibration" in timings.extra:
            lines.append(timings.extra["calibration"])
        if "kernels" in timings.extra:
            lines.append(timings.extra["kernels"].summary())
        info = "\n".join(lines)
        logger.info("Qwen Edit Sampler:\n%s", info)
        logger.info("Qwen Edit Sampler ran from %.3f to %.3f (wall clock, s)", started_wall, time.time())
        return io.NodeOutput(result, info, ui=ui.PreviewText(info))
