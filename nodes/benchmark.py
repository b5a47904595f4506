"""Benchmark: run up to four pipes on the same edit; chart, markdown table and a JSON file."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import comfy.model_management as mm
import comfy.utils
import folder_paths
from comfy_api.latest import io, ui

from ..qwen_edit.plan import PipePlan
from ..qwen_edit.sampling import EditRequest, steps_problem
from .comfy_compat import diagnosis_lines
from .comfy_memory import runtime
from .common import CATEGORY, PIPE, NodeInputError
from .sampler import resolve_size, tensor_to_pil

logger = logging.getLogger(__name__)


class Benchmark(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QwenEditHopper_Benchmark",
            display_name="Benchmark (Qwen Edit)",
            category=CATEGORY,
            description="Runs each connected pipe on the same edit (same seed), one after another on one loaded "
            "base: seconds per step and per image, compile time, peak VRAM, PSNR/SSIM against pipe_1, the "
            "attention backend, and this machine's FP8 diagnosis. On a CPU it runs and says its figures are CPU "
            "figures.",
            is_output_node=True,
            inputs=[
                PIPE.Input("pipe_1", tooltip="The reference variant (usually the bf16 baseline)."),
                io.Image.Input("image", tooltip="The image to edit (RGB, one image)."),
                io.String.Input("prompt", multiline=True, default="", tooltip="The edit instruction."),
                io.Int.Input("steps", default=8, min=2, max=200,
                             tooltip="Denoising steps per timed edit (at least 2: the default schedule is NaN at 1)."),
                io.Int.Input("warmup", default=1, min=0, max=10,
                             tooltip="Untimed edits per variant first (the first one includes compilation)."),
                io.Int.Input("repeats", default=2, min=1, max=20, tooltip="Timed edits per variant (median)."),
                io.Int.Input("width", default=0, min=0, max=4096, step=16,
                             tooltip="Output width; 0 = the image's aspect at about 1 megapixel."),
                io.Int.Input("height", default=0, min=0, max=4096, step=16, tooltip="Output height; 0 = auto."),
                io.Int.Input("seed", default=42, min=0, max=0xFFFFFFFFFFFFFFFF, tooltip="Seed used by every run."),
                io.Float.Input("cfg", default=4.0, min=1.0, max=20.0, step=0.1,
                               tooltip="True CFG scale (1 = one model pass per step)."),
                io.Float.Input("reference_megapixels", default=1.0, min=0.01, max=4.0, step=0.05,
                               tooltip="Reference image size before the VAE, as in the Sampler."),
                PIPE.Input("pipe_2", optional=True, tooltip="Second variant (e.g. Apply TE-FP8)."),
                PIPE.Input("pipe_3", optional=True, tooltip="Third variant (e.g. FP8 + Compile Model)."),
                PIPE.Input("pipe_4", optional=True, tooltip="Fourth variant."),
            ],
            outputs=[
                io.Image.Output("chart", tooltip="Time per image with speedups, and memory per step."),
                io.String.Output("table", tooltip="Markdown table of the figures, then the FP8 diagnosis."),
            ],
        )

    @classmethod
    def validate_inputs(cls, steps, cfg):
        if steps_problem("default", steps):  # the benchmark runs the default schedule
            return steps_problem("default", steps)
        if cfg < 1:
            return f"cfg must be 1 or more (got {cfg})"
        return True

    @classmethod
    def execute(cls, pipe_1, image, prompt, steps, warmup, repeats, width, height, seed, cfg,
                reference_megapixels, pipe_2=None, pipe_3=None, pipe_4=None) -> io.NodeOutput:
        from ..qwen_edit.benchmark import run_benchmark, write_json
        from ..qwen_edit.charts import render_chart

        plans = [p for p in (pipe_1, pipe_2, pipe_3, pipe_4) if p is not None]
        for index, plan in enumerate(plans, start=1):
            if not isinstance(plan, PipePlan):
                raise NodeInputError(f"pipe_{index}: expected the output of Load Qwen Edit")
        picture = tensor_to_pil(image, "image")
        w, h, _ = resolve_size(width, height, picture)
        request = EditRequest(images=(picture,), prompt=prompt, negative_prompt=" ", seed=seed, steps=steps,
                              cfg=cfg, width=w, height=h, reference_pixels=int(reference_megapixels * 2**20))
        progress = comfy.utils.ProgressBar(len(plans) * (warmup + repeats))
        result = run_benchmark(runtime(), plans, request, warmup=warmup, repeats=repeats,
                               check_interrupt=mm.throw_exception_if_processing_interrupted,
                               on_progress=lambda done, total: progress.update_absolute(done, total),
                               host_lines=tuple(diagnosis_lines()))
        stamp = time.strftime("%Y%m%d-%H%M%S")
        json_path = write_json(result, Path(folder_paths.get_output_directory()) / "qwen_edit_benchmark"
                               / f"benchmark-{stamp}.json")
        table = f"{result.to_markdown()}\n\nJSON: {json_path}\n\n## This machine\n{result.diagnosis}"
        logger.info("Qwen Edit benchmark:\n%s", table)
        chart = render_chart(result)
        return io.NodeOutput(chart, table, ui=ui.PreviewText(table))
