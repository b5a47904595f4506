"""Fuse LoRA: add a LoRA to the pipe plan; fused into the bf16 weights before any FP8, exactly removable."""

from __future__ import annotations

from comfy_api.latest import io, ui

from ..qwen_edit.plan import LoraChoice, PipePlan
from .common import CATEGORY, PIPE, NodeInputError, check_model_file_choice, model_choices, model_file_path


class FuseLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QwenEditHopper_FuseLoRA",
            display_name="Fuse LoRA (Qwen Edit)",
            category=CATEGORY,
            description="Fuses a LoRA into the DiT's bf16 weights (W + strength * alpha/rank * B @ A), always "
            "before FP8 quantization whatever the wiring order. Chain several; removing one restores the "
            "base weights bit for bit.",
            inputs=[
                PIPE.Input("pipe", tooltip="Pipe from Load Qwen Edit or another Fuse LoRA."),
                io.Combo.Input(
                    "lora_name",
                    options=model_choices("loras"),
                    tooltip="LoRA file from models/loras: diffusers/PEFT, kohya, ComfyUI-prefixed, "
                    "LyCORIS (LoHa/LoKr) or a Qwen-Image-Edit Lightning 4/8-step LoRA.",
                ),
                io.Float.Input(
                    "strength",
                    default=1.0,
                    min=-10.0,
                    max=10.0,
                    step=0.05,
                    tooltip="Multiplier of the LoRA delta; negative values subtract it; 0 disables it "
                    "without reloading anything.",
                ),
            ],
            outputs=[
                PIPE.Output(
                    "pipe_out",
                    display_name="pipe",
                    tooltip="The pipe with this LoRA added to its chain (the input pipe is unchanged).",
                ),
                io.String.Output("report", tooltip="Matched and unmatched keys, and whether it is a Lightning LoRA."),
            ],
        )

    @classmethod
    def validate_inputs(cls, lora_name):
        try:
            check_model_file_choice("loras", lora_name, "lora_name")
        except NodeInputError as error:
            return str(error)
        return True

    @classmethod
    def execute(cls, pipe, lora_name, strength) -> io.NodeOutput:
        from ..qwen_edit.checkpoints.shapes import dit_weight_shapes
        from ..qwen_edit.lora import LoraError, load_lora

        if not isinstance(pipe, PipePlan):
            raise NodeInputError("pipe: expected the output of Load Qwen Edit")
        path = model_file_path("loras", lora_name, "lora_name")
        try:
            parsed = load_lora(path, dit_weight_shapes(pipe.files))
        except LoraError as error:
            raise NodeInputError(f"lora_name: {error}") from error
        steps, reason = parsed.lightning
        choice = LoraChoice(path=path, strength=float(strength), lightning_steps=steps)
        lines = [f"{lora_name} x {strength:g}", parsed.report.summary()]
        lines.append(
            f"Lightning {steps}-step LoRA ({reason}): Sampler 'auto' uses its scheduler and cfg 1"
            if steps
            else "not a Lightning LoRA"
        )
        info = "\n".join(lines)
        return io.NodeOutput(pipe.with_lora(choice), info, ui=ui.PreviewText(info))
