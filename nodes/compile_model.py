"""Compile Model: regional torch.compile of the DiT blocks; LoRA changes never recompile."""

from __future__ import annotations

import time

import comfy.model_management as mm
from comfy_api.latest import io, ui

from ..qwen_edit.compile import MODES
from ..qwen_edit.plan import CompileChoice, PipePlan
from .comfy_compat import check_choices
from .comfy_memory import runtime
from .common import CATEGORY, PIPE, NodeInputError

CHOICES = [m for m in MODES if m != "reduce-overhead"]


class CompileModel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QwenEditHopper_Compile",
            display_name="Compile Model (Qwen Edit)",
            category=CATEGORY,
            description="Compiles the transformer block once for all 60 blocks (torch.compile, Inductor; the last "
            "block, which computes only the target image after its attention, is a second graph). Weights "
            "are graph inputs, so LoRA or strength changes never recompile; PyTorch's compile caches make a "
            "restart's first compile fast. Works on top of every FP8 backend (Transformer Engine layers run eager).",
            inputs=[
                PIPE.Input("pipe", optional=True,
                           tooltip="Pipe from Load Qwen Edit, Fuse LoRA or Apply TE-FP8 (or connect model instead)."),
                io.Combo.Input(
                    "mode",
                    options=CHOICES,
                    default="default",
                    tooltip="default: fast compile; max-autotune-no-cudagraphs: tries more GEMM and "
                    "kernel configurations, with a much longer first compile (on an H200, autotuning one "
                    "row-wise fp8 GEMM alone had not finished after 500 s). Whole-forward CUDA graphs are "
                    "the cuda_graphs switch below.",
                ),
                io.Boolean.Input(
                    "dynamic",
                    default=True,
                    tooltip="Compile for symbolic sequence lengths so a new resolution or prompt length "
                    "does not recompile (off: one compile per shape).",
                ),
                io.Boolean.Input(
                    "warmup",
                    default=True,
                    tooltip="Compile now with one forward at warmup_size and report compile time here "
                    "(loads the DiT); off: compile lazily on the Sampler's first step.",
                ),
                io.Int.Input(
                    "warmup_size",
                    default=1024,
                    min=64,
                    max=2048,
                    step=16,
                    tooltip="Side of the square edit used for the warm-up forward.",
                ),
                io.Boolean.Input(
                    "cuda_graphs",
                    default=False,
                    optional=True,
                    tooltip="Capture each DiT forward as one CUDA graph and replay it (GPU only): removes the "
                    "host's kernel-launch gaps, about 2.5 ms of 187 ms per forward on an H200. The first step "
                    "of a new size or prompt length costs about one extra forward for the capture, and the "
                    "graph keeps one forward's working memory reserved. Weights that move (a LoRA swapped, "
                    "offload) drop the graphs; they are captured again.",
                ),
                io.Model.Input("model", optional=True,
                               tooltip="Instead of pipe: ComfyUI's own Qwen-Image(-Edit) MODEL (after Apply TE-FP8 or "
                               "not). Returns a MODEL whose transformer blocks run compiled on KSampler's first step "
                               "(warmup and cuda_graphs do not apply to a MODEL)."),
            ],
            outputs=[
                PIPE.Output(
                    "pipe_out",
                    display_name="pipe",
                    tooltip="A new pipe that runs compiled (the input pipe is unchanged).",
                ),
                io.String.Output("info", tooltip="Compile settings, compile time and cache hits."),
                io.Model.Output("model_out", display_name="model",
                                tooltip="With a MODEL input: a new MODEL that runs compiled (the input is unchanged)."),
            ],
        )

    @classmethod
    def validate_inputs(cls, mode):
        return check_choices(mode=(mode, CHOICES)) or True

    @classmethod
    def execute(cls, mode, dynamic, warmup, warmup_size, cuda_graphs=False, model=None, pipe=None) -> io.NodeOutput:
        from ..qwen_edit.compile import compiled_forward_context, inductor_cache_counters, warmup_inputs
        from .apply_fp8 import require_one_input

        require_one_input(pipe, model)
        if model is not None:
            return model_compile(model, mode, dynamic, bool(cuda_graphs))
        if not isinstance(pipe, PipePlan):
            raise NodeInputError("pipe: expected the output of Load Qwen Edit")
        choice = CompileChoice(mode=mode, dynamic=dynamic, cuda_graphs=bool(cuda_graphs))
        plan = pipe.with_compile(choice)
        lines = [f"compile: mode {mode}, dynamic {dynamic}, regional (one compiled block for all blocks)",
                 "CUDA graphs: " + cuda_graphs_note(bool(cuda_graphs), runtime().device)]
        if warmup:
            from ..qwen_edit.edit import attention_backend
            from ..qwen_edit.fast_forward import fast_model_fn

            rt = runtime()
            dit = rt.dit(plan)
            rt.use([dit])
            side = warmup_size // 16 * 16
            inputs = warmup_inputs(dit.module, side, side, device=rt.device, dtype=rt.dtype)
            before = inductor_cache_counters()
            started = time.perf_counter()
            with compiled_forward_context(choice):
                fast_model_fn(dit=dit.prepared, attention_backend=attention_backend(plan), options=plan.forward,
                              **inputs)
            mm.soft_empty_cache()
            elapsed = time.perf_counter() - started
            after = inductor_cache_counters()
            hits = after["fxgraph_cache_hit"] - before["fxgraph_cache_hit"]
            misses = after["fxgraph_cache_miss"] - before["fxgraph_cache_miss"]
            lines.append(
                f"warm-up forward at {side}x{side}: {elapsed:.1f} s (compile + one forward); Inductor "
                f"cache: {hits} hit(s), {misses} miss(es) ({'cached' if hits and not misses else 'first'}"
                " compile)"
            )
        info = "\n".join(lines)
        return io.NodeOutput(plan, info, None, ui=ui.PreviewText(info))


MODEL_CUDA_GRAPHS = ("not on a ComfyUI MODEL: KSampler calls the model through ComfyUI's own Python (CFG batching, "
                     "wrappers, memory manager) which may move weights between calls; whole-forward graphs run on the "
                     "pack's own Sampler")


def model_compile(model, mode: str, dynamic: bool, cuda_graphs: bool) -> io.NodeOutput:
    """Compile Model on a ComfyUI MODEL: a clone whose transformer blocks run compiled (regional compile)."""
    from .comfy_model.check import ComfyModelError, check_qwen_class
    from .comfy_model.compile import set_compile

    try:
        if not hasattr(model, "get_model_object"):
            raise ComfyModelError(f"model: expected a ComfyUI MODEL, got {type(model).__name__}")
        check_qwen_class(model.get_model_object("diffusion_model"))
    except ComfyModelError as error:
        raise NodeInputError(str(error)) from error
    clone = model.clone()
    set_compile(clone, mode, dynamic)
    lines = [f"compile: mode {mode}, dynamic {dynamic}, regional (each transformer block of the MODEL compiled; one "
             "graph for all), on KSampler's first step; LoRA strength changes write new values, no recompile",
             "CUDA graphs: " + ("requested, but " if cuda_graphs else "") + MODEL_CUDA_GRAPHS]
    info = "\n".join(lines)
    return io.NodeOutput(None, info, clone, ui=ui.PreviewText(info))


def cuda_graphs_note(requested: bool, device) -> str:
    """What the forward will do with CUDA graphs on ``device``, for the node's output: they apply to CUDA
    forwards only, so on another device the note says the forward runs kernel by kernel."""
    if not requested:
        return "off"
    if not str(device).startswith("cuda"):
        return (f"requested, but the model runs on {device}: CUDA graphs need a CUDA GPU, so forwards run kernel "
                "by kernel")
    from ..qwen_edit.fast.graphs import allocator_capability

    allocator = allocator_capability()
    if not allocator.ok:
        return f"requested, but not used (forwards run kernel by kernel): {allocator.reason}"
    return "on (one whole-forward graph per input shape, captured on first use)"
