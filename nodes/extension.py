"""The pack's ComfyExtension: the list of nodes ComfyUI registers."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io


class QwenEditExtension(ComfyExtension):
    """Registers the pack's nodes (only nodes that are fully built are listed)."""

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        from .apply_fp8 import ApplyFP8
        from .benchmark import Benchmark
        from .common import register_model_folders
        from .compile_model import CompileModel
        from .fuse_lora import FuseLoRA
        from .load_qwen_edit import LoadQwenEdit
        from .parallel import Parallel
        from .sampler import QwenEditSampler

        register_model_folders()
        return [LoadQwenEdit, FuseLoRA, ApplyFP8, CompileModel, Parallel, QwenEditSampler, Benchmark]
