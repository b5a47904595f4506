"""The FP8 MODEL's row-wise layers keep their column bounds however ComfyUI moves them to the GPU.

0.3.75 moves a model with ``Module.to`` (``Module._apply``), where a row-wise fp8 layer makes the column bound the
fused GELU GEMM and the joint v GEMM read. 0.33's dynamic VRAM puts a GPU copy in place of each tensor
(``comfy.utils.set_attr_buffer``: ``register_buffer`` on the owner) instead. This test moves the FP8 copy of a
small ComfyUI Qwen-Image DiT both ways (bf16 weights quantized on the CPU, where ComfyUI keeps the base under
dynamic VRAM) and checks that the ON_LOAD step (:func:`refresh_column_bounds`) gives the swapped layers the bounds
``_apply`` gives.

Run on the device machine (ComfyUI's source: ``QWEN_EDIT_COMFYUI_DIR``)::

    python3 -m pytest tests/gpu/test_comfy_model_dynamic_load_gpu.py -m gpu -q -rs
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_checkpoints_support import comfy as import_comfy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DIM, HEADS, LAYERS, TEXT = 256, 2, 2, 64


def _fp8_copy():
    import_comfy()
    import comfy.model_patcher
    import comfy.supported_models
    from qwen_edit_hopper.fp8 import Fp8Config
    from qwen_edit_hopper.nodes.comfy_model.fp8_model import fp8_model

    config = comfy.supported_models.QwenImage({
        "image_model": "qwen_image", "in_channels": 64, "num_layers": LAYERS, "attention_head_dim": DIM // HEADS,
        "num_attention_heads": HEADS, "joint_attention_dim": TEXT, "axes_dims_rope": (16, 56, 56)})
    config.set_inference_dtype(torch.bfloat16, None)
    model = config.get_model({})  # on the CPU, as the base stays under dynamic VRAM
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.diffusion_model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5)
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cuda"),
                                               offload_device=torch.device("cpu"))
    config = Fp8Config(backend="scaled_mm_rowwise", preset="attn+mlp+mod compute", fast_accum=True)
    return fp8_model(patcher, config)[1]


def _rowwise_layers(held):
    return {d.name: held.module.get_submodule(d.name) for d in held.report.converted
            if getattr(held.module.get_submodule(d.name), "granularity", None) == "rowwise"}


def _swap_onto_gpu(module: torch.nn.Module) -> None:
    """What 0.33's ``ModelPatcherDynamic.load`` does to each tensor (``comfy.utils.set_attr_buffer`` /
    ``set_attr_param``): a GPU copy put in its place, without ``Module._apply``."""
    for name, buffer in list(module.named_buffers()):
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        owner.register_buffer(attr, buffer.to("cuda"), persistent=attr not in owner._non_persistent_buffers_set)
    for name, param in list(module.named_parameters()):
        owner_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner_name), attr, torch.nn.Parameter(param.to("cuda"), requires_grad=False))


def test_layers_swapped_onto_the_gpu_get_the_bounds_a_move_makes():
    from qwen_edit_hopper.nodes.comfy_model.fp8_model import refresh_column_bounds

    moved, swapped = _fp8_copy(), _fp8_copy()
    assert all(layer.column_bound is None for layer in _rowwise_layers(swapped).values())  # quantized on the CPU
    moved.module.to("cuda")  # 0.3.75's load
    _swap_onto_gpu(swapped.module)  # 0.33's dynamic load
    layers = _rowwise_layers(swapped)
    assert layers and all(layer.weight.is_cuda and layer.column_bound is None for layer in layers.values())

    assert refresh_column_bounds(swapped) == len(layers)
    reference = _rowwise_layers(moved)
    for name, layer in layers.items():
        assert layer.column_bound is not None and layer.column_bound.is_cuda, name
        assert torch.equal(layer.column_bound, reference[name].column_bound), name
    assert refresh_column_bounds(swapped) == 0  # made once: the later loads carry them
