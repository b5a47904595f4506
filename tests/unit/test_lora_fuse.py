"""Fusion: strengths, chains, base never written, exact restore after many changes."""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.qwen_edit.lora import (
    LoraError,
    LoraPatcher,
    fused_state,
    load_lora,
    shapes_of,
    swap_weights,
)
from qwen_edit_hopper.qwen_edit.lora.testing import (
    assert_fused_close,
    base_weights,
    reference_fused,
    tiny_target_shapes,
    write_tiny_lora,
)
from torch import nn

SHAPES = tiny_target_shapes(num_layers=2)


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    """Three LoRAs of different layouts over overlapping targets, with their dense deltas."""
    d = tmp_path_factory.mktemp("loras")
    out = {}
    for name, fmt, kwargs in (
        ("style", "kohya", {"alpha": 2.0, "seed": 1}),
        ("lightning", "lightning", {"alpha": 8.0, "rank": 16, "seed": 2, "layers": [0, 1]}),
        ("detail", "loha", {"alpha": 1.0, "seed": 3, "layers": [1]}),
    ):
        path = d / f"{name}.safetensors"
        delta = write_tiny_lora(path, fmt, SHAPES, **kwargs)
        out[name] = (load_lora(path, SHAPES), delta)
    return out


def module_from(state: dict[str, torch.Tensor]) -> nn.Module:
    """A plain module tree whose named_parameters() are exactly ``state`` (no copy)."""
    root = nn.Module()
    for name, t in state.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(t, requires_grad=False))
    return root


@pytest.mark.parametrize("strength", [1.0, -1.0, 0.35, -2.5])
def test_strengths_including_negative(loras, strength):
    base = base_weights(SHAPES)
    lora, delta = loras["style"]
    assert_fused_close(fused_state(base, [(lora, strength)]), reference_fused(base, [(delta, strength)]))


def test_fuse_on_another_device_argument(loras):
    base = base_weights(SHAPES)
    lora, delta = loras["style"]
    fused = fused_state(base, [(lora, 1.0)], device="cpu")
    assert_fused_close(fused, reference_fused(base, [(delta, 1.0)]))
    meta = fused_state(base, [(loras["detail"][0], 1.0)], device="meta")
    assert all(t.device.type == "meta" for t in meta.values())


def test_zero_strength_touches_nothing(loras):
    base = base_weights(SHAPES)
    assert fused_state(base, [(loras["style"][0], 0.0)]) == {}


def test_two_and_three_loras_chained(loras):
    base = base_weights(SHAPES)
    chain = [("style", 0.7), ("lightning", 1.0), ("detail", -0.4)]
    fused = fused_state(base, [(loras[n][0], s) for n, s in chain])
    assert_fused_close(fused, reference_fused(base, [(loras[n][1], s) for n, s in chain]))
    again = fused_state(base, [(loras[n][0], s) for n, s in chain])
    assert all(torch.equal(fused[k], again[k]) for k in fused)  # fixed order -> bit-identical
    reordered = fused_state(base, [(loras[n][0], s) for n, s in reversed(chain)])
    assert_fused_close(reordered, reference_fused(base, [(loras[n][1], s) for n, s in chain]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_base_tensors_are_never_written(loras, dtype):
    base = base_weights(SHAPES, dtype=dtype)
    snapshot = {k: v.clone() for k, v in base.items()}
    fused = fused_state(base, [(loras["style"][0], 1.0), (loras["detail"][0], 2.0)])
    assert all(torch.equal(base[k], snapshot[k]) for k in base)
    assert all(fused[k].data_ptr() != base[k].data_ptr() for k in fused)
    assert all(fused[k].dtype == dtype for k in fused)
    assert set(fused) == set(loras["style"][0].targets) | set(loras["detail"][0].targets)


def test_patcher_restores_bit_for_bit_after_50_cycles(loras):
    base = base_weights(SHAPES)
    module = module_from({k: v.clone() for k, v in base.items()})
    pristine = {n: p.detach().clone() for n, p in module.named_parameters()}
    ptrs = {n: p.data_ptr() for n, p in module.named_parameters()}
    patcher = LoraPatcher(module)
    configs = [
        [("style", 1.0)],
        [("style", -0.5), ("lightning", 1.0)],
        [("lightning", 1.0), ("detail", 0.8)],
        [],
        [("detail", -1.3)],
    ]
    first_result: dict[int, dict[str, torch.Tensor]] = {}
    for cycle in range(50):
        i = cycle % len(configs)
        names = patcher.apply([(loras[n][0], s) for n, s in configs[i]])
        current = {n: p.detach().clone() for n, p in module.named_parameters() if n in names}
        if i in first_result:  # the same chain gives the same weights, whatever came before
            assert current.keys() == first_result[i].keys()
            assert all(torch.equal(current[n], first_result[i][n]) for n in current)
        else:
            first_result[i] = current
            refs = reference_fused(base, [(loras[n][1], s) for n, s in configs[i]])
            assert_fused_close(current, refs)
        if cycle % 3 == 0:
            patcher.clear()
            assert all(torch.equal(p, pristine[n]) for n, p in module.named_parameters())
    patcher.clear()
    assert patcher.fused_names == ()
    for n, p in module.named_parameters():
        assert torch.equal(p, pristine[n]) and p.data_ptr() == ptrs[n]


def test_patcher_under_inference_mode(loras):
    module = module_from(base_weights(SHAPES))
    pristine = {n: p.detach().clone() for n, p in module.named_parameters()}
    params = dict(module.named_parameters())
    with torch.inference_mode():
        patcher = LoraPatcher(module)
        patcher.apply([(loras["style"][0], 1.0)])
        assert not torch.equal(params["txt_in.weight"], pristine["txt_in.weight"])
        patcher.clear()
    assert all(torch.equal(p, pristine[n]) for n, p in module.named_parameters())
    assert all(p is params[n] for n, p in module.named_parameters())  # same Parameter objects


def test_real_diffsynth_block_names():
    """Fusion into DiffSynth's own transformer block (tiny sizes) through shapes_of()."""
    qwen_dit = pytest.importorskip("diffsynth.models.qwen_image_dit")
    torch.manual_seed(0)
    dit = nn.Module()
    dit.transformer_blocks = nn.ModuleList([qwen_dit.QwenImageTransformerBlock(16, 2, 8) for _ in range(2)])
    dit = dit.to(torch.bfloat16)
    shapes = shapes_of(dit)
    assert shapes == {k: v for k, v in SHAPES.items() if k.startswith("transformer_blocks.")}
    assert len(shapes) > 0
    from tempfile import TemporaryDirectory

    with TemporaryDirectory() as d:
        delta = write_tiny_lora(f"{d}/k.safetensors", "kohya", shapes, alpha=4.0)
        lora = load_lora(f"{d}/k.safetensors", shapes)
    base = {n: p.detach().clone() for n, p in dit.named_parameters()}
    patcher = LoraPatcher(dit)
    patcher.apply([(lora, 1.0)])
    assert_fused_close(
        {n: p.detach() for n, p in dit.named_parameters() if n in delta}, reference_fused(base, [(delta, 1.0)])
    )
    patcher.clear()
    assert all(torch.equal(p, base[n]) for n, p in dit.named_parameters())


def test_fp8_base_is_refused(loras):
    base = base_weights(SHAPES)
    lora = loras["style"][0]
    target = lora.targets[0]
    base[target] = base[target].to(torch.float8_e4m3fn)
    with pytest.raises(LoraError, match="before fp8 quantization"):
        fused_state(base, [(lora, 1.0)])


def test_missing_or_misshaped_target_is_an_error(loras):
    lora = loras["style"][0]
    base = base_weights(SHAPES)
    target = lora.targets[0]
    del base[target]
    with pytest.raises(LoraError, match=rf"style\.safetensors.*{target}.*not among the base weights"):
        fused_state(base, [(lora, 1.0)])
    base = base_weights(tiny_target_shapes(num_layers=2, dim=32))
    with pytest.raises(LoraError, match="has shape"):
        fused_state(base, [(lora, 1.0)])


def test_non_finite_strength_is_an_error(loras):
    with pytest.raises(LoraError, match="finite"):
        fused_state(base_weights(SHAPES), [(loras["style"][0], float("nan"))])


def test_swap_checks_shape_and_patcher_detects_moved_module(loras):
    module = module_from(base_weights(SHAPES))
    with pytest.raises(LoraError, match=r"cannot swap txt_in\.weight"):
        swap_weights(module, {"txt_in.weight": torch.zeros(3, 3, dtype=torch.bfloat16)})
    with pytest.raises(LoraError, match="no parameter"):
        swap_weights(module, {"nope.weight": torch.zeros(3)})
    patcher = LoraPatcher(module)
    module.to(torch.float32)
    with pytest.raises(LoraError, match="replaced since this LoraPatcher was created"):
        patcher.apply([(loras["style"][0], 1.0)])
