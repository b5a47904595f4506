"""Qwen-Image-Edit on DiffSynth, without ComfyUI.

Checkpoint layouts and key conversion, models built at the size their
checkpoint says, LoRA formats and fusion, the sampling loop and presets.
Nothing here imports ComfyUI; the ``nodes`` package is the only glue.
"""
