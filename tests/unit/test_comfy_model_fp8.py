"""The FP8 / attention / compile path for ComfyUI's own Qwen-Image MODEL, on a real ComfyUI model in process.

ComfyUI's ``QwenImage`` BaseModel is built at a small size (its classes take the sizes; only its checkpoint
detection fixes them) inside a real ``ModelPatcher``, and sampled through ``comfy.sample.sample`` (KSampler's
call) on the CPU, where the fp8 GEMMs run emulated (``Fp8Config(emulate=True)``, what ``where_unsupported:
emulate`` picks).
"""

from __future__ import annotations

import pytest
import torch
from test_checkpoints_support import comfy as import_comfy

pytestmark = pytest.mark.filterwarnings("ignore")

DIM, HEADS, LAYERS, TEXT = 64, 2, 2, 32
APPLY_FP8_WIDGETS = {"backend": "scaled_mm_rowwise", "te_recipe": "current", "fp8_format": "E4M3",
                     "amax_history_len": 16, "amax_compute_algo": "max", "layers": "attn+mlp",
                     "modulation": "fp8 storage"}
"""Apply TE-FP8's widgets as the tests set them (the MODEL goes in beside them)."""


@pytest.fixture(scope="module")
def comfy():
    import_comfy()
    import comfy.lora
    import comfy.model_management
    import comfy.model_patcher
    import comfy.sample
    import comfy.supported_models

    return comfy


def _patcher(comfy, seed=0):
    config = comfy.supported_models.QwenImage({
        "image_model": "qwen_image", "in_channels": 64, "num_layers": LAYERS, "attention_head_dim": DIM // HEADS,
        "num_attention_heads": HEADS, "joint_attention_dim": TEXT, "axes_dims_rope": (8, 12, 12)})
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({})
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.diffusion_model.named_parameters():
            if param.ndim >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5)
            else:
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator) if "norm" in name
                            else 0.02 * torch.randn(param.shape, generator=generator))
    device = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)


def _config(**kw):
    from qwen_edit_hopper.fp8 import Fp8Config

    return Fp8Config(backend="scaled_mm_rowwise", emulate=True, **kw)


def _sample(comfy, patcher, steps=2, seed=1, unload=True):
    latent = torch.zeros(1, 16, 1, 8, 8)
    ref = torch.randn(1, 16, 1, 8, 8, generator=torch.Generator().manual_seed(5))
    context = torch.randn(1, 7, TEXT, generator=torch.Generator().manual_seed(6))
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(seed))
    positive = [[context, {"reference_latents": [ref]}]]
    negative = [[context * 0.5, {"reference_latents": [ref]}]]
    out = comfy.sample.sample(patcher, noise, steps, 4.0, "euler", "simple", positive, negative, latent,
                              disable_pbar=True, seed=seed)
    if unload:
        comfy.model_management.unload_all_models()
    return out


def _lora(comfy, patcher, strength, rank=4, seed=3):
    """A LoRA on every to_q / img_mlp.net.0.proj, through ComfyUI's own loader (what LoraLoaderModelOnly does)."""
    generator = torch.Generator().manual_seed(seed)
    lora = {}
    for block in range(LAYERS):
        for layer, (n, k) in {"attn.to_q": (DIM, DIM), "img_mlp.net.0.proj": (4 * DIM, DIM)}.items():
            stem = f"diffusion_model.transformer_blocks.{block}.{layer}"
            lora[f"{stem}.lora_down.weight"] = torch.randn(rank, k, generator=generator) * 0.3
            lora[f"{stem}.lora_up.weight"] = torch.randn(n, rank, generator=generator) * 0.3
    key_map = comfy.lora.model_lora_keys_unet(patcher.model, {})
    patches = comfy.lora.load_lora(lora, key_map)
    clone = patcher.clone()
    added = clone.add_patches(patches, strength)
    assert len(added) == 2 * LAYERS
    return clone


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_fp8_model_samples_close_to_comfyui_and_leaves_the_base_alone(comfy):
    from qwen_edit_hopper.nodes.comfy_model.fp8_model import fp8_model

    base = _patcher(comfy)
    before = {k: v.clone() for k, v in base.model.diffusion_model.state_dict().items()}
    reference = _sample(comfy, base)
    fast, held = fp8_model(base, _config())
    out = _sample(comfy, fast)
    error = _rel(out, reference)
    assert 1e-4 < error < 6e-2, error  # fp8 numerics (not bit-equal), close to ComfyUI's own path
    kinds = {type(held.module.get_submodule(d.name)).__name__ for d in held.report.converted}
    assert kinds == {"ScaledMMLinear", "WeightOnlyLinear"}
    assert base.get_model_object("diffusion_model") is not held.module
    for key, value in base.model.diffusion_model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert torch.equal(_sample(comfy, base), reference)  # the unpatched MODEL still runs ComfyUI's path


def test_lora_is_applied_before_quantization_and_removal_restores_the_base(comfy):
    from qwen_edit_hopper.fp8.quant import dequantize
    from qwen_edit_hopper.nodes.comfy_model.fp8_model import fp8_model

    base = _patcher(comfy)
    fast, held = fp8_model(base, _config())
    layer = held.module.transformer_blocks[0].attn.to_q
    comfy.model_management.load_models_gpu([fast])
    base_fp8 = layer.weight.clone(), layer.weight_scale.clone()
    comfy.model_management.unload_all_models()

    with_lora, held_again = fp8_model(_lora(comfy, base, 0.8), _config())
    assert held_again is held  # one fp8 copy per base: a LoRA reuses it
    comfy.model_management.load_models_gpu([with_lora])
    patched = comfy.lora.calculate_weight(with_lora.patches["diffusion_model.transformer_blocks.0.attn.to_q.weight"],
                                          held.base.transformer_blocks[0].attn.to_q.weight.float().clone(),
                                          "to_q")
    got = dequantize(layer.weight, layer.weight_scale, torch.float32)
    assert _rel(got, patched) < 4e-2  # the bf16/fp32 weight + LoRA, quantized (not the fp8 base + LoRA)
    assert _rel(got, dequantize(*base_fp8, torch.float32)) > 0.1
    comfy.model_management.unload_all_models()

    comfy.model_management.load_models_gpu([fast])  # the LoRA removed: the quantized base, bit for bit
    assert torch.equal(layer.weight, base_fp8[0]) and torch.equal(layer.weight_scale, base_fp8[1])
    comfy.model_management.unload_all_models()


def test_lora_strength_change_rewrites_values_in_the_same_tensors(comfy):
    from qwen_edit_hopper.nodes.comfy_model.fp8_model import fp8_model, sync_patches

    base = _patcher(comfy)
    strong, held = fp8_model(_lora(comfy, base, 1.0), _config())
    layer = held.module.transformer_blocks[1].img_mlp.net[0].proj
    comfy.model_management.load_models_gpu([strong])
    tensor, first = layer.weight, layer.weight.clone()
    assert sync_patches(held, strong) == 0  # nothing to do for the same patches on the same tensors
    weak = strong.clone()
    for key in list(weak.patches):
        weak.patches[key] = [(0.2, *p[1:]) for p in weak.patches[key]]
    written = sync_patches(held, weak)
    assert written == 2 * LAYERS  # only the patched weights
    assert layer.weight is tensor and not torch.equal(layer.weight, first)
    comfy.model_management.unload_all_models()


def test_patched_values_are_quantized_in_chunks_with_the_same_result(comfy, monkeypatch):
    from qwen_edit_hopper.nodes.comfy_model import fp8_model as module
    from qwen_edit_hopper.qwen_edit import fp8_dit

    base = _patcher(comfy)
    strong, held = module.fp8_model(_lora(comfy, base, 1.0), _config())
    comfy.model_management.load_models_gpu([strong])
    weak = strong.clone()
    for key in list(weak.patches):
        weak.patches[key] = [(0.2, *p[1:]) for p in weak.patches[key]]
    layers = [d.name for d in held.report.converted]
    assert module.sync_patches(held, weak) == 2 * LAYERS
    whole = {n: held.module.get_submodule(n).weight.clone() for n in layers}
    assert module.sync_patches(held, strong) == 2 * LAYERS
    chunks = []
    write = fp8_dit.write_weights

    def watched(variant, values):
        chunks.append(sorted(values))
        return write(variant, values)

    monkeypatch.setattr(fp8_dit, "write_weights", watched)
    monkeypatch.setattr(module, "SYNC_CHUNK_BYTES", 1)  # every value its own chunk
    assert module.sync_patches(held, weak) == 2 * LAYERS
    assert len(chunks) == 2 * LAYERS and all(len(c) == 1 for c in chunks)
    for n in layers:
        assert torch.equal(held.module.get_submodule(n).weight, whole[n]), n
    assert module.sync_patches(held, weak) == 0  # each chunk noted what its layers hold
    comfy.model_management.unload_all_models()


def test_a_strength_change_keeps_the_loaded_copy_and_samples_the_new_strength(comfy, monkeypatch):
    from qwen_edit_hopper.nodes.comfy_model.fp8_model import fp8_model

    base = _patcher(comfy)
    strong, held = fp8_model(_lora(comfy, base, 1.0), _config())
    weak, same = fp8_model(_lora(comfy, base, 0.2), _config())
    assert same is held and weak.patches_uuid == strong.patches_uuid != base.patches_uuid
    moves = []  # ComfyUI unpatching weights while the fp8 copy is the model's DiT: it moves the copy off and back
    unpatch = comfy.model_patcher.ModelPatcher.unpatch_model

    def watched(self, device_to=None, unpatch_weights=True):
        if unpatch_weights and self.model.diffusion_model is held.module:
            moves.append(device_to)
        return unpatch(self, device_to, unpatch_weights)

    monkeypatch.setattr(comfy.model_patcher.ModelPatcher, "unpatch_model", watched)
    _sample(comfy, strong, unload=False)
    after_strong = _sample(comfy, weak, unload=False)  # ComfyUI finds the model loaded and does not load it again
    assert moves == []
    comfy.model_management.unload_all_models()
    alone = _sample(comfy, weak)  # a fresh load of the weak clone
    assert torch.equal(after_strong, alone)
    other = _lora(comfy, base, 1.0)
    other.add_patches({"diffusion_model.img_in.weight": (torch.zeros_like(base.model.diffusion_model.img_in.weight),)},
                      0.5)  # a patch ComfyUI applies itself (img_in stays high precision)
    assert fp8_model(other, _config())[0].patches_uuid != strong.patches_uuid


def test_lora_added_after_the_fp8_node_is_applied_too(comfy):
    from qwen_edit_hopper.nodes.comfy_model.fp8_model import fp8_model

    base = _patcher(comfy)
    fast, _ = fp8_model(base, _config())
    before = _sample(comfy, fast)
    after = _sample(comfy, _lora(comfy, fast, 1.0))
    assert _rel(after, before) > 1e-2
    reference = _sample(comfy, _lora(comfy, base, 1.0))
    assert _rel(after, reference) < 6e-2


def test_attention_override_and_compile_wrapper_run_the_same_numbers(comfy):
    from qwen_edit_hopper.nodes.comfy_model.attention import set_attention
    from qwen_edit_hopper.nodes.comfy_model.fp8_model import fp8_model

    base = _patcher(comfy)
    fast, _ = fp8_model(base, _config())
    plain = _sample(comfy, fast)
    with_attention = fast.clone()
    set_attention(with_attention, "sdpa_math")
    assert _rel(_sample(comfy, with_attention), plain) < 1e-4
    emulated_fp8 = fast.clone()
    set_attention(emulated_fp8, "cudnn_fp8_emulated")
    assert 1e-4 < _rel(_sample(comfy, emulated_fp8), plain) < 6e-2


def test_compile_wrapper_compiles_the_running_blocks(comfy):
    from qwen_edit_hopper.nodes.comfy_model.compile import set_compile
    from qwen_edit_hopper.nodes.comfy_model.fp8_model import fp8_model

    base = _patcher(comfy)
    fast, held = fp8_model(base, _config())
    plain = _sample(comfy, fast, steps=1)
    compiled = fast.clone()
    calls = []

    def backend(graph, inputs):
        calls.append(graph)
        return graph.forward

    wrapper = set_compile(compiled, "default", True)
    wrapper.compile_kwargs = {"backend": backend}
    out = _sample(comfy, compiled, steps=1)
    assert calls, "no block was compiled"
    assert _rel(out, plain) < 1e-5
    assert all(type(b).__name__ == "QwenImageTransformerBlock" for b in held.module.transformer_blocks)


def test_refusals_name_what_they_cannot_honour(comfy):
    from qwen_edit_hopper.nodes.comfy_model.check import ComfyModelError
    from qwen_edit_hopper.nodes.comfy_model.fp8_model import fp8_model

    base = _patcher(comfy)
    other = base.clone()
    other.add_object_patch("diffusion_model", torch.nn.Linear(2, 2))
    with pytest.raises(ComfyModelError, match=r"torch\.nn\.modules\.linear\.Linear|object patch"):
        fp8_model(other, _config())
    odd = base.clone()
    odd.add_patches({"diffusion_model.transformer_blocks.0.attn.to_q.weight": ("mystery", torch.zeros(1))}, 1.0)
    with pytest.raises(ComfyModelError, match=r"mystery.*transformer_blocks\.0\.attn\.to_q"):
        fp8_model(odd, _config())
    from qwen_edit_hopper.fp8 import Fp8Config

    with pytest.raises(ComfyModelError, match=r"computes in torch\.float32"):
        fp8_model(base, Fp8Config(backend="scaled_mm_rowwise"))
    hooked = base.clone()
    with torch.no_grad():
        hooked.model.diffusion_model.transformer_blocks[0].attn.to_k.weight.data = (
            hooked.model.diffusion_model.transformer_blocks[0].attn.to_k.weight.data.to(torch.float8_e4m3fn))
    with pytest.raises(ComfyModelError, match=r"float8_e4m3fn.*weight_dtype"):
        fp8_model(hooked, _config())


def test_the_nodes_take_a_model_and_return_one_for_ksampler(comfy):
    from qwen_edit_hopper.nodes.apply_fp8 import ApplyFP8
    from qwen_edit_hopper.nodes.common import NodeInputError
    from qwen_edit_hopper.nodes.compile_model import CompileModel

    base = _patcher(comfy)
    out = ApplyFP8.execute(**APPLY_FP8_WIDGETS, where_unsupported="emulate", model=base, attention="cudnn_fp8")
    pipe, report, model = out.args
    assert pipe is None and "EMULATED" in report and "cudnn_fp8_emulated" in report
    compiled = CompileModel.execute(mode="default", dynamic=True, warmup=True, warmup_size=256, model=model).args
    assert compiled[0] is None and "CUDA graphs: not on a ComfyUI MODEL" in compiled[1]
    assert 1e-4 < _rel(_sample(comfy, model), _sample(comfy, base)) < 6e-2
    with pytest.raises(NodeInputError, match="connect exactly one"):
        ApplyFP8.execute(**APPLY_FP8_WIDGETS, where_unsupported="emulate")
    with pytest.raises(NodeInputError, match=r"attention: triton_fp8 cannot run here"):
        ApplyFP8.execute(**APPLY_FP8_WIDGETS, where_unsupported="emulate", model=base, attention="triton_fp8")


def test_the_fp8_copy_goes_when_comfyui_lets_its_base_go(comfy):
    import gc
    import weakref

    from qwen_edit_hopper.nodes.comfy_model.fp8_model import _COPIES, fp8_model

    base = _patcher(comfy)
    fast, held = fp8_model(base, _config())
    assert held.base is base.model.diffusion_model
    gone = weakref.ref(base.model.diffusion_model)
    copy = weakref.ref(held.module)
    entries = len(_COPIES)
    del base, fast, held
    gc.collect()
    assert gone() is None and copy() is None  # neither the bf16 base nor its fp8 copy stays in memory
    assert len(_COPIES) == entries - 1


def test_the_report_names_dynamic_vram_only_where_comfyui_loads_the_model_with_it(comfy):
    from qwen_edit_hopper.nodes.apply_fp8 import ApplyFP8, dynamic_vram_line
    from qwen_edit_hopper.nodes.comfy_compat import dynamic_patcher
    from qwen_edit_hopper.nodes.comfy_model.fp8_model import fp8_model

    base = _patcher(comfy)
    assert not dynamic_patcher(base)  # a CPU load device: a plain ModelPatcher on 0.33.0 too
    report = ApplyFP8.execute(**APPLY_FP8_WIDGETS, where_unsupported="emulate", model=base).args[1]
    assert "dynamic VRAM" not in report
    module = fp8_model(base, _config())[1].module
    stored = sum(t.numel() * t.element_size() for t in module.buffers())
    line = dynamic_vram_line(module)
    assert f"({stored / 2**30:.1f} GiB)" in line and "plain model" in line


def _dynamic_patcher(comfy, patcher):
    """``patcher``'s BaseModel in 0.33.0's real ``ModelPatcherDynamic`` (comfy-aimdo's library loads without a GPU;
    the patcher is made for a CUDA load device, as ComfyUI makes it on a GPU, and never loaded here)."""
    import importlib

    aimdo = pytest.importorskip("comfy_aimdo.control", reason="dynamic VRAM is ComfyUI 0.33.0's (comfy-aimdo)")
    if not aimdo.init():
        pytest.skip("comfy-aimdo's library does not load here")
    import comfy_aimdo.host_buffer

    importlib.reload(comfy_aimdo.host_buffer)  # ComfyUI's main.py loads the library before importing comfy; here after
    dynamic = comfy.model_patcher.ModelPatcherDynamic(patcher.model, load_device=torch.device("cuda"),
                                                      offload_device=torch.device("cpu"))
    assert dynamic.is_dynamic()
    return dynamic


def _linear_weight_types(module: torch.nn.Module) -> dict[str, type]:
    """Each ``nn.Linear``'s name -> the type of its ``weight`` (a parameter, unless something replaced it)."""
    return {name: type(m.weight) for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)}


def test_a_dynamic_vram_model_gives_a_plain_fp8_model_that_unloads_back_to_its_base(comfy):
    """Under 0.33's dynamic VRAM ComfyUI restores each buffer by its path from the BaseModel after undoing object
    patches: the fp8 copy's ``weight`` buffers would land on the bf16 base's layers (where ``weight`` is a parameter).
    Apply TE-FP8 therefore returns a plain ModelPatcher over the same BaseModel, and says so."""
    from qwen_edit_hopper.nodes.apply_fp8 import ApplyFP8
    from qwen_edit_hopper.nodes.comfy_compat import dynamic_patcher
    from qwen_edit_hopper.nodes.comfy_model.fp8_model import fp8_model

    dynamic = _dynamic_patcher(comfy, _patcher(comfy))
    base = dynamic.model.diffusion_model
    before = {k: v.clone() for k, v in base.state_dict().items()}
    kinds = _linear_weight_types(base)
    clone, held = fp8_model(dynamic, _config())
    assert type(clone) is comfy.model_patcher.ModelPatcher and not dynamic_patcher(clone)
    assert clone.model is dynamic.model and clone.parent is dynamic

    clone.patch_model(load_weights=False)  # what ComfyUI's load does first: the object patch in place
    assert clone.model.diffusion_model is held.module
    clone.detach(unpatch_all=True)  # ComfyUI's unload (/free): Module.to the offload device, then the base back
    assert clone.model.diffusion_model is base
    assert _linear_weight_types(base) == kinds  # no fp8 buffer landed on a base layer
    after = base.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)

    output = ApplyFP8.execute(**APPLY_FP8_WIDGETS, where_unsupported="emulate", model=dynamic).args
    assert "loads as a plain model" in output[1] and "--disable-dynamic-vram" in output[1]
    assert not dynamic_patcher(output[2])
