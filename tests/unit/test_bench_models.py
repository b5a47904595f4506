"""Random full-architecture models for the benchmark, at tiny size on CPU: init, materialization,
and the ComfyUI <-> DiffSynth weight mapping (verified by comparing outputs in float32)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import harness_core as core
import harness_models as hm
from test_checkpoints_support import COMFYUI_DIR


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(400, 300)
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(400, 600))
        self.norm = nn.LayerNorm(300)
        self.conv = nn.Conv2d(8, 16, 3)


def test_randomize_scales_by_fan_in_and_sets_norms_and_biases():
    toy = _Toy()
    hm.randomize_(toy, seed=3)
    assert toy.proj.weight.std().item() == pytest.approx(1 / math.sqrt(400), rel=0.03)
    assert toy.img_mod[1].weight.std().item() == pytest.approx(0.1 / math.sqrt(400), rel=0.03)
    assert toy.conv.weight.std().item() == pytest.approx(1 / math.sqrt(8 * 9), rel=0.05)
    assert torch.equal(toy.norm.weight, torch.ones(300)) and torch.equal(toy.proj.bias, torch.zeros(300))
    again = _Toy()
    hm.randomize_(again, seed=3)
    assert torch.equal(again.proj.weight, toy.proj.weight)
    hm.randomize_(again, seed=4)
    assert not torch.equal(again.proj.weight, toy.proj.weight)


def test_randomize_refuses_meta():
    with torch.device("meta"):
        toy = _Toy()
    with pytest.raises(ValueError, match="meta"):
        hm.randomize_(toy)


def test_materialize_text_encoder_keeps_rotary_tables_and_casts_weights():
    from qwen_edit_hopper.qwen_edit.checkpoints.text_encoder import create_text_encoder

    config = hm.configs("tiny")[1]
    reference = {n: b.clone() for n, b in create_text_encoder(config).named_buffers()}
    model = hm.build_text_encoder("tiny", "cpu", torch.bfloat16)
    assert reference and all(torch.equal(dict(model.named_buffers())[n], b) for n, b in reference.items())
    assert all(b.dtype == torch.float32 for b in model.buffers())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters())


def test_materialized_dit_and_vae_run_and_give_finite_outputs():
    dit = hm.build_dit("tiny", "cpu", torch.float32)
    inputs = hm.ForwardInputs.make(64, 64, 8, dit.dit_config.text_dim, "cpu", torch.float32)
    out = hm.diffsynth_forward(dit, inputs)
    assert out.shape == (1, 16, 8, 8) and torch.isfinite(out).all() and out.std() > 0
    assert torch.isfinite(hm.diffsynth_cfg_step(dit, inputs)).all()
    vae = hm.build_vae("tiny", "cpu", torch.float32)
    image = vae.decode(out.to(torch.float32))
    assert torch.isfinite(image).all() and image.shape[-2:] == (64, 64)


def test_structure_copy_shares_tensors_but_not_modules():
    toy = _Toy()
    copy = hm.structure_copy(toy)
    assert copy.proj.weight is toy.proj.weight and copy.proj is not toy.proj
    copy.proj = nn.Identity()
    assert isinstance(toy.proj, nn.Linear)


def _comfy():
    if not (COMFYUI_DIR / "comfy").is_dir():
        pytest.skip(f"ComfyUI not found at {COMFYUI_DIR}")
    import os

    os.environ["COMFY_DIR"] = str(COMFYUI_DIR)
    return hm.import_comfy("cpu")


def _tanh_gelu(dit):
    """DiffSynth's MLP activation (x * sigmoid(1.702 x)) replaced by ComfyUI's tanh-GELU, in place."""
    for block in dit.transformer_blocks:
        for mlp in (block.img_mlp, block.txt_mlp):
            proj = mlp.net[0].proj
            mlp.net[0] = nn.Sequential(proj, nn.GELU(approximate="tanh"))


def test_comfy_key_map_is_checked_identity():
    comfy = _comfy()
    dit = hm.build_dit("tiny", "cpu", torch.float32)
    with torch.device("meta"):
        model = comfy.model_cls(**hm.comfy_model_kwargs(dit.dit_config), operations=comfy.ops.disable_weight_init)
    ds = {k: tuple(v.shape) for k, v in dit.state_dict().items()}
    cf = {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()}
    mapping = hm.comfy_key_map(ds, cf)
    assert mapping and all(k == v for k, v in mapping.items())
    renamed = {k.replace("img_mlp", "image_mlp"): v for k, v in cf.items()}
    with pytest.raises(ValueError, match="only ComfyUI"):
        hm.comfy_key_map(ds, renamed)
    ds["proj_out.weight"] = (1, 1)
    with pytest.raises(ValueError, match="shape mismatches"):
        hm.comfy_key_map(ds, cf)


def test_comfy_model_on_the_same_weights_matches_diffsynth_block_in_fp32():
    """One block (num_layers=1) in float32: with ComfyUI's tanh-GELU swapped into DiffSynth's MLP, ComfyUI's model
    on the mapped (shared) tensors computes the same function; the GELU approximation is the only difference."""
    comfy = _comfy()
    from dataclasses import replace

    from qwen_edit_hopper.qwen_edit.checkpoints.dit import create_dit

    config = replace(hm.configs("tiny")[0], num_layers=1)
    dit = hm.materialize_random(create_dit(config), "cpu", torch.float32, seed=5)
    with torch.no_grad():  # biases and norm weights away from 0 / 1, so the mapping of each is exercised
        for name, p in dit.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    model = hm.build_comfy_model(dit, comfy, comfy.ops.disable_weight_init, dtype=torch.float32)
    shared = model.transformer_blocks[0].attn.to_q.weight
    assert shared.data_ptr() == dit.transformer_blocks[0].attn.to_q.weight.data_ptr()
    inputs = hm.ForwardInputs.make(96, 64, 7, config.text_dim, "cpu", torch.float32, seed=9)
    comfy_out = hm.comfy_forward(model, inputs)
    approx_gelu = hm.diffsynth_forward(dit, inputs)
    _tanh_gelu(dit)
    same_gelu = hm.diffsynth_forward(dit, inputs)
    assert core.relative_error(comfy_out, same_gelu) < 1e-5
    assert 1e-5 < core.relative_error(comfy_out, approx_gelu) < 5e-2


def test_comfy_fp8_cast_leaves_the_shared_bf16_weights_alone():
    comfy = _comfy()
    dit = hm.build_dit("tiny", "cpu", torch.bfloat16)
    before = dit.transformer_blocks[0].img_mlp.net[2].weight.clone()
    model = hm.build_comfy_model(dit, comfy, comfy.ops.fp8_ops)
    count = hm.to_comfy_fp8(model, comfy)
    assert count == dit.dit_config.num_layers * 14  # 6 q/k/v, 2 out, 2 mod, 4 mlp per block
    assert model.transformer_blocks[0].img_mlp.net[2].weight.dtype == torch.float8_e4m3fn
    assert dit.transformer_blocks[0].img_mlp.net[2].weight.dtype == torch.bfloat16
    assert torch.equal(dit.transformer_blocks[0].img_mlp.net[2].weight, before)
    assert model.img_in.weight.dtype == torch.bfloat16


def test_fast_forward_calls_match_diffsynth_when_available():
    import harness_forward

    ff, reason = harness_forward.load_fast_forward()
    if ff is None:
        pytest.skip(reason)
    dit = hm.build_dit("tiny", "cpu", torch.float32)
    inputs = hm.ForwardInputs.make(64, 64, 8, dit.dit_config.text_dim, "cpu", torch.float32, negative_tokens=5)
    assert core.relative_error(hm.fast_forward(ff, dit, inputs), hm.diffsynth_forward(dit, inputs)) < 1e-5
    cfg = hm.fast_cfg_step(ff, dit, inputs)
    assert core.relative_error(cfg, hm.diffsynth_cfg_step(dit, inputs)) < 1e-5
