"""What the card still holds after ComfyUI unloads the FP8 MODEL, and who holds it.

Through a server, ``/free`` left the card about as full as before it after the shipped MODEL workflow (29.1 GiB on
an H200, ComfyUI 0.3.75) and after ComfyUI core's workflow with TorchCompileModel (47.9 GiB), while the pack's own
workflows went down to about 1 GiB. A server cannot say which tensors stay; this test can. It builds ComfyUI's
``QwenImage`` model (real width, ``QWEN_COMFY_LAYERS`` blocks, default 4) with random bf16 weights on the CPU, where
UNETLoader leaves it, runs one model call (``apply_model``, batch 2, a 1024x1024 edit) on the GPU for:

* ComfyUI core with ComfyUI's own TorchCompileModel wrapper (``comfy_api.torch_helpers``), and
* the shipped MODEL workflow's clone (Apply TE-FP8 ``pack fused`` on the fastest preset's layers, cuDNN FP8
  attention, Compile Model),

then ``comfy.model_management.unload_all_models()``, a garbage collection and ``torch.cuda.empty_cache()``, as
``/free`` does. It prints, for each, the CUDA bytes allocated before the load, loaded, and after the unload, what
the allocator still reserves and the card has in use, and the largest CUDA tensors still alive with what refers to
them. ComfyUI's server runs PyTorch's cudaMallocAsync allocator where it can; run the test under it too
(``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``) to compare. It asserts that the FP8 MODEL's unload gives back
its fp8 copy (at most 10% of the copy's bytes stay); ComfyUI core's figures are printed, not asserted.

Run on the device machine (ComfyUI's source: ``QWEN_EDIT_COMFYUI_DIR``, default ``.testenv/comfyui``)::

    python3 -m pytest tests/gpu/test_comfy_model_unload_gpu.py -m gpu -q -s
"""

from __future__ import annotations

import gc
import os
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "unit"))
sys.path.insert(0, str(ROOT / "scripts"))
from comfy_calls import sampler_model_options  # noqa: E402
from test_checkpoints_support import comfy as import_comfy  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LAYERS = int(os.environ.get("QWEN_COMFY_LAYERS", "4"))
GIB = 1024**3


def _cpu_model(comfy):
    """ComfyUI's QwenImage with random bf16 weights on the CPU, in a ModelPatcher that loads onto ComfyUI's GPU."""
    config = comfy.supported_models.QwenImage({"image_model": "qwen_image", "in_channels": 64, "num_layers": LAYERS})
    config.set_inference_dtype(torch.bfloat16, None)
    model = config.get_model({})
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.diffusion_model.named_parameters():
            if param.ndim >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5)
            else:
                param.copy_(torch.ones_like(param) if "norm" in name else torch.zeros_like(param))
    # ComfyUI's own load device (``cuda:0``): free_memory unloads only the models whose device equals it, and
    # ``torch.device("cuda")`` does not
    return comfy.model_patcher.ModelPatcher(model, load_device=comfy.model_management.get_torch_device(),
                                            offload_device=torch.device("cpu"))


def _inputs():
    generator = torch.Generator(device="cuda").manual_seed(1)
    latent = torch.randn(2, 16, 1, 128, 128, device="cuda", generator=generator, dtype=torch.bfloat16)
    return {"x": latent, "t": torch.tensor([0.5, 0.5], device="cuda"),
            "c_crossattn": torch.randn(2, 300, 3584, device="cuda", generator=generator, dtype=torch.bfloat16),
            "ref_latents": [latent.clone()]}


def _run_once(comfy, patcher, inputs) -> None:
    """One ``apply_model`` call with the options KSampler passes (the MODEL's wrappers and callbacks)."""
    comfy.model_management.load_models_gpu([patcher])
    options = sampler_model_options(patcher)["transformer_options"]
    with torch.inference_mode():
        patcher.model.apply_model(**inputs, transformer_options=options)
    torch.cuda.synchronize()


def _free(comfy) -> None:
    """What ``/free`` (unload_models and free_memory) does, then what ComfyUI's prompt worker does after it."""
    comfy.model_management.unload_all_models()
    gc.collect()
    comfy.model_management.soft_empty_cache()
    torch.cuda.empty_cache()


def _holders(tensor: torch.Tensor, ignore: set[int], depth: int = 4) -> str:
    """What refers to ``tensor``: referrer types (dict keys, function names), following containers and closure cells
    up to ``depth`` levels; objects in ``ignore`` (this test's own lists) are left out."""
    seen = set(ignore) | {id(tensor)}
    lines: list[str] = []
    followed = (dict, list, tuple, set, types.CellType)

    def label(ref, obj) -> str:
        if isinstance(ref, dict):
            keys = [k for k, v in ref.items() if v is obj][:2]
            return f"dict[{', '.join(map(repr, keys))}]"
        if isinstance(ref, types.FunctionType):
            return f"function {ref.__module__}.{ref.__qualname__}"
        return type(ref).__module__ + "." + type(ref).__qualname__

    def walk(obj, level):
        refs = gc.get_referrers(obj)
        seen.add(id(refs))
        for ref in refs:
            if id(ref) in seen or isinstance(ref, types.FrameType):
                continue
            seen.add(id(ref))
            lines.append("  " * level + label(ref, obj))
            if level + 1 < depth and isinstance(ref, followed):
                walk(ref, level + 1)

    walk(tensor, 0)
    return "\n".join(lines[:16]) or "(nothing Python can see)"


def _alive_cuda_tensors(min_bytes: int = 8 * 1024**2) -> list[torch.Tensor]:
    """CUDA tensors the garbage collector can reach, one per storage, largest first."""
    gc.collect()
    by_storage: dict[int, torch.Tensor] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                storage = obj.untyped_storage()
                if storage.nbytes() >= min_bytes:
                    by_storage.setdefault(storage.data_ptr(), obj)
        except Exception:  # objects that only look like tensors
            continue
    return sorted(by_storage.values(), key=lambda t: -t.untyped_storage().nbytes())


def _report(label: str, before: int, loaded: int, after: int, top: int = 4) -> str:
    free, total = torch.cuda.mem_get_info()
    lines = [f"{label}: CUDA allocated before the load {before / GIB:.2f} GiB, loaded {loaded / GIB:.2f} GiB, "
             f"after the unload {after / GIB:.2f} GiB (kept {(after - before) / GIB:.2f} GiB); after it the "
             f"allocator reserves {torch.cuda.memory_reserved() / GIB:.2f} GiB and the card has "
             f"{(total - free) / GIB:.2f} GiB in use (allocator: {torch.cuda.get_allocator_backend()})"]
    alive = _alive_cuda_tensors()
    lines.append(f"  CUDA tensors still alive (>= 8 MiB): {len(alive)}, "
                 f"{sum(t.untyped_storage().nbytes() for t in alive) / GIB:.2f} GiB")
    largest = alive[:top]
    for tensor in largest:
        lines.append(f"  {tuple(tensor.shape)} {tensor.dtype} {tensor.untyped_storage().nbytes() / 1024**2:.0f} MiB, "
                     "held by:")
        lines.append("    " + _holders(tensor, ignore={id(alive), id(largest), id(lines)}).replace("\n", "\n    "))
    return "\n".join(lines)


def test_unloading_the_fp8_model_gives_its_copy_back():
    import_comfy()
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    from qwen_edit_hopper.fp8 import Fp8Config
    from qwen_edit_hopper.nodes.comfy_model.attention import set_attention
    from qwen_edit_hopper.nodes.comfy_model.block_replace import set_block_replace
    from qwen_edit_hopper.nodes.comfy_model.compile import set_compile
    from qwen_edit_hopper.nodes.comfy_model.fp8_model import fp8_model
    from workflows import FASTEST_LAYERS

    base = _cpu_model(comfy)
    inputs = _inputs()
    lines = []

    core = base.clone()
    set_torch_compile_wrapper(core, backend="inductor")
    before = torch.cuda.memory_allocated()
    _run_once(comfy, core, inputs)
    loaded = torch.cuda.memory_allocated()
    _free(comfy)
    lines.append(_report("ComfyUI core + TorchCompileModel", before, loaded, torch.cuda.memory_allocated()))
    del core
    _free(comfy)

    config = Fp8Config(backend="scaled_mm_rowwise", preset=FASTEST_LAYERS, fast_accum=True, gemm_kernel="cublaslt")
    fast, held = fp8_model(base, config)
    set_attention(fast, "cudnn_fp8")
    set_compile(fast, "default", True)
    set_block_replace(fast, "cudnn_fp8")
    copy_bytes = comfy.model_management.module_size(held.module)
    before = torch.cuda.memory_allocated()
    _run_once(comfy, fast, inputs)
    loaded = torch.cuda.memory_allocated()
    on_gpu = next(iter(held.module.buffers())).is_cuda
    _free(comfy)
    after = torch.cuda.memory_allocated()
    lines.append(_report(f"FP8 MODEL (pack fused, compiled; fp8 copy {copy_bytes / GIB:.2f} GiB)", before, loaded,
                         after))
    print("\n" + "\n".join(lines))
    assert on_gpu, "the fp8 copy never reached the GPU"
    assert not next(iter(held.module.buffers())).is_cuda, "the unload left the fp8 copy's module on the GPU"
    assert after - before <= 0.1 * copy_bytes, (
        f"the unload kept {(after - before) / GIB:.2f} GiB of a {copy_bytes / GIB:.2f} GiB fp8 copy on the card")
