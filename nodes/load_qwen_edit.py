"""Load Qwen Edit: choose weights from ComfyUI's model folders; returns a plan (weights load on first use)."""

from __future__ import annotations

import os

import comfy.model_management as mm
from comfy_api.latest import io, ui

from ..qwen_edit.plan import PipePlan, Variant
from .common import (
    CATEGORY,
    NO_FOLDER,
    PIPE,
    NodeInputError,
    check_choices,
    check_model_file_choice,
    diffusers_folder_path,
    diffusers_folders,
    model_choices,
    model_file_path,
)

VARIANT_CHOICES = ["auto", *(v.value for v in Variant)]
VARIANT_BY_NAME = {"edit": Variant.EDIT, "edit_2509": Variant.EDIT_2509, "edit_2511": Variant.EDIT_2511}
ATTENTION_CHOICES = ["auto", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flash_attn", "triton_fp8", "cudnn_fp8"]
EMULABLE_ATTENTION = {"cudnn_fp8": "cudnn_fp8_emulated"}
"""Attention backends that QWEN_EDIT_FP8_EMULATE=1 replaces by an fp32 mirror where they cannot run."""


def resolve_attention(attention: str) -> tuple[str, str, str | None]:
    """(backend to run, note, problem) for the widget value on this server's device.

    A backend that cannot run here gives a problem naming the reason, unless QWEN_EDIT_FP8_EMULATE=1 lets
    it run as its fp32 mirror: then the mirror's name and a note that says EMULATED.
    """
    from ..fp8.attention import check_backend
    from .apply_fp8 import EMULATE_ENV

    if attention == "auto":
        return attention, "", None
    ok, reason = check_backend(attention, mm.get_torch_device())
    if ok:
        return attention, "", None
    if os.environ.get(EMULATE_ENV) == "1" and attention in EMULABLE_ATTENTION:
        mirror = EMULABLE_ATTENTION[attention]
        return mirror, (f"EMULATED: attention {attention} cannot run here ({reason}); {EMULATE_ENV}=1 runs it "
                        f"as {mirror}, an fp32 mirror of its FP8 numerics (no speed)"), None
    return attention, "", f"attention {attention} cannot run here: {reason}"


class LoadQwenEdit(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QwenEditHopper_Load",
            display_name="Load Qwen Edit",
            category=CATEGORY,
            description="Pick Qwen-Image-Edit weights (Comfy-Org single files or a diffusers/ModelScope folder). "
            "Returns a pipe plan: weights are read once, on first use, and shared by every branch.",
            inputs=[
                io.Combo.Input("diffusion_model", options=model_choices("diffusion_models"),
                               tooltip="The DiT (transformer), e.g. qwen_image_edit_2509_bf16.safetensors from "
                               "models/diffusion_models. Ignored when a diffusers folder is chosen."),
                io.Combo.Input("text_encoder", options=model_choices("text_encoders"),
                               tooltip="Qwen2.5-VL 7B text encoder from models/text_encoders "
                               "(qwen_2.5_vl_7b.safetensors; the _fp8_scaled file is dequantized to bf16 on load)."),
                io.Combo.Input("vae", options=model_choices("vae"),
                               tooltip="Qwen-Image VAE from models/vae (qwen_image_vae.safetensors, ComfyUI layout, "
                               "or the diffusers layout)."),
                io.Combo.Input("diffusers_folder", options=[NO_FOLDER, *diffusers_folders()], default=NO_FOLDER,
                               tooltip="A diffusers/ModelScope pipeline folder (transformer/, text_encoder/, vae/, "
                               "processor/) in models/qwen_edit or models/diffusion_models. When set, it replaces "
                               "the three files above."),
                io.Combo.Input("variant", options=VARIANT_CHOICES, default="auto",
                               tooltip="auto detects Edit / Edit-2509 / Edit-2511 from the files (model_index.json, "
                               "config, file name) and says why; pick one when detection cannot tell."),
                io.Combo.Input("attention", options=ATTENTION_CHOICES, default="auto",
                               tooltip="Attention backend of the DiT, reported in every benchmark. auto: PyTorch "
                               "SDPA's own pick (cuDNN on Hopper); sdpa_*: force one SDPA kernel; flash_attn: the "
                               "flash-attn package (FA3/FA2) when installed; triton_fp8: this pack's 8-bit "
                               "(int8 QK^T) Triton kernel, Hopper only; cudnn_fp8: cuDNN's FP8 attention "
                               "(needs nvidia-cudnn-frontend; Hopper or newer), the fastest measured."),
            ],
            outputs=[
                PIPE.Output("pipe", tooltip="Qwen-Image-Edit pipe plan for Fuse LoRA, Apply TE-FP8, Compile Model, "
                            "Sampler and Benchmark."),
                io.String.Output("info", tooltip="What was chosen and why (variant detection, layout)."),
            ],
        )

    @classmethod
    def validate_inputs(cls, diffusion_model, text_encoder, vae, diffusers_folder, variant, attention):
        problem = check_choices(variant=(variant, VARIANT_CHOICES), attention=(attention, ATTENTION_CHOICES))
        if problem:
            return problem
        _, _, attention_problem = resolve_attention(attention)
        if attention_problem:
            return attention_problem
        try:
            if diffusers_folder != NO_FOLDER:
                diffusers_folder_path(diffusers_folder)
            else:
                check_model_file_choice("diffusion_models", diffusion_model, "diffusion_model")
                check_model_file_choice("text_encoders", text_encoder, "text_encoder")
                check_model_file_choice("vae", vae, "vae")
        except NodeInputError as error:
            return str(error)
        return True

    @classmethod
    def execute(cls, diffusion_model, text_encoder, vae, diffusers_folder, variant, attention) -> io.NodeOutput:
        from ..qwen_edit.checkpoints.layouts import resolve_diffusers_folder, resolve_single_files
        from ..qwen_edit.checkpoints.variants import detect_variant

        if diffusers_folder != NO_FOLDER:
            files = resolve_diffusers_folder(diffusers_folder_path(diffusers_folder))
        else:
            files = resolve_single_files(
                dit=model_file_path("diffusion_models", diffusion_model, "diffusion_model"),
                text_encoder=model_file_path("text_encoders", text_encoder, "text_encoder"),
                vae=model_file_path("vae", vae, "vae"),
            )
        if variant == "auto":
            info = detect_variant(files)
            if not info.known:
                raise NodeInputError(f"variant: could not tell which Qwen-Image-Edit release these files are "
                                     f"({info.reason}); set variant to qwen-image-edit, -2509 or -2511")
            chosen, reason = VARIANT_BY_NAME[info.name], info.reason
        else:
            chosen, reason = Variant(variant), "chosen by the user"
        attention, note, _ = resolve_attention(attention)
        plan = PipePlan(files=files, variant=chosen, variant_reason=reason, attention=attention)
        info = f"layout: {files.layout}\n{plan.describe()}" + (f"\n{note}" if note else "")
        return io.NodeOutput(plan, info, ui=ui.PreviewText(info))
