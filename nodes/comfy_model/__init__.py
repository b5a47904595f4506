"""The pack's speed for ComfyUI's own Qwen-Image MODEL (UNETLoader -> ... -> KSampler).

Apply TE-FP8 and Compile Model take a ComfyUI ``MODEL`` (a ``comfy.model_patcher.ModelPatcher`` holding
``comfy.ldm.qwen_image.model.QwenImageTransformer2DModel``) and return a clone that every MODEL consumer uses
unchanged. Nothing in ComfyUI is patched process-wide; everything rides on the clone:

* :mod:`.check`: which MODELs are accepted, and the message naming what is refused.
* :mod:`.fp8_model`: an object patch ``diffusion_model`` -> a copy of ComfyUI's DiT whose linears are the pack's
  fp8 layers (``fp8.swap.quantize_linears``), LoRA patches applied to the bf16 weights before quantization when
  ComfyUI loads the model (an ``ON_LOAD`` callback).
* :mod:`.attention`: ``transformer_options["optimized_attention_override"]``, the pack's attention backends.
* :mod:`.compile`: an ``APPLY_MODEL`` wrapper that runs compiled transformer blocks (regional compile).
"""
