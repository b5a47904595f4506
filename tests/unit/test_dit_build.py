"""The DiT built group by group from its files (qwen_edit/dit_build.py) is the whole-file loader's model.

bf16 from every layout (diffusers shards, Comfy-Org bf16, Comfy-Org fp8_e4m3fn), fp8 built per block equal to the
fp8 conversion of the whole bf16 model, LoRAs fused before quantization, LoRA changes written in place from the
file, the size estimate from headers, and an interrupt between groups.
"""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.fp8 import Fp8Config
from qwen_edit_hopper.qwen_edit.checkpoints import load_dit, resolve_diffusers_folder, resolve_single_files
from qwen_edit_hopper.qwen_edit.dit_build import DitSource, build_dit, estimate_bytes, lora_targets, refresh_weights
from qwen_edit_hopper.qwen_edit.fp8_dit import build_fp8_dit
from qwen_edit_hopper.qwen_edit.lora import fused_state, load_lora
from qwen_edit_hopper.qwen_edit.lora.testing import write_tiny_lora
from qwen_edit_hopper.qwen_edit.memory import module_bytes
from test_checkpoints_support import tiny

ROWWISE = Fp8Config(backend="scaled_mm_rowwise", preset="attn+mlp+mod compute", emulate=True)


def _files(layout: str, tmp_path_factory):
    if layout == "diffusers":
        return resolve_diffusers_folder(tiny("diffusers", "edit_2509", tmp_path_factory)["root"])
    files = tiny("comfy_single", "edit_2509", tmp_path_factory)
    dit = files["dit"][0] if layout == "comfy_bf16" else files["dit_fp8"]
    return resolve_single_files(dit, files["text_encoder"][0], files["vae"][0])


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for key in sa:
        x, y = sa[key], sb[key]
        if x.dtype == torch.float8_e4m3fn:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert x.dtype == y.dtype and torch.equal(x, y), key


@pytest.mark.parametrize("layout", ["diffusers", "comfy_bf16", "comfy_fp8"])
def test_bf16_build_equals_the_whole_file_loader(layout, tmp_path_factory):
    files = _files(layout, tmp_path_factory)
    built = build_dit(DitSource(files), device="cpu", dtype=torch.bfloat16)
    assert built.fp8_report is None
    _same_state(built.module, load_dit(files, device="cpu", dtype=torch.bfloat16))


@pytest.mark.parametrize("layout", ["comfy_bf16", "comfy_fp8"])
def test_fp8_build_equals_converting_the_whole_bf16_model(layout, tmp_path_factory):
    files = _files(layout, tmp_path_factory)
    built = build_dit(DitSource(files), device="cpu", dtype=torch.bfloat16, fp8_config=ROWWISE)
    reference = build_fp8_dit(load_dit(files, device="cpu", dtype=torch.bfloat16), ROWWISE)
    _same_state(built.module, reference)
    assert built.fp8_report.counts == reference.fp8_report.counts
    assert built.module.fused_qkv_layers == reference.fused_qkv_layers > 0
    assert sorted(d.name for d in built.fp8_report.decisions) == sorted(d.name for d in reference.fp8_report.decisions)


def _lora(tmp_path, source: DitSource, name: str, seed: int, layers=None):
    path = tmp_path / name
    write_tiny_lora(path, "lightning", source.shapes, rank=4, alpha=4.0, seed=seed, std=0.05, layers=layers)
    return load_lora(path, source.shapes)


def test_lora_is_fused_before_quantization_and_changes_are_written_in_place(tmp_path, tmp_path_factory):
    files = _files("comfy_bf16", tmp_path_factory)
    source = DitSource(files)
    first = [(_lora(tmp_path, source, "a.safetensors", 1), 0.7)]
    second = [(_lora(tmp_path, source, "b.safetensors", 2, layers=[1]), 1.3)]

    def reference(chain):
        base = load_dit(files, device="cpu", dtype=torch.bfloat16)
        params = dict(base.named_parameters())
        with torch.no_grad():
            for name, value in fused_state(params, chain).items():
                params[name].copy_(value)
        return build_fp8_dit(base, ROWWISE)

    built = build_dit(source, device="cpu", dtype=torch.bfloat16, loras=first, fp8_config=ROWWISE).module
    _same_state(built, reference(first))
    tensors = {id(t) for t in [*built.parameters(), *built.buffers()]}

    names = lora_targets(first) | lora_targets(second)
    assert refresh_weights(built, source, names, second, device="cpu", dtype=torch.bfloat16)
    _same_state(built, reference(second))
    assert refresh_weights(built, source, lora_targets(second), [], device="cpu", dtype=torch.bfloat16)
    _same_state(built, reference([]))
    assert {id(t) for t in [*built.parameters(), *built.buffers()]} == tensors  # same tensors: graphs stay valid


def test_estimate_from_headers_matches_the_built_model(tmp_path_factory):
    source = DitSource(_files("comfy_bf16", tmp_path_factory))
    for config in (None, ROWWISE, Fp8Config(backend="weight_only")):
        built = build_dit(source, device="cpu", dtype=torch.bfloat16, fp8_config=config).module
        actual = module_bytes(built) - sum(t.numel() * t.element_size() for t in built.pos_embed.buffers())
        assert abs(estimate_bytes(source, config) - actual) <= 0.02 * actual, config


def test_an_interrupt_between_groups_stops_the_build(tmp_path_factory):
    source = DitSource(_files("comfy_bf16", tmp_path_factory))
    calls = []

    def interrupt():
        calls.append(1)
        if len(calls) == 2:
            raise InterruptedError("stop")

    with pytest.raises(InterruptedError):
        build_dit(source, device="cpu", dtype=torch.bfloat16, fp8_config=ROWWISE, check_interrupt=interrupt)
    assert len(calls) == 2
