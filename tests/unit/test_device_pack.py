"""A built group's tensors moved into one allocation (qwen_edit/device_pack.py): values, parameters and sharing kept,
and the DiT build packs every block it keeps on its device."""

from __future__ import annotations

import torch
from qwen_edit_hopper.fp8 import Fp8Config, module_bytes, quantize_linears
from qwen_edit_hopper.qwen_edit.checkpoints import resolve_single_files
from qwen_edit_hopper.qwen_edit.device_pack import pack_tensors
from qwen_edit_hopper.qwen_edit.dit_build import DitSource, build_dit
from test_checkpoints_support import tiny
from torch import nn

ROWWISE = Fp8Config(backend="scaled_mm_rowwise", preset="attn+mlp+mod compute", emulate=True)


def _storages(module: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}


def test_packed_tensors_keep_values_parameters_and_forward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.LayerNorm(48), nn.Linear(48, 16, bias=False)).to(torch.bfloat16)
    model.register_buffer("table", torch.arange(5, dtype=torch.int64))
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    expected = model(x)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    parameters = list(model.parameters())

    nbytes = pack_tensors(model, "cpu")

    assert len(_storages(model)) == 1
    assert nbytes >= sum(t.numel() * t.element_size() for t in before.values())
    assert list(model.parameters()) == parameters and all(isinstance(p, nn.Parameter) for p in model.parameters())
    for name, t in model.state_dict().items():
        assert t.dtype == before[name].dtype and t.shape == before[name].shape and torch.equal(t, before[name]), name
        assert (t.data_ptr() - t.untyped_storage().data_ptr()) % 256 == 0, name
    assert torch.equal(model(x), expected)


def test_fp8_layers_pack_and_count_their_own_bytes():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32)).to(torch.bfloat16)
    quantize_linears(model, ROWWISE)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    expected, counted = model(x), module_bytes(model)
    pack_tensors(model, "cpu")
    assert len(_storages(model)) == 1
    assert module_bytes(model) == counted  # views of one buffer count their own bytes, not the buffer's
    assert torch.equal(model(x), expected)


def test_shared_tensors_and_other_devices_are_left_alone():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[1].weight = model[0].weight  # tied
    model[1].register_buffer("elsewhere", torch.zeros(3, device="meta"))
    tied = model[0].weight.data_ptr()
    pack_tensors(model, "cpu")
    assert model[0].weight is model[1].weight and model[0].weight.data_ptr() == tied
    assert model[1].elsewhere.device.type == "meta"
    assert model[0].bias.untyped_storage().data_ptr() == model[1].bias.untyped_storage().data_ptr()
    assert pack_tensors(nn.Sequential(nn.Linear(2, 2).to("meta")), "cpu") == 0


def test_the_build_keeps_each_block_and_the_rest_in_one_allocation(tmp_path_factory):
    files = tiny("comfy_single", "edit_2509", tmp_path_factory)
    source = DitSource(resolve_single_files(files["dit_fp8"], files["text_encoder"][0], files["vae"][0]))
    model = build_dit(source, device="cpu", dtype=torch.bfloat16, fp8_config=ROWWISE).module
    blocks = list(model.transformer_blocks)
    assert all(len(_storages(block)) == 1 for block in blocks)
    assert len(set.union(*map(_storages, blocks))) == len(blocks)
    rest = {t.untyped_storage().data_ptr() for name, t in [*model.named_parameters(), *model.named_buffers()]
            if not name.startswith(("transformer_blocks.", "pos_embed."))}
    assert len(rest) == 1
