"""Apply TE-FP8: true FP8 compute (Transformer Engine or torch scaled-mm) or FP8 weight storage, never silent."""

from __future__ import annotations

import logging

import comfy.model_management as mm
from comfy_api.latest import io, ui

from ..qwen_edit.plan import PipePlan
from .comfy_compat import check_choices, dynamic_patcher
from .common import CATEGORY, EMULATE, PIPE, REFUSE, WHERE_UNSUPPORTED, NodeInputError, where_unsupported_input

logger = logging.getLogger(__name__)

BACKENDS = ["scaled_mm_rowwise", "te", "scaled_mm_tensorwise", "weight_only"]
TE_RECIPES = ["current", "delayed", "block", "mxfp8", "nvfp4"]
MODULATION = ["fp8 storage", "bf16"]
GEMM_KERNELS = ["cublaslt", "torch"]
COMFY_ATTENTION = "comfyui"
MODEL_ATTENTION = [COMFY_ATTENTION, "cudnn_fp8", "sdpa", "sdpa_cudnn", "sdpa_flash", "flash_attn", "triton_fp8"]
COMFY_BLOCK = "comfyui"
FUSED_BLOCK = "pack fused"
MODEL_BLOCK = [COMFY_BLOCK, FUSED_BLOCK]
FUSED_BLOCK_ATTENTION = "sdpa"
"""The fused block's attention when the node's attention is comfyui (the fused block calls the pack's backends)."""


def build_config(backend, te_recipe, fp8_format, amax_history_len, amax_compute_algo, layers, modulation,
                 fast_accum=True, gemm_kernel="cublaslt", where_unsupported=REFUSE):
    """The fp8 package's frozen config from the node's widgets (ValueError names a bad field).

    ``gemm_kernel`` applies to scaled_mm_rowwise only (other backends get ``torch``).

    Returns (config, note): with ``where_unsupported`` emulate and a backend that cannot run here, the config
    emulates it (Transformer Engine current scaling as per-tensor scaled-mm) and ``note`` says so.
    """
    from ..fp8 import Fp8Config, TeRecipeConfig, check_backend

    recipe = TeRecipeConfig(
        name=te_recipe, fp8_format=fp8_format, amax_history_len=amax_history_len, amax_compute_algo=amax_compute_algo
    )
    storage = "fp8" if modulation == "fp8 storage" else "bf16"
    fast_accum = bool(fast_accum) and backend.startswith("scaled_mm")
    gemm_kernel = gemm_kernel if backend == "scaled_mm_rowwise" else "torch"
    config = Fp8Config(backend=backend, preset=layers, storage_layers=storage, te_recipe=recipe, fast_accum=fast_accum,
                       gemm_kernel=gemm_kernel)
    if where_unsupported != EMULATE or backend == "weight_only":
        return config, ""
    capability = check_backend(config, mm.get_torch_device())
    if capability.ok:
        return config, ""
    emulated = "scaled_mm_tensorwise" if backend == "te" else backend
    note = (
        f"EMULATED: {backend} cannot run here ({capability.reason}); where_unsupported: emulate runs it as "
        f"{emulated} in an fp32 reference path (same quantization, no speed)"
    )
    return Fp8Config(backend=emulated, preset=layers, storage_layers=storage, emulate=True,
                     fast_accum=fast_accum, gemm_kernel=gemm_kernel if emulated == backend else "torch"), note


class ApplyFP8(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        from ..fp8 import preset_names

        return io.Schema(
            node_id="QwenEditHopper_ApplyFP8",
            display_name="Apply TE-FP8 (Qwen Edit)",
            category=CATEGORY,
            description="Converts the DiT's attention and MLP linears to FP8 with real scales. Needs an FP8 GPU "
            "(compute capability 8.9+, Hopper for speed) except weight_only; refused with the reason otherwise, "
            "never a quiet bf16 fallback. LoRAs are always fused before this step.",
            inputs=[
                PIPE.Input("pipe", optional=True,
                           tooltip="Pipe from Load Qwen Edit or Fuse LoRA (or connect model instead)."),
                io.Combo.Input(
                    "backend",
                    options=BACKENDS,
                    default="scaled_mm_rowwise",
                    tooltip="scaled_mm_rowwise: per-token x per-channel scales via torch._scaled_mm "
                    "(fastest under compile); te: NVIDIA Transformer Engine te.Linear (runs eager); "
                    "scaled_mm_tensorwise: one scale per tensor; weight_only: fp8 storage, bf16 "
                    "compute (memory, not speed; runs anywhere).",
                ),
                io.Combo.Input(
                    "te_recipe",
                    options=TE_RECIPES,
                    default="current",
                    tooltip="Transformer Engine recipe (te backend only): current = Float8CurrentScaling "
                    "(Hopper default); delayed = DelayedScaling, calibrated on the first denoising "
                    "step; block = Float8BlockScaling; mxfp8/nvfp4 need Blackwell.",
                ),
                io.Combo.Input(
                    "fp8_format",
                    options=["E4M3", "HYBRID"],
                    default="E4M3",
                    tooltip="FP8 format of the TE recipe (HYBRID: E4M3 forward, E5M2 gradients).",
                ),
                io.Int.Input(
                    "amax_history_len",
                    default=16,
                    min=1,
                    max=1024,
                    tooltip="DelayedScaling: how many past amax values the scale looks at.",
                ),
                io.Combo.Input(
                    "amax_compute_algo",
                    options=["max", "most_recent"],
                    default="max",
                    tooltip="DelayedScaling: scale from the max of the history or the latest amax.",
                ),
                io.Combo.Input(
                    "layers",
                    options=preset_names(),
                    default="attn+mlp",
                    tooltip="Which linears compute in FP8. Default: attention projections and MLPs of "
                    "both streams; input/time embeddings, final norm and output projection stay bf16.",
                ),
                io.Combo.Input(
                    "modulation",
                    options=MODULATION,
                    default="fp8 storage",
                    tooltip="Modulation linears (a third of the weights, applied to one timestep "
                    "vector): fp8 storage with per-channel scales and bf16 compute, or plain bf16.",
                ),
                io.Boolean.Input(
                    "fast_accum",
                    default=True,
                    tooltip="scaled_mm backends: cuBLASLt fp8 fast accumulation (torchao's default). Measured on "
                    "an H200: 4% faster per DiT forward, whole-forward error unchanged (1.36e-2).",
                ),
                io.Combo.Input(
                    "gemm_kernel",
                    options=GEMM_KERNELS,
                    default="cublaslt",
                    optional=True,
                    tooltip="scaled_mm_rowwise: who calls cuBLASLt. cublaslt: the pack's own call without a "
                    "workspace: the same kernel as torch._scaled_mm, bit-identical output, but no memset before "
                    "each large GEMM (H200: about 1.5 ms faster per forward, 4 ms per batched CFG step). Needs "
                    "Hopper and cuBLASLt 12.9+. torch: torch._scaled_mm. Other backends ignore it.",
                ),
                where_unsupported_input(),
                io.Model.Input("model", optional=True,
                               tooltip="Instead of pipe: ComfyUI's own Qwen-Image(-Edit) MODEL (UNETLoader, "
                               "LoraLoaderModelOnly, ...). Returns a MODEL for KSampler with the same FP8 layers; "
                               "LoRAs on it are applied to the bf16 weights before quantization."),
                io.Combo.Input("attention", options=MODEL_ATTENTION, default=COMFY_ATTENTION, optional=True,
                               tooltip="MODEL input only: the attention the MODEL runs. comfyui: ComfyUI's own "
                               "(unchanged); cudnn_fp8: cuDNN FP8 attention (Hopper, the fastest); the others as on "
                               "Load Qwen Edit. The pipe's attention is chosen on Load Qwen Edit."),
                io.Combo.Input("model_block", options=MODEL_BLOCK, default=COMFY_BLOCK, optional=True,
                               tooltip="MODEL input only: the transformer block's forward. comfyui: ComfyUI's own "
                               "(with this node's FP8 layers). pack fused: the pack's fused block through ComfyUI's "
                               "block-replacement hook (fused fp8 kernels on Hopper; attention comfyui runs sdpa "
                               "there; positive and negative prompts of different lengths are padded into one "
                               "batch-2 call per step). 2511's zero-timestep conditioning runs ComfyUI's block, "
                               "said in the log."),
            ],
            outputs=[
                PIPE.Output(
                    "pipe_out", display_name="pipe", tooltip="A new pipe with FP8 (the input pipe is unchanged)."
                ),
                io.String.Output("report", tooltip="Converted and skipped layers with reasons."),
                io.Model.Output("model_out", display_name="model",
                                tooltip="With a MODEL input: a new MODEL with FP8 layers (the input is unchanged)."),
            ],
        )

    @classmethod
    def validate_inputs(
        cls, backend, te_recipe, fp8_format, amax_history_len, amax_compute_algo, layers, modulation, fast_accum,
        gemm_kernel="cublaslt", where_unsupported=REFUSE, attention=COMFY_ATTENTION, model_block=COMFY_BLOCK,
    ):
        from ..fp8 import check_backend, preset_names

        problem = check_choices(backend=(backend, BACKENDS), te_recipe=(te_recipe, TE_RECIPES),
                                fp8_format=(fp8_format, ["E4M3", "HYBRID"]),
                                amax_compute_algo=(amax_compute_algo, ["max", "most_recent"]),
                                layers=(layers, preset_names()), modulation=(modulation, MODULATION),
                                gemm_kernel=(gemm_kernel, GEMM_KERNELS),
                                where_unsupported=(where_unsupported, WHERE_UNSUPPORTED),
                                attention=(attention, MODEL_ATTENTION), model_block=(model_block, MODEL_BLOCK))
        if problem:
            return problem
        try:
            config, _ = build_config(
                backend, te_recipe, fp8_format, amax_history_len, amax_compute_algo, layers, modulation, fast_accum,
                gemm_kernel, where_unsupported,
            )
        except (TypeError, ValueError) as error:
            return str(error)
        capability = check_backend(config, mm.get_torch_device())
        if not capability.ok:
            return (f"backend {backend} cannot run here: {capability.reason} (set where_unsupported to emulate to "
                    "check the workflow in an fp32 reference path, without speed)")
        return True

    @classmethod
    def execute(
        cls, backend, te_recipe, fp8_format, amax_history_len, amax_compute_algo, layers, modulation,
        fast_accum=True, gemm_kernel="cublaslt", where_unsupported=REFUSE, model=None, attention=COMFY_ATTENTION,
        pipe=None, model_block=COMFY_BLOCK,
    ) -> io.NodeOutput:
        from ..fp8 import plan_linears
        from ..qwen_edit.checkpoints.shapes import dit_on_meta
        from ..qwen_edit.fast.qkv import fused_in_plan

        require_one_input(pipe, model)
        config, note = build_config(
            backend, te_recipe, fp8_format, amax_history_len, amax_compute_algo, layers, modulation, fast_accum,
            gemm_kernel, where_unsupported,
        )
        if model is not None:
            return model_fp8(model, config, note, attention, where_unsupported, model_block)
        if not isinstance(pipe, PipePlan):
            raise NodeInputError("pipe: expected the output of Load Qwen Edit")
        decisions = plan_linears(dit_on_meta(pipe.files), config)
        lines = [f"FP8: {config.describe()}", *([note] if note else [])]
        counts: dict[str, int] = {}
        for decision in decisions:
            counts[decision.action] = counts.get(decision.action, 0) + 1
        lines.append(", ".join(f"{n} {action}" for action, n in sorted(counts.items())))
        fused = fused_in_plan(decisions, config.backend)
        if fused:
            lines.append(f"text Q/K/V: one fused row-wise GEMM per block in {fused} blocks (add_qkv_proj)")
        reasons: dict[tuple[str, str], list[str]] = {}
        for decision in decisions:
            reasons.setdefault((decision.action, decision.reason), []).append(decision.name)
        for (action, reason), names in sorted(reasons.items()):
            shown = ", ".join(names[:4]) + (f" ... (+{len(names) - 4})" if len(names) > 4 else "")
            lines.append(f"{action} ({reason}): {shown}")
        info = "\n".join(lines)
        return io.NodeOutput(pipe.with_fp8(config), info, None, ui=ui.PreviewText(info))


def model_fp8(model, config, note: str, attention: str, where_unsupported: str,
              model_block: str = COMFY_BLOCK) -> io.NodeOutput:
    """Apply TE-FP8 on a ComfyUI MODEL: a clone with the fp8 copy of its DiT and, if chosen, the pack's attention
    and the pack's fused block."""
    from .comfy_model.attention import set_attention
    from .comfy_model.block_replace import remove_block_replace, set_block_replace
    from .comfy_model.check import ComfyModelError
    from .comfy_model.fp8_model import fp8_model

    problem = check_choices(model_block=(model_block, MODEL_BLOCK))
    if problem:
        raise NodeInputError(problem)
    attention, attention_note = model_attention(attention, where_unsupported)
    try:
        clone, held = fp8_model(model, config)
    except ComfyModelError as error:
        raise NodeInputError(str(error)) from error
    if attention != COMFY_ATTENTION:
        set_attention(clone, attention)
    if model_block == FUSED_BLOCK:
        block_attention = FUSED_BLOCK_ATTENTION if attention == COMFY_ATTENTION else attention
        set_block_replace(clone, block_attention)
        block_line = (f"block: pack fused (qwen_edit.fast fast_block through ComfyUI's double_block replacement, "
                      f"attention {block_attention}; prompts of different lengths padded to one batch per step; "
                      "2511's zero-timestep conditioning runs ComfyUI's block, said in the log)")
    else:
        remove_block_replace(clone)
        block_line = "block: comfyui (ComfyUI's own block forward)"
    lines = [f"FP8 on ComfyUI's Qwen-Image MODEL: {held.report.summary()}", *([note] if note else []),
             f"attention: {attention}" + (f" ({attention_note})" if attention_note else ""), block_line,
             "LoRA patches on FP8 layers: applied to the bf16 weights, then quantized, when ComfyUI loads the model"]
    if dynamic_patcher(model):
        lines.append(dynamic_vram_line(held.module))
        logger.info("Apply TE-FP8: %s", lines[-1])
    for action, name, reason, count in held.report.grouped():
        lines.append(f"{action} ({reason}): {name}" + (f" x{count}" if count > 1 else ""))
    info = "\n".join(lines)
    return io.NodeOutput(None, info, clone, ui=ui.PreviewText(info))


def dynamic_vram_line(fp8_module) -> str:
    """The report's line for a MODEL that came under ComfyUI's dynamic VRAM: the FP8 MODEL loads as a plain model."""
    gib = sum(t.numel() * t.element_size() for t in fp8_module.buffers()) / 2**30
    return (f"ComfyUI dynamic VRAM: this MODEL loads as a plain model (ComfyUI's ModelPatcher, as with "
            f"--disable-dynamic-vram): its fp8 layers ({gib:.1f} GiB) go to the GPU once and stay there between "
            "prompts, and ComfyUI unloads them whole")


def model_attention(attention: str, where_unsupported: str) -> tuple[str, str]:
    """(backend to run, note): the pack's backend, its emulation under where_unsupported emulate, or a refusal."""
    from ..fp8.attention import attention_capability

    if attention == COMFY_ATTENTION:
        return attention, ""
    capability = attention_capability(attention, mm.get_torch_device())
    if capability.ok:
        return attention, ""
    if attention == "cudnn_fp8" and where_unsupported == EMULATE:
        return "cudnn_fp8_emulated", f"EMULATED: cudnn_fp8 cannot run here ({capability.reason})"
    raise NodeInputError(f"attention: {attention} cannot run here: {capability.reason}"
                         + (" (where_unsupported emulate runs cudnn_fp8 emulated)" if attention == "cudnn_fp8" else ""))


def require_one_input(pipe, model) -> None:
    """Exactly one of the node's pipe and model inputs is connected (NodeInputError otherwise)."""
    if (pipe is None) == (model is None):
        raise NodeInputError("pipe / model: connect exactly one: a pipe from Load Qwen Edit, or a ComfyUI MODEL "
                             "(UNETLoader, LoraLoaderModelOnly, ...)")
