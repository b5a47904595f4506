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
from test_comfy_model_fp8 import DIM, LAYERS, TEXT, _config, _lora, _patcher, _rel

comfy = fp8_tests.comfy
"""The tiny model's ComfyUI (a module-scoped fixture of test_comfy_model_fp8.py)."""

pytestmark = pytest.mark.filterwarnings("ignore")

FP32_TOLERANCE = 1e-5
"""Relative error (Frobenius) of the fused block against ComfyUI's block in float32: the same math in another
order (RoPE as cos/sin tables, RMSNorm weight after the norm, [image, text] token order)."""


def _sample(comfy, patcher, reference=True, steps=2, seed=1, extra=None, negative_tokens=7):
    """KSampler's call, batch 2 (CFG), with or without a reference latent; ``extra`` adds conditioning keys. The
    positive prompt has 7 tokens, the negative ``negative_tokens`` (another count: ComfyUI makes two batch-1 calls
    per step)."""
    latent = torch.zeros(1, 16, 1, 8, 8)
    context = torch.randn(1, 7, TEXT, generator=torch.Generator().manual_seed(6))
    other = torch.randn(1, negative_tokens, TEXT, generator=torch.Generator().manual_seed(7))
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(seed))
    keys = dict(extra or {})
    if reference:
        keys["reference_latents"] = [torch.randn(1, 16, 1, 8, 8, generator=torch.Generator().manual_seed(5))]
    positive = [[context, dict(keys)]]
    negative = [[context * 0.5 if negative_tokens == 7 else other, dict(keys)]]
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

    options = {FACTS_KEY: CallFacts(dit, None)}
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
    uneven = _sample(comfy, fused, extra=extra, negative_tokens=4)  # not padded: ComfyUI's block runs each prompt
    assert not runs and torch.equal(uneven, _sample(comfy, base, extra=extra, negative_tokens=4))


def test_a_right_padding_text_mask_runs_the_fused_block(comfy, caplog):
    base = _patcher(comfy)
    mask = torch.ones(1, 7, dtype=torch.long)
    mask[:, 5:] = 0
    extra = {"attention_mask": mask}
    expected = _sample(comfy, base, extra=extra)
    fused, _, runs = _replaced(base)
    with caplog.at_level(logging.WARNING):
        out = _sample(comfy, fused, extra=extra)
    assert runs and not [r for r in caplog.records if "own block runs" in r.getMessage()]
    assert _rel(out, expected) < FP32_TOLERANCE
    if _has_timestep_zero(comfy):  # 0.33 hands the mask to the model and applies it: it changes the image
        assert _rel(expected, _sample(comfy, base)) > 1e-3


def test_a_text_mask_that_is_not_right_padding_runs_comfyui_block_and_says_so(comfy, caplog):
    if not _has_timestep_zero(comfy):
        pytest.skip("0.3.75 never hands Qwen-Image a mask from the conditioning")
    base = _patcher(comfy)
    mask = torch.ones(1, 7, dtype=torch.long)
    mask[:, 1] = 0
    extra = {"attention_mask": mask}
    expected = _sample(comfy, base, extra=extra)
    fused, _, runs = _replaced(base)
    with caplog.at_level(logging.WARNING):
        out = _sample(comfy, fused, extra=extra)
    said = [r.getMessage() for r in caplog.records if "not right padding" in r.getMessage()]
    assert not runs and len(said) == 1 and torch.equal(out, expected), said


@pytest.mark.parametrize("reference", [True, False], ids=["reference", "no_reference"])
def test_prompts_of_different_lengths_run_one_batch_per_step(comfy, reference):
    """Positive 7 tokens, negative 4: ComfyUI's own block runs two batch-1 calls per step; the fused block's MODEL
    pads the negative and runs one batch-2 call, with the same image."""
    base = _patcher(comfy)
    expected = _sample(comfy, base, reference, negative_tokens=4)
    assert _rel(expected, _sample(comfy, base, reference)) > 1e-3  # the negative prompt matters
    fused, _, runs = _replaced(base)
    out = _sample(comfy, fused, reference, negative_tokens=4)
    assert len(runs) == 2 * LAYERS and all(s[0] == 2 for s in runs), runs  # 2 steps, one batch-2 call each
    error = _rel(out, expected)
    print(f"padded batch vs two ComfyUI calls, fp32, reference={reference}: relative error {error:.2e}")
    assert error < FP32_TOLERANCE, error


def test_texts_are_not_padded_where_a_patch_could_read_them(comfy, caplog):
    base = _patcher(comfy)
    expected = _sample(comfy, base, negative_tokens=4)
    fused, _, runs = _replaced(base)
    fused.set_model_patch(lambda args: {"img": args["img"], "txt": args["txt"]}, "double_block")
    with caplog.at_level(logging.INFO):
        out = _sample(comfy, fused, negative_tokens=4)
    assert runs and all(s[0] == 1 for s in runs)  # ComfyUI's batching: two batch-1 calls per step
    said = [r.getMessage() for r in caplog.records if "transformer patches (double_block)" in r.getMessage()]
    assert len(said) == 1, said
    assert _rel(out, expected) < FP32_TOLERANCE


def test_texts_are_not_padded_for_a_controlnet_or_a_mask_of_their_own(comfy):
    from comfy.conds import CONDRegular
    from qwen_edit_hopper.nodes.comfy_model.block_replace import replaced_blocks_of_options
    from qwen_edit_hopper.nodes.comfy_model.text_padding import PadTexts

    fused, _, _ = _replaced(_patcher(comfy))
    options = fused.model_options

    def conds(**extra):
        long = {"model_conds": {"c_crossattn": CONDRegular(torch.randn(1, 7, TEXT))}, **extra}
        return [[long], [{"model_conds": {"c_crossattn": CONDRegular(torch.randn(1, 4, TEXT))}}]]

    pad = PadTexts(replaced_blocks_of_options)
    assert pad.why_not(fused.model, conds(), options) is None
    assert "ControlNet" in pad.why_not(fused.model, conds(control=object()), options)
    masked = conds()
    masked[0][0]["model_conds"]["attention_mask"] = CONDRegular(torch.ones(1, 7))
    assert "its own text attention mask" in pad.why_not(fused.model, masked, options)
    assert "not every transformer block" in pad.why_not(fused.model, conds(), _patcher(comfy).model_options)


def test_padding_leaves_the_samplers_conditions_as_they_were(comfy):
    from comfy.conds import CONDRegular
    from qwen_edit_hopper.nodes.comfy_model.text_padding import pad_conds, text_length

    short, long = torch.randn(1, 4, TEXT), torch.randn(1, 7, TEXT)
    conds = [[{"model_conds": {"c_crossattn": CONDRegular(long)}}],
             [{"model_conds": {"c_crossattn": CONDRegular(short)}}], None]
    padded = pad_conds(conds, 7)
    assert [text_length(c[0]) for c in conds[:2]] == [7, 4] and conds[2] is None  # the originals
    assert [text_length(c[0]) for c in padded[:2]] == [7, 7] and padded[2] is None
    text, mask = padded[1][0]["model_conds"]["c_crossattn"].cond, padded[1][0]["model_conds"]["attention_mask"].cond
    assert torch.equal(text[:, :4], short) and not text[:, 4:].any()
    assert mask.tolist() == [[1, 1, 1, 1, 0, 0, 0]] and padded[0][0]["model_conds"]["attention_mask"].cond.all()


def test_right_padding_lengths():
    from qwen_edit_hopper.nodes.comfy_model.block_replace import right_padding_lengths

    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert right_padding_lengths(mask, 4) == (3, 4)
    assert right_padding_lengths(mask.bool(), 4) == (3, 4)
    additive = torch.tensor([[0.0, 0.0, -float("inf"), -float("inf")]])
    assert right_padding_lengths(additive, 4) == (2,)
    assert right_padding_lengths(additive, 5) is None  # not this text's length
    assert right_padding_lengths(torch.tensor([[1, 0, 1, 1]]), 4) is None  # a hole: not right padding
    assert right_padding_lengths(torch.tensor([[1, 1, 2, 0]]), 4) is None  # not 1/0
    assert right_padding_lengths(torch.tensor([[0.0, 0.5, 0.0, 0.0]]), 4) is None  # a soft additive bias


def test_a_padded_call_never_falls_back_to_comfyui_block(comfy):
    from qwen_edit_hopper.nodes.comfy_model.block_replace import FastBlocks, ReplacedBlock
    from qwen_edit_hopper.nodes.comfy_model.text_padding import PADDED_KEY

    tokens = torch.zeros(2, 4, DIM)
    args = {"img": tokens, "txt": tokens, "vec": torch.zeros(2, DIM), "pe": None,
            "transformer_options": {PADDED_KEY: True}}
    with pytest.raises(RuntimeError, match=r"no CallFacts.*padded to one length.*model_block to comfyui"):
        ReplacedBlock(FastBlocks("sdpa_math"), 0)(args, {"original_block": lambda a: pytest.fail("ComfyUI's block")})


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
    """ComfyUI's MLP activation is GELU(tanh): the fused GELU kernels take it in that form (and DiffSynth's
    y * sigmoid(1.702 y) in its own), the plain path applies it, and an activation the kernels do not compute (the
    exact erf GELU) keeps the plain path."""
    from qwen_edit_hopper.fp8.gelu_quant import reference_gelu
    from qwen_edit_hopper.qwen_edit.fast.block_kernels import BlockKernels
    from qwen_edit_hopper.qwen_edit.fast.mlp import activation, kernel_gelu, uses_fused_gelu_quant

    mlp = _patcher(comfy).model.diffusion_model.transformer_blocks[0].img_mlp
    assert mlp.net[0].approximate == "tanh" and kernel_gelu(mlp) == "tanh"
    h = torch.linspace(-4, 4, 101)
    assert torch.equal(activation(mlp, h), torch.nn.functional.gelu(h, approximate="tanh"))
    assert torch.equal(reference_gelu(h, "tanh"), torch.nn.functional.gelu(h, approximate="tanh"))
    diffsynth_like = torch.nn.Module()
    diffsynth_like.net = [torch.nn.Module()]
    assert kernel_gelu(diffsynth_like) == "sigmoid"
    assert torch.equal(activation(diffsynth_like, h), h * torch.sigmoid(1.702 * h))
    exact = torch.nn.Module()
    exact.net = [torch.nn.GELU()]
    assert kernel_gelu(exact) is None and torch.equal(activation(exact, h), torch.nn.functional.gelu(h))
    assert not uses_fused_gelu_quant(mlp, BlockKernels(gelu_quant=True))  # CPU layers: no row-wise fp8 GEMM
