"""Load Qwen Edit: choose weights from ComfyUI's model folders; returns a plan (weights load on first use)."""

from __future__ import annotations

import comfy.model_management as mm
from comfy_api.latest import io, ui

from ..qwen_edit.compute_dtype import compute_dtype, dtype_label
from ..qwen_edit.plan import PipePlan, Variant
from .comfy_compat import check_choices
from .common import (
    CATEGORY,
    EMULATE,
    NO_FOLDER,
    PIPE,
    REFUSE,
    WHERE_UNSUPPORTED,
    NodeInputError,
    check_model_file_choice,
    diffusers_folder_path,
    diffusers_folders,
    model_choices,
    model_file_path,
    where_unsupported_input,
)

VARIANT_CHOICES = ["auto", *(v.value for v in Variant)]
MAX_HOST_BLOCKS = 200
ATTENTION_CHOICES = ["auto", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flash_attn", "triton_fp8", "cudnn_fp8"]
EMULABLE_ATTENTION = {"cudnn_fp8": "cudnn_fp8_emulated"}
"""Attention backends that ``where_unsupported: emulate`` replaces by an fp32 mirror where they cannot run."""


def resolve_attention(attention: str, where_unsupported: str = REFUSE) -> tuple[str, str, str | None]:
    """(backend to run, note, problem) for the widget values on this server's device.

    A backend that cannot run here gives a problem naming the reason, unless ``where_unsupported`` is
    ``emulate`` and it has an fp32 mirror: then the mirror's name and a note that says EMULATED.
    """
    from ..fp8.attention import attention_capability

    if attention == "auto":
        return attention, "", None
    capability = attention_capability(attention, mm.get_torch_device())
    reason = capability.reason
    if capability.ok:
        return attention, "", None
    if where_unsupported == EMULATE and attention in EMULABLE_ATTENTION:
        mirror = EMULABLE_ATTENTION[attention]
        return mirror, (f"EMULATED: attention {attention} cannot run here ({reason}); where_unsupported: emulate "
                        f"runs it as {mirror}, an fp32 mirror of its FP8 numerics (no speed)"), None
    return attention, "", (f"attention {attention} cannot run here: {reason} (set where_unsupported to emulate to "
                           "check the workflow with its fp32 mirror, without speed)")


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
                where_unsupported_input(),
                io.Int.Input("host_blocks", default=0, min=0, max=MAX_HOST_BLOCKS, optional=True,
                             tooltip="DiT blocks kept in page-locked host memory and copied to the GPU for each "
                             "forward (the last N of the 60). Each saves 0.32 GiB of GPU memory in fp8 (0.63 in bf16) "
                             "and costs about 13 ms per forward on PCIe 5; CUDA graphs are then off. 0 keeps the "
                             "whole DiT on the GPU. The low VRAM workflow uses 10 (under 20 GiB at 1 megapixel)."),
            ],
            outputs=[
                PIPE.Output("pipe", tooltip="Qwen-Image-Edit pipe plan for Fuse LoRA, Apply TE-FP8, Compile Model, "
                            "Sampler and Benchmark."),
                io.String.Output("info", tooltip="What was chosen and why (variant detection, layout)."),
            ],
        )

    @classmethod
    def validate_inputs(cls, diffusion_model, text_encoder, vae, diffusers_folder, variant, attention,
                        where_unsupported=REFUSE, host_blocks=0):
        problem = check_choices(variant=(variant, VARIANT_CHOICES), attention=(attention, ATTENTION_CHOICES),
                                where_unsupported=(where_unsupported, WHERE_UNSUPPORTED))
        if problem:
            return problem
        if not 0 <= host_blocks <= MAX_HOST_BLOCKS:
            return f"host_blocks must be between 0 and {MAX_HOST_BLOCKS}, got {host_blocks}"
        _, _, attention_problem = resolve_attention(attention, where_unsupported)
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
    def execute(cls, diffusion_model, text_encoder, vae, diffusers_folder, variant, attention,
                where_unsupported=REFUSE, host_blocks=0) -> io.NodeOutput:
        from ..qwen_edit.checkpoints.layouts import resolve_diffusers_folder, resolve_single_files
        from ..qwen_edit.checkpoints.loader import check_model_structure
        from ..qwen_edit.checkpoints.shapes import dit_config
        from ..qwen_edit.checkpoints.variants import detect_variant

        if diffusers_folder != NO_FOLDER:
            files = resolve_diffusers_folder(diffusers_folder_path(diffusers_folder))
        else:
            files = resolve_single_files(
                dit=model_file_path("diffusion_models", diffusion_model, "diffusion_model"),
                text_encoder=model_file_path("text_encoders", text_encoder, "text_encoder"),
                vae=model_file_path("vae", vae, "vae"),
            )
        check_model_structure(files)  # headers and config files only: a broken checkpoint fails here, not later
        if variant == "auto":
            info = detect_variant(files)
            if not info.known:
                raise NodeInputError(f"variant: could not tell which Qwen-Image-Edit release these files are "
                                     f"({info.reason}); set variant to qwen-image-edit, -2509 or -2511")
            chosen, reason = Variant.from_checkpoint_name(info.name), info.reason
        else:
            chosen, reason = Variant(variant), "chosen by the user"
        attention, note, _ = resolve_attention(attention, where_unsupported)
        blocks = dit_config(files).num_layers
        notes = [note] if note else []
        if host_blocks > blocks:
            notes.append(f"host_blocks: {host_blocks} asked, the DiT has {blocks} blocks: all {blocks} kept in host "
                         "memory")
            host_blocks = blocks
        if host_blocks and mm.get_torch_device().type != "cuda":
            notes.append(f"host_blocks: the model runs on {mm.get_torch_device()}, where every weight is in host "
                         "memory already; nothing is streamed")
        plan = PipePlan(files=files, variant=chosen, variant_reason=reason, attention=attention,
                        host_blocks=host_blocks)
        label = dtype_label(compute_dtype(mm.get_torch_device()))
        info = "\n".join([f"layout: {files.layout}", plan.describe(label), *notes])
        return io.NodeOutput(plan, info, ui=ui.PreviewText(info))
