"""quantize_linears and numerics_report on a 2-block Qwen-Image DiT (DiffSynth blocks, dim 64, 2 heads x 32)."""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.fp8 import (
    Fp8Config,
    Fp8ShapeError,
    Fp8UnavailableError,
    LayerPreset,
    ScaledMMLinear,
    WeightOnlyLinear,
    dequantize_module,
    numerics_report,
    plan_linears,
    quantize_linears,
)
from qwen_edit_hopper.fp8.quant import FP8_DTYPE, relative_error
from test_fp8_tiny_dit import build_tiny_dit, qwen_linear_names, tiny_inputs
from torch import nn

EMULATED = Fp8Config(backend="scaled_mm_rowwise", emulate=True)


def _forward(model):
    with torch.no_grad():
        return model(*tiny_inputs())


def test_default_preset_is_applied_exactly():
    model = build_tiny_dit()
    report = quantize_linears(model, EMULATED)
    expected = qwen_linear_names()
    modules = dict(model.named_modules())
    for name in expected["compute"]:
        assert isinstance(modules[name], ScaledMMLinear) and modules[name].granularity == "rowwise", name
    for name in expected["storage"]:
        assert type(modules[name]) is WeightOnlyLinear, name
    for name in expected["kept"]:
        assert type(modules[name]) is nn.Linear, name

    assert report.counts == {"fp8 compute": 24, "fp8 storage": 4, "kept": 6}
    assert [d.name for d in report.converted] == [d.name for d in report.decisions if d.action != "kept"]
    reasons = {d.name: d.reason for d in report.skipped}
    assert reasons == {
        "img_in": "input embedding kept bf16",
        "txt_in": "input embedding kept bf16",
        "time_text_embed.timestep_embedder.linear_1": "timestep embedding kept bf16",
        "time_text_embed.timestep_embedder.linear_2": "timestep embedding kept bf16",
        "norm_out.linear": "final norm kept bf16",
        "proj_out": "output projection kept bf16",
    }
    mod = next(d for d in report.decisions if d.name == "transformer_blocks.1.txt_mod.1")
    assert (mod.action, mod.backend, mod.in_features, mod.out_features) == ("fp8 storage", "weight_only", 64, 384)
    assert report.bytes_after < report.bytes_before

    text = report.to_text()
    assert text.splitlines()[0].startswith("fp8 scaled_mm_rowwise (emulated), preset attn+mlp, storage layers fp8: "
                                           "24 fp8 compute, 4 fp8 storage, 6 kept")
    assert "transformer_blocks.N.attn.to_q x2" in text
    assert "note: emulated rowwise fp8: fp32 dequantize-and-matmul reference" in text
    assert "fp8 storage transformer_blocks.N.img_mod.1 x2: fp8 storage, bf16 compute (preset attn+mlp)" in text
    assert "| fp8 storage | `transformer_blocks.N.img_mod.1` | 2 |" in report.to_markdown()


def test_state_dict_holds_float8_weights_and_converted_model_runs():
    model = build_tiny_dit()
    reference = _forward(model)
    quantize_linears(model, EMULATED)
    sd = model.state_dict()
    expected = qwen_linear_names()
    for name in expected["compute"] + expected["storage"]:
        assert sd[f"{name}.weight"].dtype == FP8_DTYPE, name
        assert sd[f"{name}.weight_scale"].dtype == torch.float32
        assert sd[f"{name}.bias"].dtype == torch.bfloat16
    for name in expected["kept"]:
        assert sd[f"{name}.weight"].dtype == torch.bfloat16
    out = _forward(model)
    assert out.shape == reference.shape and torch.isfinite(out.float()).all()
    assert 0 < relative_error(out, reference) < 0.1

    fresh = build_tiny_dit(seed=5)
    quantize_linears(fresh, EMULATED)
    fresh.load_state_dict(sd)
    assert torch.equal(_forward(fresh), out)


def test_storage_layers_bf16_keeps_modulation_untouched():
    model = build_tiny_dit()
    report = quantize_linears(model, Fp8Config(backend="scaled_mm_rowwise", emulate=True, storage_layers="bf16"))
    assert report.counts == {"fp8 compute": 24, "fp8 storage": 0, "kept": 10}
    assert type(model.transformer_blocks[0].img_mod[1]) is nn.Linear
    assert "storage_layers='bf16'" in next(d.reason for d in report.decisions if d.name.endswith("img_mod.1"))


@pytest.mark.parametrize(
    ("preset", "counts"),
    [
        ("attn+mlp+mod compute", {"fp8 compute": 28, "fp8 storage": 0, "kept": 6}),
        ("mlp only", {"fp8 compute": 8, "fp8 storage": 4, "kept": 22}),
        ("all linears in blocks", {"fp8 compute": 28, "fp8 storage": 0, "kept": 6}),
    ],
)
def test_other_presets(preset, counts):
    plan = plan_linears(build_tiny_dit(), Fp8Config(backend="scaled_mm_rowwise", emulate=True, preset=preset))
    got = {a: sum(d.action == a for d in plan) for a in ("fp8 compute", "fp8 storage", "kept")}
    assert got == counts


def test_layer_filter_replaces_the_compute_selection():
    model = build_tiny_dit()
    def pick(module, name):
        return name.endswith("attn.to_q") or name == "img_in"

    report = quantize_linears(model, EMULATED, layer_filter=pick)
    assert report.counts == {"fp8 compute": 3, "fp8 storage": 4, "kept": 27}
    assert isinstance(model.img_in, ScaledMMLinear)  # the filter may select what the preset keeps
    assert next(d.reason for d in report.decisions if d.name.endswith("attn.to_k")) == "not selected by layer_filter"


def test_weight_only_backend_stores_every_selected_layer():
    model = build_tiny_dit()
    report = quantize_linears(model, Fp8Config(backend="weight_only"))
    assert report.counts == {"fp8 compute": 0, "fp8 storage": 28, "kept": 6}
    assert "weight_only: fp8 storage, bf16 compute (saves memory, not time)" in report.notes
    assert relative_error(_forward(model), _forward(build_tiny_dit())) < 0.1


@pytest.mark.parametrize("backend", ["te", "scaled_mm_rowwise", "scaled_mm_tensorwise"])
def test_backends_that_cannot_run_here_raise_with_the_reason_and_change_nothing(backend):
    model = build_tiny_dit()
    with pytest.raises(Fp8UnavailableError, match=r"needs a CUDA GPU with compute capability >= 8\.9"):
        quantize_linears(model, Fp8Config(backend=backend))
    assert not any(isinstance(m, (ScaledMMLinear, WeightOnlyLinear)) for m in model.modules())


class _OddModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.good = nn.Linear(64, 32)
        self.odd = nn.Linear(24, 32)  # K = 24 is not a multiple of 16
        self.shared = nn.Linear(32, 32)
        self.alias = self.shared  # one Linear under two names


EVERYTHING = LayerPreset("everything", "all linears", compute=(r".+",))


def test_unconvertible_shapes_are_skipped_with_the_layer_name_or_raise_when_forced():
    model = _OddModel()
    report = quantize_linears(model, Fp8Config(backend="scaled_mm_rowwise", emulate=True, preset=EVERYTHING))
    odd = next(d for d in report.decisions if d.name == "odd")
    assert odd.action == "kept" and odd.reason.startswith("K=24 not divisible by 16")
    assert type(model.odd) is nn.Linear and isinstance(model.good, ScaledMMLinear)
    assert model.alias is model.shared and isinstance(model.shared, ScaledMMLinear)  # replaced under both names

    forced = Fp8Config(backend="scaled_mm_rowwise", emulate=True, preset=EVERYTHING, force=True)
    with pytest.raises(Fp8ShapeError, match=r"^odd: K=24 not divisible by 16"):
        quantize_linears(_OddModel(), forced)
    # weight-only has no shape constraint
    assert quantize_linears(_OddModel(), Fp8Config(backend="weight_only", preset=EVERYTHING)).counts["kept"] == 0


def test_dequantize_helpers_and_second_pass():
    model = build_tiny_dit()
    original = model.transformer_blocks[0].attn.to_q.weight.detach().clone()
    quantize_linears(model, EMULATED)
    assert relative_error(dequantize_module(model.transformer_blocks[0].attn.to_q, torch.float32), original) < 0.05
    again = quantize_linears(model, EMULATED)  # converting twice changes nothing and says why
    assert again.counts == {"fp8 compute": 0, "fp8 storage": 0, "kept": 34}
    assert any(d.reason == "already fp8 (ScaledMMLinear)" for d in again.decisions)


def test_numerics_report_on_the_tiny_dit():
    model = build_tiny_dit()
    report = numerics_report(model, EMULATED, lambda: model(*tiny_inputs()))
    assert len(report.rows) == 28
    assert {r.action for r in report.rows} == {"fp8 compute", "fp8 storage"}
    assert all(0 < r.rel_error < 0.08 for r in report.rows), report.worst()
    assert all(r.calls == 1 and r.tokens in (1, 7, 16) for r in report.rows)
    assert 0 < report.forward_rel_error < 0.1
    assert report.conversion.counts["fp8 compute"] == 24
    assert isinstance(model.transformer_blocks[1].attn.to_v, ScaledMMLinear)  # converted in place
    md = report.to_markdown()
    assert md.splitlines()[0].startswith("whole forward rel. error ")
    assert "| layer | action | backend | rel. error | tokens | calls |" in md
    assert "`transformer_blocks.0.attn.to_q` | fp8 compute | scaled_mm_rowwise |" in md
    assert report.worst(1)[0].rel_error == max(r.rel_error for r in report.rows)


def test_a_block_converted_alone_under_its_prefix_matches_the_whole_models_scope():
    """``prefix``: a block walked alone takes the decisions the whole model takes for it, under the model's names,
    and converts the same layers (the DiT build quantizes each block this way)."""
    whole, alone = build_tiny_dit(), build_tiny_dit()
    by_scope = quantize_linears(whole, EMULATED, scope=lambda name: name.startswith("transformer_blocks.1."))
    by_prefix = quantize_linears(alone.transformer_blocks[1], EMULATED, prefix="transformer_blocks.1.")
    assert by_prefix.decisions == by_scope.decisions and by_prefix.counts["fp8 compute"] > 0
    assert plan_linears(build_tiny_dit().transformer_blocks[1], EMULATED, prefix="transformer_blocks.1.") == \
        by_scope.decisions
    no_dot = build_tiny_dit()  # the prefix's trailing dot is optional
    assert quantize_linears(no_dot.transformer_blocks[1], EMULATED, prefix="transformer_blocks.1").decisions == \
        by_scope.decisions
    assert {n: type(m) for n, m in whole.named_modules()} == {n: type(m) for n, m in alone.named_modules()}
    assert type(alone.transformer_blocks[0].attn.to_q) is nn.Linear  # outside the block: untouched
