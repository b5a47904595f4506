"""Parallel: run each edit of the pipe on several GPUs of this host (CFG-parallel, Ulysses sequence parallel)."""

from __future__ import annotations

import os

import comfy.model_management as mm
import torch
from comfy_api.latest import io, ui

from ..qwen_edit.parallel.layout import ULYSSES_DEGREES, ParallelChoice, ParallelInputError
from ..qwen_edit.plan import PipePlan
from .comfy_compat import check_choices
from .common import CATEGORY, PIPE, NodeInputError

ULYSSES_CHOICES = [str(d) for d in ULYSSES_DEGREES]


def parse_gpus(text: str) -> tuple[int, ...]:
    """``"0,1,2,3"`` -> (0, 1, 2, 3); empty -> () (the first ones)."""
    text = text.strip()
    if not text:
        return ()
    try:
        return tuple(int(part) for part in text.replace(" ", "").split(","))
    except ValueError:
        raise NodeInputError(f"gpus: '{text}' is not a comma-separated list of device indices such as 0,1 (or empty "
                             "for the first ones)") from None


def available_devices() -> tuple[int, str]:
    """(devices this process can hand to workers, their kind): visible GPUs, or CPU cores on a CPU server."""
    device = mm.get_torch_device()
    if device.type == "cuda":
        return torch.cuda.device_count(), "cuda"
    return os.cpu_count() or 1, device.type


class Parallel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QwenEditHopper_Parallel",
            display_name="Qwen Edit Parallel",
            category=CATEGORY,
            description="Runs each edit of the pipe on several GPUs of this host: one worker process per GPU, each "
            "with its own copy of the DiT (LoRA, FP8 and compile as the pipe says). CFG-parallel puts the prompt's and "
            "the negative prompt's forwards on two GPUs; Ulysses splits each forward's tokens over 2, 4 or 8 GPUs.",
            inputs=[
                PIPE.Input("pipe", tooltip="Pipe from Load Qwen Edit (through Fuse LoRA, Apply TE-FP8, Compile "
                           "Model)."),
                io.Boolean.Input("cfg_parallel", default=True,
                                 tooltip="Prompt and negative prompt on two GPUs (true CFG; one exchange per step). "
                                 "With cfg 1 (Lightning) both GPUs run the same forward."),
                io.Combo.Input("ulysses", options=ULYSSES_CHOICES, default="1",
                               tooltip="GPUs that share each forward's token sequence (two all-to-alls per block). "
                               "Must divide the DiT's 24 attention heads. Total GPUs: (2 if cfg_parallel) x ulysses."),
                io.String.Input("gpus", default="", optional=True,
                                tooltip="Device indices to use, e.g. 0,1 (empty: the first ones). Exactly "
                                "(2 if cfg_parallel) x ulysses of them."),
            ],
            outputs=[
                PIPE.Output("pipe_out", display_name="pipe",
                            tooltip="The same pipe; its edits run on the chosen GPUs."),
                io.String.Output("info", tooltip="The layout and the devices."),
            ],
        )

    @classmethod
    def validate_inputs(cls, ulysses):
        return check_choices(ulysses=(ulysses, ULYSSES_CHOICES)) or True

    @classmethod
    def execute(cls, pipe, cfg_parallel, ulysses, gpus="") -> io.NodeOutput:
        from ..qwen_edit.checkpoints.shapes import dit_config

        if not isinstance(pipe, PipePlan):
            raise NodeInputError("pipe: expected the output of Load Qwen Edit")
        count, kind = available_devices()
        try:
            choice = ParallelChoice(cfg=2 if cfg_parallel else 1, ulysses=int(ulysses), gpus=parse_gpus(gpus))
            choice.check(heads=dit_config(pipe.files).num_heads, available=count, device_kind=kind)
        except ParallelInputError as error:
            raise NodeInputError(str(error)) from None
        if pipe.host_blocks and choice.world > 1:
            raise NodeInputError("host_blocks: blocks streamed from host memory and parallel workers both hold the "
                                 "model; set host_blocks to 0 on Load Qwen Edit to run in parallel")
        plan = pipe.with_parallel(choice)
        info = f"parallel: {choice.describe()}" if choice.world > 1 else "parallel: off (one device)"
        if kind != "cuda" and choice.world > 1:
            info += f"\nno GPU here: {choice.world} worker processes on the CPU ({kind}, gloo)"
        return io.NodeOutput(plan, info, ui=ui.PreviewText(info))
