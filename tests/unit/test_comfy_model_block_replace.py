"""The pack's fused block on ComfyUI's own Qwen-Image MODEL through ComfyUI's block-replacement hook, on the CPU.

The tiny real ComfyUI model of test_comfy_model_fp8.py, sampled through ``comfy.sample.sample`` (KSampler's call;
positive and negative prompts of one length: one batch-2 model call per step). On the CPU the fused block runs
without fused kernels (``BlockKernels()``). Runs on whichever ComfyUI ``QWEN_EDIT_COMFYUI_DIR`` names (0.3.75 by
default; the zero-timestep and text-mask cases need 0.33's model and are skipped on 0.3.75 where they do not exist).
"""

from __future__ import annotations

import logging

import pytest
import test_comfy_model_fp8 as fp8_tests
import torch
from test_comfy_model_fp8 import LAYERS, TEXT, _config, _lora, _patcher, _rel

comfy = fp8_tests.comfy
"""The tiny model's ComfyUI (a module-scoped fixture of test_comfy_model_fp8.py)."""

pytestmark = pytest.mark.filterwarnings("ignore")

FP32_TOLERANCE = 1e-5
"""Relative error (Frobenius) of the fused block against ComfyUI's block in float32: the same math in another
order (RoPE as cos/sin tables, RMSNorm weight after the norm, [image, text] token order)."""


def _sample(comfy, patcher, reference=True, steps=2, seed=1, extra=None):
    """KSampler's call, batch 2 (CFG), with or without a reference latent; ``extra`` adds conditioning keys."""
    latent = torch.zeros(1, 16, 1, 8, 8)
    context = torch.randn(1, 7, TEXT, generator=torch.Generator().manual_seed(6))
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(seed))
    keys = dict(extra or {})
    if reference:
        keys["reference_latents"] = [torch.randn(1, 16, 1, 8, 8, generator=torch.Generator().manual_seed(5))]
    positive = [[context, dict(keys)]]
    negative = [[context * 0.5, dict(keys)]]
    out = comfy.sample.sample(patcher, noise, steps, 4.0, "euler", "simple", positive, negative, latent,
                              disable_pbar=True, seed=seed)
    comfy.model_management.unload_all_models()
    return out


def _replaced(patcher, backend="sdpa_math"):
    from qwen_edit_hopper.nodes.comfy_model.block_replace import set_block_replace

    clone = patcher.clone()
    shared = set_block_replace(clone, backend)
    runs = []
    original = shared.block_function

    def counting(options):
        fn = original(options)
        return lambda *a, **k: (runs.append(a[1].shape), fn(*a, **k))[1]

    shared.block_function = counting
    return clone, shared, runs


def _has_timestep_zero(comfy) -> bool:
    import inspect

    from comfy.ldm.qwen_image.model import QwenImageTransformerBlock

    return "timestep_zero_index" in inspect.signature(QwenImageTransformerBlock.forward).parameters


@pytest.mark.parametrize("reference", [True, False], ids=["reference", "no_reference"])
def test_fused_block_matches_comfyui_block_in_fp32(comfy, reference):
    base = _patcher(comfy)
    expected = _sample(comfy, base, reference)
    fused, shared, runs = _replaced(base)
    out = _sample(comfy, fused, reference)
    assert len(runs) == 2 * LAYERS and all(s[0] == 2 for s in runs)  # every block, batch 2 (CFG), 2 steps
    assert runs[0][1] == (32 if reference else 16)  # image tokens: target (+ reference)
    error = _rel(out, expected)
    print(f"fused block vs ComfyUI block, fp32, reference={reference}: relative error {error:.2e}")
    assert error < FP32_TOLERANCE, error
    from qwen_edit_hopper.qwen_edit.fast.block_kernels import BlockKernels

    assert shared.last_kernels == BlockKernels()


def test_one_block_matches_comfyui_block_directly(comfy):
    """One block call with the hook's arguments, against ComfyUI's block on the same arguments (max abs error)."""
    from qwen_edit_hopper.nodes.comfy_model.block_replace import FACTS_KEY, CallFacts, FastBlocks, ReplacedBlock

    dit = _patcher(comfy).model.diffusion_model
    generator = torch.Generator().manual_seed(11)
    b, s_img, length, dim = 2, 24, 5, dit.inner_dim
    img = torch.randn(b, s_img, dim, generator=generator)
    txt = torch.randn(b, length, dim, generator=generator)
    vec = torch.randn(b, dim, generator=generator)
    ids = torch.cat([torch.arange(length).view(1, -1, 1).repeat(b, 1, 3).float(),
                     torch.randint(-4, 4, (1, s_img, 3), generator=generator).float().repeat(b, 1, 1)], dim=1)
    pe = dit.pe_embedder(ids).contiguous()
    block = dit.transformer_blocks[1]

    def original(args):
        out = {}
        out["txt"], out["img"] = block(hidden_states=args["img"], encoder_hidden_states=args["txt"],
                                       encoder_hidden_states_mask=None, temb=args["vec"], image_rotary_emb=args["pe"])
        return out

    options = {FACTS_KEY: CallFacts(dit, False)}
    args = {"img": img, "txt": txt, "vec": vec, "pe": pe, "transformer_options": options}
    with torch.no_grad():
        got = ReplacedBlock(FastBlocks("sdpa_math"), 1)(args, {"original_block": original})
        want = original(args)
    for stream in ("img", "txt"):
        error = float((got[stream] - want[stream]).abs().max())
        print(f"one block, {stream}: max abs error {error:.2e}")
        assert got[stream].shape == want[stream].shape and error < 1e-4, (stream, error)


def test_fused_block_on_the_fp8_model_and_lora_strength(comfy):
    from qwen_edit_hopper.nodes.comfy_model.fp8_model import fp8_model

    base = _patcher(comfy)
    plain, _ = fp8_model(_lora(comfy, base, 1.0), _config())
    fused, _, runs = _replaced(plain)
    strong = _sample(comfy, fused)
    assert runs
    error = _rel(strong, _sample(comfy, plain))
    print(f"fused block vs ComfyUI block, emulated fp8 layers: relative error {error:.2e}")
    assert error < 1e-3, error  # the same fp8 layers on the same inputs; only the block's elementwise order differs
    weak = fused.clone()
    for key in list(weak.patches):
        weak.patches[key] = [(0.2, *p[1:]) for p in weak.patches[key]]
    runs.clear()
    out = _sample(comfy, weak)
    assert runs  # the clone keeps the replacement
    assert _rel(out, strong) > 1e-2  # the strength change reaches the fused block's layers
    reference = _sample(comfy, fp8_model(_lora(comfy, base, 0.2), _config())[0])
    assert _rel(out, reference) < 1e-3


def test_zero_timestep_conditioning_runs_comfyui_block_and_says_so(comfy, caplog):
    if not _has_timestep_zero(comfy):
        pytest.skip("this ComfyUI has no zero-timestep conditioning (index_timestep_zero came after 0.3.75)")
    base = _patcher(comfy)
    extra = {"reference_latents_method": "index_timestep_zero"}
    expected = _sample(comfy, base, extra=extra)
    assert _rel(expected, _sample(comfy, base)) > 1e-3  # the conditioning changes ComfyUI's output
    fused, _, runs = _replaced(base)
    with caplog.at_level(logging.WARNING):
        out = _sample(comfy, fused, extra=extra)
    assert not runs
    assert torch.equal(out, expected)
    said = [r.getMessage() for r in caplog.records if "zero-timestep" in r.getMessage()]
    assert len(said) == 1, said  # once, not per block or step


def test_text_mask_runs_comfyui_block_where_comfyui_applies_it(comfy, caplog):
    base = _patcher(comfy)
    mask = torch.ones(1, 7, dtype=torch.long)
    mask[:, 5:] = 0
    extra = {"attention_mask": mask}
    expected = _sample(comfy, base, extra=extra)
    fused, _, runs = _replaced(base)
    with caplog.at_level(logging.WARNING):
        out = _sample(comfy, fused, extra=extra)
    masked = [r.getMessage() for r in caplog.records if "text attention mask" in r.getMessage()]
    if _has_timestep_zero(comfy):  # 0.33 hands the mask to the model: ComfyUI's block runs
        assert not runs and len(masked) == 1 and torch.equal(out, expected)
    else:  # 0.3.75 never gives Qwen-Image the mask: the fused block runs, as ComfyUI's block ignores nothing
        assert runs and not masked and _rel(out, expected) < FP32_TOLERANCE


def test_compile_model_compiles_the_fused_block(comfy):
    from qwen_edit_hopper.nodes.comfy_model.compile import set_compile

    base = _patcher(comfy)
    fused, _, runs = _replaced(base)
    plain = _sample(comfy, fused, steps=1)
    assert runs
    calls = []

    def backend(graph, inputs):
        calls.append(graph)
        return graph.forward

    compiled = fused.clone()
    wrapper = set_compile(compiled, "default", True)
    wrapper.compile_kwargs = {"backend": backend}
    out = _sample(comfy, compiled, steps=1)
    assert calls, "the fused block was not compiled"
    assert any("fast_block" in str(graph.code) or "attn" in str(graph.code) for graph in calls)
    assert _rel(out, plain) < 1e-5


def test_removing_the_replacement_gives_comfyui_block_back(comfy):
    from comfy.patcher_extension import WrappersMP
    from qwen_edit_hopper.nodes.comfy_model.block_replace import (
        FACTS_KEY,
        remove_block_replace,
        replaced_blocks,
    )

    base = _patcher(comfy)
    expected = _sample(comfy, base)
    fused, _, runs = _replaced(base)
    assert replaced_blocks(fused) == list(range(LAYERS)) and replaced_blocks(base) == []
    off = fused.clone()
    remove_block_replace(off)
    assert replaced_blocks(off) == [] and not off.get_wrappers(WrappersMP.DIFFUSION_MODEL, FACTS_KEY)
    assert replaced_blocks(fused) == list(range(LAYERS))  # the clone's removal leaves its parent alone
    assert torch.equal(_sample(comfy, off), expected) and not runs


def test_apply_fp8_node_option(comfy):
    from qwen_edit_hopper.nodes.apply_fp8 import ApplyFP8
    from qwen_edit_hopper.nodes.comfy_model.block_replace import replaced_blocks
    from qwen_edit_hopper.nodes.common import NodeInputError

    base = _patcher(comfy)
    widgets = {"backend": "scaled_mm_rowwise", "te_recipe": "current", "fp8_format": "E4M3", "amax_history_len": 16,
               "amax_compute_algo": "max", "layers": "attn+mlp", "modulation": "fp8 storage",
               "where_unsupported": "emulate", "fast_accum": True}
    _, report, default = ApplyFP8.execute(**widgets, model=base).args
    assert replaced_blocks(default) == [] and "block: comfyui" in report
    _, report, fused = ApplyFP8.execute(**widgets, model=base, model_block="pack fused").args
    assert replaced_blocks(fused) == list(range(LAYERS))
    assert "block: pack fused" in report and "attention sdpa" in report
    assert _rel(_sample(comfy, fused), _sample(comfy, default)) < 1e-3
    with pytest.raises(NodeInputError, match=r"model_block 'fused' is not one of comfyui, pack fused"):
        ApplyFP8.execute(**widgets, model=base, model_block="fused")
    assert replaced_blocks(base) == [] and not base.object_patches  # the refused call left the MODEL as it was
    problem = ApplyFP8.validate_inputs(**widgets, model_block="on")
    assert isinstance(problem, str) and problem.startswith("model_block 'on'")


def test_comfyui_mlp_keeps_its_tanh_gelu(comfy):
    """ComfyUI's MLP activation is GELU(tanh); the fused GELU kernels compute y * sigmoid(1.702 y), so they are not
    taken for it, and its plain path applies its own activation."""
    from qwen_edit_hopper.qwen_edit.fast.block_kernels import BlockKernels
    from qwen_edit_hopper.qwen_edit.fast.mlp import activation, sigmoid_gelu, uses_fused_gelu_quant

    mlp = _patcher(comfy).model.diffusion_model.transformer_blocks[0].img_mlp
    assert mlp.net[0].approximate == "tanh" and not sigmoid_gelu(mlp)
    assert not uses_fused_gelu_quant(mlp, BlockKernels(gelu_quant=True))
    h = torch.linspace(-4, 4, 101)
    assert torch.equal(activation(mlp, h), torch.nn.functional.gelu(h, approximate="tanh"))
    diffsynth_like = torch.nn.Module()
    diffsynth_like.net = [torch.nn.Module()]
    assert sigmoid_gelu(diffsynth_like) and torch.equal(activation(diffsynth_like, h), h * torch.sigmoid(1.702 * h))
