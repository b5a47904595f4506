"""LoRA layouts parse onto the tiny Qwen-Image DiT and fuse to W + strength * scale * B @ A."""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.qwen_edit.lora import (
    LoraMatchError,
    TargetIndex,
    fused_state,
    load_lora,
    parse_lora,
)
from qwen_edit_hopper.qwen_edit.lora.testing import (
    FORMATS,
    assert_fused_close,
    base_weights,
    reference_fused,
    tiny_target_shapes,
    write_tiny_lora,
)
from safetensors.torch import load_file, save_file

SHAPES = tiny_target_shapes(num_layers=2)
BASE = base_weights(SHAPES)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("alpha", [None, 2.0])
def test_each_format_parses_and_fuses(tmp_path, fmt, alpha):
    path = tmp_path / f"{fmt}.safetensors"
    delta = write_tiny_lora(path, fmt, SHAPES, rank=4, alpha=alpha, seed=1)
    lora = load_lora(path, SHAPES)
    assert lora.targets == tuple(sorted(delta))
    assert not lora.report.partial, lora.report.summary()
    assert len(lora.report.matched_keys) == lora.report.total_keys
    for patch in lora.patches:
        torch.testing.assert_close(patch.delta(), delta[patch.target], rtol=1e-5, atol=1e-6)
    fused = fused_state(BASE, [(lora, 0.8)])
    assert_fused_close(fused, reference_fused(BASE, [(delta, 0.8)]))
    changed = sum(int((fused[n] != BASE[n]).sum()) for n in fused)
    assert changed > 0.5 * sum(t.numel() for t in fused.values())


@pytest.mark.parametrize("fmt", ["peft", "kohya", "lightning", "loha", "lokr"])
def test_alpha_over_rank_is_the_scale(tmp_path, fmt):
    d1 = write_tiny_lora(tmp_path / "a.safetensors", fmt, SHAPES, rank=4, alpha=None, seed=3, layers=[0])
    d2 = write_tiny_lora(tmp_path / "b.safetensors", fmt, SHAPES, rank=4, alpha=1.0, seed=3, layers=[0])
    plain, scaled = load_lora(tmp_path / "a.safetensors", SHAPES), load_lora(tmp_path / "b.safetensors", SHAPES)
    for p1, p2 in zip(plain.patches, scaled.patches, strict=True):
        assert p1.scale == 1.0 and p2.scale == pytest.approx(0.25)
        torch.testing.assert_close(p2.delta(), 0.25 * p1.delta())
        torch.testing.assert_close(p2.delta(), d2[p2.target], rtol=1e-5, atol=1e-6)
    assert sorted(d1) == sorted(d2)


def test_format_labels_and_layers(tmp_path):
    write_tiny_lora(tmp_path / "k.safetensors", "kohya", SHAPES, layers=[1])
    lora = load_lora(tmp_path / "k.safetensors", SHAPES)
    assert lora.report.formats == ("kohya",)
    assert all(t.startswith("transformer_blocks.1.") for t in lora.targets)
    assert len(lora.targets) == 14  # 8 attention, 4 MLP, img_mod.1, txt_mod.1


def _lr(up_out, rank, inp, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(up_out, rank, generator=g) * 0.2).to(torch.bfloat16), (
        torch.randn(rank, inp, generator=g) * 0.2
    ).to(torch.bfloat16)


@pytest.mark.parametrize(
    "prefix",
    [
        "",
        "transformer.",
        "diffusion_model.",
        "model.diffusion_model.",
        "base_model.model.",
        "base_model.model.transformer.",
    ],
)
@pytest.mark.parametrize(
    "suffixes",
    [
        ("lora_A.weight", "lora_B.weight"),
        ("lora_A.default.weight", "lora_B.default.weight"),
        ("lora_down.weight", "lora_up.weight"),
    ],
)
def test_prefixes_and_spellings(prefix, suffixes):
    up, down = _lr(16, 4, 16)
    m = "transformer_blocks.1.attn.to_out.0"
    sd = {f"{prefix}{m}.{suffixes[0]}": down, f"{prefix}{m}.{suffixes[1]}": up, f"{prefix}{m}.alpha": torch.tensor(2.0)}
    lora = parse_lora(sd, SHAPES, source="mem.safetensors")
    assert lora.targets == (f"{m}.weight",)
    (patch,) = lora.patches
    assert patch.scale == 0.5
    torch.testing.assert_close(patch.delta(), 0.5 * up.float() @ down.float())


def test_lightning_layout_with_diff_and_diff_b():
    """Dotted lora_down/up + alpha (lightx2v) next to full .diff / .diff_b deltas."""
    m = "transformer_blocks.0.img_mlp.net.2"
    up, down = _lr(16, 8, 64)
    bias_delta = torch.full((16,), 0.25, dtype=torch.bfloat16)
    norm_delta = torch.full((8,), -0.5, dtype=torch.bfloat16)
    sd = {
        f"{m}.lora_down.weight": down,
        f"{m}.lora_up.weight": up,
        f"{m}.alpha": torch.tensor(8.0, dtype=torch.bfloat16),
        f"{m}.diff_b": bias_delta,
        "transformer_blocks.0.attn.norm_q.diff": norm_delta,
    }
    lora = parse_lora(sd, SHAPES, source="Qwen-Image-Lightning-8steps-V1.1.safetensors")
    assert lora.targets == ("transformer_blocks.0.attn.norm_q.weight", f"{m}.bias", f"{m}.weight")
    assert set(lora.report.formats) == {"lora_down/up", "diff"}
    fused = fused_state(BASE, [(lora, 1.0)])
    ref = reference_fused(
        BASE,
        [
            (
                {
                    f"{m}.weight": up.double() @ down.double(),
                    f"{m}.bias": bias_delta.double(),
                    "transformer_blocks.0.attn.norm_q.weight": norm_delta.double(),
                },
                1.0,
            )
        ],
    )
    assert_fused_close(fused, ref)
    assert lora.lightning == (
        8,
        "file name 'Qwen-Image-Lightning-8steps-V1.1.safetensors' names a Lightning 8-step LoRA",
    )


def test_peft_lora_b_bias_is_scaled_like_the_weight():
    m = "txt_in"
    up, down = _lr(16, 4, 24)
    bias = torch.linspace(-1, 1, 16)
    sd = {
        f"transformer.{m}.lora_A.weight": down,
        f"transformer.{m}.lora_B.weight": up,
        f"transformer.{m}.lora_B.bias": bias,
        f"transformer.{m}.alpha": torch.tensor(1.0),
    }
    lora = parse_lora(sd, SHAPES)
    by_target = {p.target: p for p in lora.patches}
    torch.testing.assert_close(by_target[f"{m}.bias"].delta(), 0.25 * bias)


def test_kohya_conv_shaped_1x1_factors_are_squeezed():
    up, down = _lr(16, 4, 8)
    k = "lora_unet_img_in"
    sd = {f"{k}.lora_up.weight": up[:, :, None, None], f"{k}.lora_down.weight": down[:, :, None, None]}
    (patch,) = parse_lora(sd, SHAPES).patches
    torch.testing.assert_close(patch.delta(), up.float() @ down.float())


def test_partial_match_is_reported(tmp_path):
    path = tmp_path / "mixed.safetensors"
    write_tiny_lora(path, "peft", SHAPES, layers=[0])
    sd = load_file(path)
    sd["text_encoder.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 8)
    sd["text_encoder.layers.0.self_attn.q_proj.lora_B.weight"] = torch.zeros(8, 4)
    sd["transformer_blocks.7.attn.to_q.lora_A.weight"] = torch.zeros(4, 16)  # layer the tiny model lacks
    sd["transformer_blocks.7.attn.to_q.lora_B.weight"] = torch.zeros(16, 4)
    sd["some_counter"] = torch.tensor(3)
    save_file(sd, tmp_path / "partial.safetensors")
    lora = load_lora(tmp_path / "partial.safetensors", SHAPES)
    rep = lora.report
    assert rep.partial and len(rep.unmatched) == 5
    assert len(rep.matched_keys) == rep.total_keys - 5
    assert "some_counter" in rep.unmatched_keys
    text = rep.summary()
    assert "partial.safetensors" in text and "unmatched 5 keys" in text
    assert len(rep.targets) == 14


def test_dora_and_cp_modules_are_skipped_with_reason():
    up, down = _lr(16, 4, 16)
    sd = {
        "transformer_blocks.0.attn.to_q.lora_A.weight": down,
        "transformer_blocks.0.attn.to_q.lora_B.weight": up,
        "transformer_blocks.0.attn.to_k.lora_A.weight": down,
        "transformer_blocks.0.attn.to_k.lora_B.weight": up,
        "transformer_blocks.0.attn.to_k.dora_scale": torch.ones(16, 1),
    }
    lora = parse_lora(sd, SHAPES, source="dora.safetensors")
    assert lora.targets == ("transformer_blocks.0.attn.to_q.weight",)
    assert lora.report.skipped[0][0] == "transformer_blocks.0.attn.to_k"
    assert "DoRA" in lora.report.skipped[0][1]
    only_dora = {k: v for k, v in sd.items() if ".to_k." in k}
    with pytest.raises(LoraMatchError, match=r"dora\.safetensors.*DoRA"):
        parse_lora(only_dora, SHAPES, source="dora.safetensors")


def test_target_index_can_be_reused():
    index = TargetIndex(SHAPES)
    up, down = _lr(96, 4, 16)
    sd = {
        "lora_unet_transformer_blocks_0_img_mod_1.lora_up.weight": up,
        "lora_unet_transformer_blocks_0_img_mod_1.lora_down.weight": down,
    }
    assert parse_lora(sd, index).targets == ("transformer_blocks.0.img_mod.1.weight",)
