"""The text stream's row-wise fp8 Q/K/V as one layer (``qwen_edit.fast.qkv.fuse_fp8_qkv``), as the pack's fp8
variants build it (``qwen_edit.fp8_dit.build_fp8_dit``), and LoRA updates re-quantized into its rows.

The tiny DiT of ``test_fast_forward`` (lively weights), converted with the emulated row-wise backend (the same
layers and scales as on a GPU, the GEMM in float32), so every test runs on CPU.
"""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.fp8 import Fp8Config, ScaledMMLinear
from qwen_edit_hopper.qwen_edit.fast import qkv
from qwen_edit_hopper.qwen_edit.fast_forward import batch_prompts, fast_model_fn
from qwen_edit_hopper.qwen_edit.fp8_dit import build_fp8_dit, write_weights
from test_fast_forward import _two_prompts, build_dit, make_inputs, rel

ROWWISE = Fp8Config(backend="scaled_mm_rowwise", preset="attn+mlp+mod compute", emulate=True, fast_accum=True)


def forward(dit, batch: int) -> torch.Tensor:
    if batch == 1:
        return fast_model_fn(dit, **make_inputs(torch.bfloat16))
    a, b = _two_prompts(torch.bfloat16)
    shared = {k: a[k] for k in ("latents", "timestep", "height", "width", "edit_latents")}
    return fast_model_fn(dit, **{**shared, "latents": shared["latents"].expand(2, -1, -1, -1)},
                         **batch_prompts([a, b]))


@pytest.fixture(scope="module")
def base() -> torch.nn.Module:
    return build_dit(torch.bfloat16)


def test_variants_fuse_the_text_stream_only_and_compute_the_same(base):
    fused = build_fp8_dit(base, ROWWISE)
    plain = build_fp8_dit(base, ROWWISE, fused_qkv=())
    assert fused.fused_qkv_layers == len(fused.transformer_blocks) and plain.fused_qkv_layers == 0
    for block in fused.transformer_blocks:
        attn = block.attn
        assert isinstance(attn.add_qkv_proj, ScaledMMLinear) and attn.add_qkv_proj.out_features == 3 * 64
        assert not any(hasattr(attn, name) for name in ("add_q_proj", "add_k_proj", "add_v_proj"))
        assert isinstance(attn.to_q, ScaledMMLinear) and not hasattr(attn, "to_qkv")  # image stream: three
    for batch in (1, 2):
        with torch.no_grad():
            got, want = forward(fused, batch), forward(plain, batch)
        # the fused layer's rows hold the three layers' fp8 weights and scales: each column computed alike
        assert rel(got, want) < 1e-6, batch


def test_a_lora_update_of_a_fused_projection_lands_in_its_rows(base):
    base = build_dit(torch.bfloat16)  # changed below: not the shared fixture
    fused = build_fp8_dit(base, ROWWISE)
    before = forward(fused, 1)
    changed = {"transformer_blocks.1.attn.add_k_proj.weight", "transformer_blocks.1.attn.add_k_proj.bias",
               "transformer_blocks.0.attn.add_v_proj.bias", "transformer_blocks.0.img_mlp.net.2.weight"}
    params = dict(base.named_parameters())
    with torch.no_grad():
        for name in changed:
            params[name].add_(torch.randn_like(params[name]) * 0.2)
    write_weights(fused, {name: params[name] for name in changed})
    fresh = build_fp8_dit(base, ROWWISE)
    for block_f, block_n in zip(fused.transformer_blocks, fresh.transformer_blocks, strict=True):
        for attr in ("weight", "weight_scale", "bias"):
            a, b = getattr(block_f.attn.add_qkv_proj, attr), getattr(block_n.attn.add_qkv_proj, attr)
            assert torch.equal(a.view(torch.uint8) if a.dtype == b.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), attr
    with torch.no_grad():
        after = forward(fused, 1)
        assert rel(after, forward(fresh, 1)) < 1e-6
    assert rel(after, before) > 1e-3, "the update did not reach the output"


def test_the_fused_text_layer_runs_as_the_three_did(base, monkeypatch):
    """A model with the text stream's Q/K/V fused runs one GEMM of 3 x 64 rows per block where a model without runs
    three, and both give the same output."""
    fused, three = build_fp8_dit(base, ROWWISE), build_fp8_dit(base, ROWWISE, fused_qkv=())
    assert hasattr(fused.transformer_blocks[0].attn, "add_qkv_proj")
    assert hasattr(three.transformer_blocks[0].attn, "add_q_proj")
    calls = []
    real = ScaledMMLinear.gemm
    monkeypatch.setattr(ScaledMMLinear, "gemm",
                        lambda self, *a, **k: calls.append(self.out_features) or real(self, *a, **k))
    with torch.no_grad():
        fused_out = forward(fused, 1)
        fused_calls, calls[:] = list(calls), []
        three_out = forward(three, 1)
    assert fused_calls.count(3 * 64) == 2 and calls.count(3 * 64) == 0
    assert rel(fused_out, three_out) < 1e-6


@pytest.mark.parametrize("config", [
    Fp8Config(backend="scaled_mm_tensorwise", preset="attn+mlp+mod compute", emulate=True),
    Fp8Config(backend="scaled_mm_rowwise", preset="mlp only", emulate=True),
], ids=["tensorwise", "attention-bf16"])
def test_layers_that_cannot_share_scales_stay_three(base, config):
    variant = build_fp8_dit(base, config)
    assert variant.fused_qkv_layers == 0
    attn = variant.transformer_blocks[0].attn
    assert hasattr(attn, "add_q_proj") and not hasattr(attn, "add_qkv_proj")


def test_fused_rows_names_the_rows_of_each_projection(base):
    fused = build_fp8_dit(base, ROWWISE)
    layer, rows = qkv.fused_rows(fused, "transformer_blocks.1.attn.add_v_proj")
    assert layer is fused.transformer_blocks[1].attn.add_qkv_proj and rows == slice(128, 192)
    assert qkv.fused_rows(fused, "transformer_blocks.1.attn.to_q") is None  # image stream: not fused
    assert qkv.fused_rows(fused, "transformer_blocks.1.img_mlp.net.0.proj") is None


@pytest.mark.parametrize("streams", [("text", "audio"), "text"], ids=["unknown", "a bare string"])
def test_unknown_streams_are_refused_before_anything_changes(base, streams):
    variant = build_fp8_dit(base, ROWWISE, fused_qkv=())
    with pytest.raises(ValueError, match="streams must be a tuple of 'image', 'text'"):
        qkv.fuse_fp8_qkv(variant, streams)
    assert hasattr(variant.transformer_blocks[0].attn, "add_q_proj")
    assert not hasattr(variant.transformer_blocks[0].attn, "add_qkv_proj")


def test_the_plan_says_how_many_blocks_will_be_fused(base):
    from qwen_edit_hopper.fp8 import plan_linears

    blocks = len(base.transformer_blocks)
    assert qkv.fused_in_plan(plan_linears(base, ROWWISE), ROWWISE.backend) == blocks
    assert build_fp8_dit(base, ROWWISE).fused_qkv_layers == blocks  # what the plan announced
    attention_bf16 = Fp8Config(backend="scaled_mm_rowwise", preset="mlp only", emulate=True)
    assert qkv.fused_in_plan(plan_linears(base, attention_bf16), attention_bf16.backend) == 0
    tensorwise = Fp8Config(backend="scaled_mm_tensorwise", preset="attn+mlp+mod compute", emulate=True)
    assert qkv.fused_in_plan(plan_linears(base, tensorwise), tensorwise.backend) == 0
