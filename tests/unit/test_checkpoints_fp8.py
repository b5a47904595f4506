"""fp8_scaled checkpoints dequantize as ComfyUI reads them, and match the bf16 file within fp8 tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from qwen_edit_hopper.qwen_edit.checkpoints import CheckpointError, load_text_encoder, resolve_single_files
from qwen_edit_hopper.qwen_edit.checkpoints.scaled_fp8 import dequantize
from qwen_edit_hopper.qwen_edit.tiny import FP8_MAX
from test_checkpoints_support import comfy, tiny

SOURCE = Path("qwen_2.5_vl_7b_fp8_scaled.safetensors")


def _quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = weight.abs().amax() / FP8_MAX
    return (weight / scale).to(torch.float8_e4m3fn), scale.reshape(())


def test_per_tensor_scale_and_marker():
    weight = torch.randn(6, 5)
    w8, scale = _quantize(weight)
    out = dequantize(
        {
            "l.weight": w8,
            "l.scale_weight": scale,
            "l.scale_input": torch.tensor(1.0),
            "l.bias": torch.ones(6),
            "scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn),
        },
        dtype=torch.float32,
        source=SOURCE,
    )
    assert set(out) == {"l.weight", "l.bias"}
    torch.testing.assert_close(out["l.weight"], w8.float() * scale)
    assert out["l.bias"].dtype == torch.float32


def test_weight_scale_spelling_and_per_row_scales():
    weight = torch.randn(4, 3)
    scale = weight.abs().amax(dim=1) / FP8_MAX
    w8 = (weight / scale[:, None]).to(torch.float8_e4m3fn)
    out = dequantize({"l.weight": w8, "l.weight_scale": scale[:, None]}, dtype=torch.bfloat16, source=SOURCE)
    assert out["l.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(out["l.weight"], (w8.float() * scale[:, None]).to(torch.bfloat16))


def test_unscaled_fp8_is_upcast_with_unit_scale():
    w8 = torch.randn(3, 3).to(torch.float8_e4m3fn)
    out = dequantize({"l.weight": w8}, dtype=torch.float32, source=SOURCE)
    torch.testing.assert_close(out["l.weight"], w8.float())


def test_orphan_scale_and_bad_scale_shape_are_errors():
    with pytest.raises(CheckpointError, match="fp8 scales without weights"):
        dequantize({"l.scale_weight": torch.tensor(1.0)}, dtype=torch.float32, source=SOURCE)
    w8 = torch.randn(4, 4).to(torch.float8_e4m3fn)
    with pytest.raises(CheckpointError, match="only per-tensor and per-row fp8 scales"):
        dequantize({"l.weight": w8, "l.scale_weight": torch.ones(3)}, dtype=torch.float32, source=SOURCE)


def test_dequantization_matches_comfyui_scaled_fp8_linear():
    """ComfyUI's own scaled_fp8 Linear loads our key names and computes with the same weight."""
    c = comfy()
    layer = c.ops.scaled_fp8_ops(override_dtype=torch.float8_e4m3fn).Linear(8, 4, bias=False)
    w8, scale = _quantize(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))
    layer.load_state_dict({"weight": w8, "scale_weight": scale}, strict=True)
    ours = dequantize({"weight": w8, "scale_weight": scale}, dtype=torch.float32, source=SOURCE)["weight"]
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, ours))


def test_fp8_scaled_file_matches_bf16_file_within_fp8_tolerance(tmp_path_factory):
    """The fp8_scaled text encoder keeps its linears in fp8 as stored (weight-only layers); their dequantized weights
    are the bf16 file's within e4m3's rounding, and every other tensor is the bf16 file's exactly."""
    from qwen_edit_hopper.fp8.linear import WeightOnlyLinear

    files = tiny("comfy_single", "edit_2509", tmp_path_factory)
    bf16 = resolve_single_files(files["dit"][0], files["text_encoder"][0], files["vae"][0])
    fp8 = resolve_single_files(files["dit"][0], files["text_encoder_fp8"], files["vae"][0])
    reference = load_text_encoder(bf16, device="cpu")
    stored = load_text_encoder(fp8, device="cpu")
    kept = {name: layer for name, layer in stored.named_modules() if isinstance(layer, WeightOnlyLinear)}
    reference_state = reference.state_dict()
    stored_state = {k: v for k, v in stored.state_dict().items() if not k.endswith(".weight_scale")}
    assert set(reference_state) == set(stored_state)
    for key, expected in reference_state.items():
        owner = key.rpartition(".")[0]
        if key.endswith(".weight") and owner in kept:
            layer = kept[owner]
            assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.ndim == 0, key
            got = layer.dequantize_weight(torch.bfloat16)
            scale = expected.float().abs().amax() / FP8_MAX
            # e4m3: 3 mantissa bits (relative step 2^-3, rounding 2^-4); subnormal step 2^-9 * scale; then bf16.
            error = (got.float() - expected.float()).abs()
            bound = expected.float().abs() * (2**-4 + 2**-8) + scale * 2**-9
            assert bool((error <= bound).all()), f"{key}: worst excess {(error - bound).max().item()}"
            assert not torch.equal(got, expected), f"{key} was expected to go through fp8"
        else:
            got = stored_state[key]
            assert got.dtype == expected.dtype and torch.equal(got, expected), f"{key} must be stored unquantized"
    assert len(kept) == 2 * 7 + 2 * 5 + 2  # language layers, vision blocks, merger
