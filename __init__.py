"""Qwen Edit Hopper: fast, accurate Qwen-Image-Edit on NVIDIA Hopper, as ComfyUI nodes.

ComfyUI loads this folder as a custom-node pack and calls ``comfy_entrypoint``.
Importing the package does nothing heavy: no ComfyUI, DiffSynth, Transformer
Engine or torch work happens until ComfyUI asks for the node list.
"""

__all__ = ["comfy_entrypoint"]


async def comfy_entrypoint():
    """Return the pack's ComfyExtension (V3 node schema)."""
    from .nodes.extension import QwenEditExtension

    return QwenEditExtension()
