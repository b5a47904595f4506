"""fast_model_fn computes DiffSynth's model_fn_qwen_image, for batch 1 and batched prompts of different lengths.

The tiny DiT (``qwen_edit.tiny``: 2 layers, dim 64, 2 heads of 32) is loaded from the tiny state dict
and then re-initialized "lively": with the tiny files' N(0, 0.02) weights the blocks change the output
by under 1%, so a broken block would hide under a bf16 tolerance. :func:`test_reference_is_sensitive`
shows that with the lively weights the blocks, RoPE, the text, the reference image and zero_cond_t each
move DiffSynth's output by far more than the tolerances used here.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math

import pytest
import torch
from qwen_edit_hopper.fp8 import Fp8Config, LayerPreset, WeightOnlyLinear, quantize_linears
from qwen_edit_hopper.fp8.presets import QWEN_ATTN, QWEN_KEEP, QWEN_MLP, QWEN_MOD
from qwen_edit_hopper.qwen_edit.checkpoints.dit import create_dit
from qwen_edit_hopper.qwen_edit.fast import text as fast_text
from qwen_edit_hopper.qwen_edit.fast.options import SHIPPED
from qwen_edit_hopper.qwen_edit.fast.rope import rope_complex, rope_real, rope_tables
from qwen_edit_hopper.qwen_edit.fast_forward import (
    FUSED_QKV_PATTERN,
    PreparedDit,
    batch_prompts,
    fast_model_fn,
    fuse_qkv,
    text_lengths,
)
from qwen_edit_hopper.qwen_edit.tiny import tiny_configs, tiny_state_dicts

diffsynth_pipe = pytest.importorskip("diffsynth.pipelines.qwen_image")
model_fn_qwen_image = diffsynth_pipe.model_fn_qwen_image

FP32_TOL = 1e-5
BF16_TOL = 2e-2
TEXT_DIM = tiny_configs()[0].text_dim


# ----------------------------------------------------------------------------------------------- helpers


@functools.cache
def _tiny_dit_state() -> dict[str, torch.Tensor]:
    return tiny_state_dicts()["dit"]


def liven(dit: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Weights N(0, 1/fan_in); modulation x2 (gates ~1), img_in x0.2 (blocks dominate); norm weights ~1.5.

    Norm weights of 1.5 give attention logits of std ~2 (attention neither uniform nor one-hot).
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in dit.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
                if "_mod." in name or "norm_out" in name:
                    p.mul_(2.0)
                if name.startswith("img_in"):
                    p.mul_(0.2)
            elif "norm" in name:
                p.copy_(1.5 * (1 + 0.2 * torch.randn(p.shape, generator=g)))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return dit


def build_dit(dtype: torch.dtype = torch.float32, layers: int | None = None) -> torch.nn.Module:
    """The tiny DiT built by ``create_dit`` from ``tiny_configs``, loaded from the tiny state dict, then livened."""
    config = tiny_configs()[0]
    if layers is None or layers == config.num_layers:
        dit = create_dit(config)
        dit.load_state_dict(_tiny_dit_state(), assign=True)
    else:
        dit = create_dit(dataclasses.replace(config, num_layers=layers)).to_empty(device="cpu")
    return liven(dit.float()).to(dtype).eval()


@functools.cache
def _dit(dtype: torch.dtype) -> torch.nn.Module:
    return build_dit(dtype)


@functools.cache
def _dit_bf16_in_fp32() -> torch.nn.Module:
    """The bf16 model's weights in fp32: the exact-arithmetic reference for bf16 runs."""
    return copy.deepcopy(_dit(torch.bfloat16)).float()


def upcast(inputs: dict) -> dict:
    def f(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.float()
        return [f(e) for e in v] if isinstance(v, list) else v

    return {k: f(v) for k, v in inputs.items()}


def dit_copy(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return copy.deepcopy(_dit(dtype))


def make_inputs(dtype=torch.float32, *, latent=(16, 16), refs=((12, 12),), text_tokens=13, seed=2) -> dict:
    """Batch-1 inputs: latents (1, 16, *latent), each reference (1, 16, *ref), prompt (1, text_tokens, T)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "latents": randn(1, 16, *latent),
        # t / 1000 exact in bf16: DiffSynth divides a bf16 timestep in bf16, and sin(1000 t f) of a rounded t
        # differs by up to 1 rad at the highest frequency (the same in both paths, but not in an fp32 reference).
        "timestep": torch.tensor([500.0]).to(dtype),
        "prompt_emb": randn(1, text_tokens, TEXT_DIM),
        "prompt_emb_mask": torch.ones(1, text_tokens, dtype=torch.long),
        "height": latent[0] * 8,
        "width": latent[1] * 8,
        "edit_latents": [randn(1, 16, *ref) for ref in refs],
    }


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def reference(dit, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model_fn_qwen_image(dit=dit, **kwargs)


# ----------------------------------------------------------------------------------------------- tests


def test_reference_is_sensitive():
    """Each ingredient moves DiffSynth's output by >= 10x the bf16 tolerance, so the tolerances mean something."""
    import diffsynth.models.qwen_image_dit as qdit

    dit = dit_copy()
    x = make_inputs()
    ref = reference(dit, **x)
    other_text = make_inputs(seed=7)["prompt_emb"]
    changes = {
        "zero_cond_t": reference(dit, **{**x, "zero_cond_t": True}),
        "text": reference(dit, **{**x, "prompt_emb": other_text}),
        "reference image": reference(dit, **{**x, "edit_latents": [x["edit_latents"][0].flip(-1)]}),
    }
    original = qdit.apply_rotary_emb_qwen
    qdit.apply_rotary_emb_qwen = lambda t, freqs: t
    try:
        changes["rope"] = reference(dit, **x)
    finally:
        qdit.apply_rotary_emb_qwen = original
    dit.transformer_blocks = torch.nn.ModuleList()
    changes["blocks"] = reference(dit, **x)
    moved = {name: rel(out, ref) for name, out in changes.items()}
    assert min(moved.values()) > 10 * BF16_TOL, moved


@pytest.mark.parametrize("zero_cond_t", [False, True], ids=["t", "zero_cond_t"])
@pytest.mark.parametrize("refs", [((12, 12),), ((12, 12), (8, 20))], ids=["1ref", "2refs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_batch1_matches_diffsynth(dtype, refs, zero_cond_t):
    dit = _dit(dtype)
    x = make_inputs(dtype, refs=refs)
    ref = reference(dit, **x, zero_cond_t=zero_cond_t)
    out = fast_model_fn(dit, **x, zero_cond_t=zero_cond_t)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = rel(out, ref)
    if dtype == torch.float32:
        assert err < FP32_TOL, err
    else:
        # And no less accurate than DiffSynth in bf16, both against the same weights and inputs in fp32.
        truth = reference(_dit_bf16_in_fp32(), **upcast(x), zero_cond_t=zero_cond_t)
        assert err < BF16_TOL, err
        assert rel(out, truth) < 1.1 * rel(ref, truth), (rel(out, truth), rel(ref, truth))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_real_and_complex_equal_diffsynth(dtype):
    """The compiled path's real rotation, the eager path's complex one and DiffSynth's agree."""
    import diffsynth.models.qwen_image_dit as qdit

    dit = _dit(torch.float32)
    cos, sin = rope_tables(dit, [(1, 6, 7), (1, 4, 4)], 11, torch.device("cpu"))
    x = torch.randn(2, cos.shape[0], 3, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
    expect = qdit.apply_rotary_emb_qwen(x.transpose(1, 2), torch.complex(cos, sin)).transpose(1, 2)
    real, cplx = rope_real(x, cos, sin), rope_complex(x, cos, sin)
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: at most one rounding step apart
    assert real.dtype == cplx.dtype == dtype
    assert (real.float() - expect.float()).abs().max() <= tol * expect.float().abs().max()
    assert (cplx.float() - expect.float()).abs().max() <= tol * expect.float().abs().max()


def _two_prompts(dtype, lengths=(9, 13)):
    a = make_inputs(dtype, text_tokens=lengths[0], seed=3)
    b = make_inputs(dtype, text_tokens=lengths[1], seed=4)
    return a, b


@pytest.mark.parametrize("zero_cond_t", [False, True], ids=["t", "zero_cond_t"])
@pytest.mark.parametrize("text_padding", ["split", "mask"])
def test_batch2_different_lengths_matches_two_calls(text_padding, zero_cond_t):
    dit = _dit(torch.float32)
    a, b = _two_prompts(torch.float32)
    shared = {k: a[k] for k in ("latents", "timestep", "height", "width", "edit_latents")}
    expect = [reference(dit, **shared, prompt_emb=p["prompt_emb"], prompt_emb_mask=p["prompt_emb_mask"],
                        zero_cond_t=zero_cond_t) for p in (a, b)]
    text = batch_prompts([a, b])
    assert text["prompt_emb"].shape == (2, 13, TEXT_DIM) and text["txt_seq_lens"] == (9, 13)
    out = fast_model_fn(dit, **{**shared, "latents": shared["latents"].expand(2, -1, -1, -1)}, **text,
                        zero_cond_t=zero_cond_t, text_padding=text_padding)
    assert out.shape == (2, *expect[0].shape[1:])
    for i in range(2):
        assert rel(out[i : i + 1], expect[i]) < FP32_TOL, (i, rel(out[i : i + 1], expect[i]))


def test_batch2_bf16_and_per_sample_timesteps():
    """bf16, lengths read from the mask (no txt_seq_lens), a timestep per sample, batched reference latents."""
    dit = _dit(torch.bfloat16)
    a, b = _two_prompts(torch.bfloat16, lengths=(13, 6))
    text = batch_prompts([a, b])
    text.pop("txt_seq_lens")
    steps = torch.tensor([500.0, 250.0]).to(torch.bfloat16)
    latents = torch.cat([a["latents"], b["latents"]])
    refs = [torch.cat([a["edit_latents"][0], b["edit_latents"][0]])]
    out = fast_model_fn(dit, latents=latents, timestep=steps, edit_latents=refs, height=a["height"],
                        width=a["width"], **text)
    for i, p in enumerate((a, b)):
        expect = reference(dit, latents=p["latents"], timestep=steps[i : i + 1], edit_latents=p["edit_latents"],
                           height=p["height"], width=p["width"], prompt_emb=p["prompt_emb"],
                           prompt_emb_mask=p["prompt_emb_mask"])
        assert rel(out[i : i + 1], expect) < BF16_TOL


def test_batch1_padded_prompt_equals_unpadded():
    """A right-padded batch-1 prompt gives what DiffSynth gives for the prompt without the padding."""
    dit = _dit(torch.float32)
    x = make_inputs()
    padded = torch.nn.functional.pad(x["prompt_emb"], (0, 0, 0, 5), value=3.0)
    mask = torch.cat([x["prompt_emb_mask"], torch.zeros(1, 5, dtype=torch.long)], dim=1)
    out = fast_model_fn(dit, **{**x, "prompt_emb": padded, "prompt_emb_mask": mask})
    assert rel(out, reference(dit, **x)) < FP32_TOL


def test_fuse_qkv_keeps_the_function():
    dit = dit_copy()
    x = make_inputs()
    a, b = _two_prompts(torch.float32)
    text = batch_prompts([a, b])
    x2 = {**x, **text, "latents": x["latents"].expand(2, -1, -1, -1)}
    before = (fast_model_fn(dit, **x, zero_cond_t=True), fast_model_fn(dit, **x2))
    assert fuse_qkv(dit) == 2 * len(dit.transformer_blocks)
    assert fuse_qkv(dit) == 0
    attn = dit.transformer_blocks[0].attn
    assert not hasattr(attn, "to_q") and not hasattr(attn, "add_v_proj")
    assert attn.to_qkv.weight.shape == (3 * 64, 64) and attn.add_qkv_proj.bias.shape == (3 * 64,)
    after = (fast_model_fn(dit, **x, zero_cond_t=True), fast_model_fn(dit, **x2))
    for one, two in zip(before, after, strict=True):
        assert rel(two, one) < FP32_TOL
    assert rel(after[0], reference(_dit(torch.float32), **x, zero_cond_t=True)) < FP32_TOL


def test_fuse_qkv_refuses_fp8_layers():
    dit = dit_copy()
    quantize_linears(dit, Fp8Config(backend="weight_only"))
    with pytest.raises(TypeError, match=r"fuse before fp8\.quantize_linears"):
        fuse_qkv(dit)


FUSED_PRESET = LayerPreset(
    name="attn+mlp (fused qkv)",
    description="the default preset plus the fused Q/K/V layers",
    compute=(QWEN_ATTN, FUSED_QKV_PATTERN, QWEN_MLP),
    storage=(QWEN_MOD,),
    keep=QWEN_KEEP,
)


def test_fused_layers_convert_with_the_fused_pattern():
    dit = dit_copy()
    x = make_inputs()
    bf = fast_model_fn(dit, **x)
    fuse_qkv(dit)
    report = quantize_linears(dit, Fp8Config(backend="weight_only", preset=FUSED_PRESET))
    converted = {d.name for d in report.converted}
    for i in range(len(dit.transformer_blocks)):
        assert {f"transformer_blocks.{i}.attn.to_qkv", f"transformer_blocks.{i}.attn.add_qkv_proj"} <= converted
        assert isinstance(dit.transformer_blocks[i].attn.to_qkv, WeightOnlyLinear)
    assert rel(fast_model_fn(dit, **x), bf) < 0.1  # fp8 weight rounding only


def test_default_preset_covers_fused_layers():
    """Reports (skips) until fp8/presets.py's QWEN_ATTN also matches FUSED_QKV_PATTERN's names."""
    dit = dit_copy()
    fuse_qkv(dit)
    report = quantize_linears(dit, Fp8Config(backend="weight_only"))
    kept = {d.name: d.reason for d in report.skipped if d.name.endswith(("to_qkv", "add_qkv_proj"))}
    if kept:
        pytest.skip(f"default preset does not select the fused layers yet ({next(iter(kept.values()))}); "
                    f"add {FUSED_QKV_PATTERN!r} to fp8.presets.QWEN_ATTN")
    assert isinstance(dit.transformer_blocks[0].attn.to_qkv, WeightOnlyLinear)


def test_text_lengths_read_once_per_mask(monkeypatch):
    """The prepared model reads a mask's lengths once; another prepared model keeps its own."""
    calls = []
    original = fast_text._lengths_from_mask
    monkeypatch.setattr(fast_text, "_lengths_from_mask", lambda m: calls.append(1) or original(m))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    prepared = PreparedDit(torch.nn.Module())
    assert prepared.text_lengths(mask) == (3, 4)
    assert prepared.text_lengths(mask) == (3, 4)
    assert len(calls) == 1
    assert PreparedDit(torch.nn.Module()).text_lengths(mask) == (3, 4)
    assert len(calls) == 2
    assert text_lengths(mask) == (3, 4)
    with pytest.raises(ValueError, match="right-padded"):
        text_lengths(torch.tensor([[0, 1, 1, 1]]))


def test_rejects_what_it_does_not_support():
    dit = _dit(torch.float32)
    x = make_inputs()
    with pytest.raises(NotImplementedError, match="entity_prompt_emb"):
        fast_model_fn(dit, **x, entity_prompt_emb=[x["prompt_emb"]])
    with pytest.raises(ValueError, match="text_padding='mask' needs an SDPA backend"):
        fast_model_fn(dit, **x, attention_backend="triton_fp8", text_padding="mask")
    with pytest.raises(ValueError, match="do not match"):
        fast_model_fn(dit, **{**x, "height": 64})
    # Arguments that do not change the result are accepted, as model_fn_qwen_image accepts them.
    fast_model_fn(dit, **x, progress_id=3, num_inference_steps=40, use_gradient_checkpointing=False)


@pytest.mark.parametrize("backend", ["sdpa", "cudnn_fp8_emulated"])
@pytest.mark.parametrize("zero_cond_t", [False, True], ids=["t", "zero_cond_t"])
def test_last_block_computes_only_the_target_tokens(backend, zero_cond_t):
    """After its attention the last block runs the output projection on the target tokens only (not the reference
    tokens) and skips the text stream; every other block runs whole; the output is what the whole block gives.
    ``ForwardOptions.trim_last_block`` chooses (the shipped options trim)."""
    dit = _dit(torch.bfloat16)
    x = make_inputs(torch.bfloat16)  # 8 x 8 = 64 target tokens, 6 x 6 = 36 reference tokens
    seen: list[tuple[int, str, int]] = []
    hooks = [layer.register_forward_pre_hook(lambda m, args, i=i, name=name: seen.append((i, name, args[0].shape[1])))
             for i, block in enumerate(dit.transformer_blocks)
             for name, layer in (("image", block.attn.to_out[0]), ("text", block.attn.to_add_out))]
    outputs = {}
    try:
        for trim in (False, True):
            seen.clear()
            options = dataclasses.replace(SHIPPED, trim_last_block=trim)
            outputs[trim] = fast_model_fn(dit, **x, zero_cond_t=zero_cond_t, attention_backend=backend,
                                          options=options)
            outputs[trim, "rows"] = list(seen)
    finally:
        for hook in hooks:
            hook.remove()
    last = len(dit.transformer_blocks) - 1
    whole = [(i, name, 100 if name == "image" else 13) for i in range(last + 1) for name in ("image", "text")]
    assert outputs[False, "rows"] == whole
    assert outputs[True, "rows"] == [row for row in whole if row[0] < last] + [(last, "image", 64)]
    assert rel(outputs[True], outputs[False]) < 1e-3, rel(outputs[True], outputs[False])
