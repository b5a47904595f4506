"""A test-only ComfyUI node: ComfyUI's own Qwen2.5-VL text encoder loaded at the sizes of a small file.

ComfyUI builds its Qwen-Image text encoder at the 7B sizes whatever the file holds, and CLIPLoader offers no way to
say otherwise; ComfyUI's ``load_clip`` does, through the model option ``qwen25_7b_model_config``. This node is
CLIPLoader (type qwen_image) with that option, so CPU server tests run ComfyUI's own text encoder code on
tests/full_width_files.py's one-layer file. It is loaded only into test servers, never shipped.
"""

from __future__ import annotations

import comfy.sd
import folder_paths


class QwenEditTestTextEncoderLoader:
    """CLIPLoader for a Qwen2.5-VL file with ``layers`` decoder layers and an MLP ``intermediate`` wide."""

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802 (ComfyUI's name)
        return {"required": {
            "clip_name": (folder_paths.get_filename_list("text_encoders"),),
            "layers": ("INT", {"default": 1, "min": 1, "max": 28}),
            "intermediate": ("INT", {"default": 128, "min": 1, "max": 18944}),
        }}

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load"
    CATEGORY = "testing"

    def load(self, clip_name, layers, intermediate):
        path = folder_paths.get_full_path_or_raise("text_encoders", clip_name)
        config = {"num_hidden_layers": layers, "intermediate_size": intermediate}
        clip = comfy.sd.load_clip(ckpt_paths=[path], embedding_directory=folder_paths.get_folder_paths("embeddings"),
                                  clip_type=comfy.sd.CLIPType.QWEN_IMAGE,
                                  model_options={"qwen25_7b_model_config": config})
        return (clip,)


NODE_CLASS_MAPPINGS = {"QwenEditTest_TextEncoderLoader": QwenEditTestTextEncoderLoader}
