"""Whole-forward CUDA graphs (qwen_edit/fast/graphs.py) and their switch, on CPU.

Capture and replay need a GPU (tests/gpu/test_graphs_and_modulation_gpu.py compares them with kernel-by-kernel
forwards, batch 1 and 2, new inputs, moved weights). Here: the switch (Compile Model's choice, held by the model's
``PreparedDit``), that a CPU forward ignores it, and the weight-address check that drops stale graphs.
"""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.qwen_edit.compile import set_regional_compile
from qwen_edit_hopper.qwen_edit.fast import graphs
from qwen_edit_hopper.qwen_edit.fast.prepared import PreparedDit
from qwen_edit_hopper.qwen_edit.fast_forward import fast_model_fn
from qwen_edit_hopper.qwen_edit.memory import Resident
from qwen_edit_hopper.qwen_edit.plan import CompileChoice
from test_fast_forward import build_dit, make_inputs, rel


@pytest.fixture
def dit():
    return build_dit(torch.float32, layers=2)


def test_compile_choice_says_why_graphs_are_off_on_the_cpu(dit):
    resident = Resident(key=("test",), module=dit, nbytes=0, label="test", prepared=PreparedDit(dit))
    set_regional_compile(resident, CompileChoice(cuda_graphs=True))
    assert resident.prepared.graphs is None and resident.prepared.compiled is not None
    assert resident.extra["cuda_graphs"] == "off: the model is on cpu, CUDA graphs need a CUDA device"
    set_regional_compile(resident, CompileChoice())
    assert resident.extra["cuda_graphs"] == "off"
    set_regional_compile(resident, None)
    assert "cuda_graphs" not in resident.extra and resident.prepared.graphs is None
    assert resident.prepared.compiled is None
    assert CompileChoice(cuda_graphs=True).describe() == "default, CUDA graphs"
    with pytest.raises(ValueError, match="max_graphs"):
        PreparedDit(dit).enable_cuda_graphs(max_graphs=0)


def test_a_cpu_forward_runs_kernel_by_kernel_with_graphs_on(dit):
    x = make_inputs()
    plain = fast_model_fn(dit, **x)
    prepared = PreparedDit(dit)
    state = prepared.enable_cuda_graphs()
    out = fast_model_fn(prepared, **x)
    assert state.captures == 0 and state.replays == 0 and len(state) == 0
    assert rel(out, plain) == 0.0


def test_weight_address_check_sees_new_storage_not_in_place_values(dit):
    state = graphs.ForwardGraphs(dit)
    assert state._weights_moved(dit)  # first look: nothing recorded yet
    assert not state._weights_moved(dit)
    block = dit.transformer_blocks[0]
    block.img_mlp.net[2].weight.data = block.img_mlp.net[2].weight.data.clone()  # new storage, same Parameter
    assert state._weights_moved(dit)
    assert not state._weights_moved(dit)
    with torch.no_grad():
        block.img_mlp.net[2].weight.mul_(2)  # in place: graphs stay valid (they read the new values)
    assert not state._weights_moved(dit)


def test_a_module_built_elsewhere_does_not_drop_the_graphs(dit):
    """Only this model's tensors are looked at: new modules elsewhere (a text encoder, a VAE, a LoRA's layers) change
    nothing, and no process-wide hook sees them."""
    state = graphs.ForwardGraphs(dit)
    state._weights_moved(dit)
    torch.nn.Linear(4, 4)
    assert not state._weights_moved(dit)


def test_static_buffers_take_any_strides():
    base = torch.randn(1, 4, 3)
    expanded = base.expand(2, -1, -1)
    static = graphs._static_copy([expanded, None])
    assert static[0].is_contiguous() and torch.equal(static[0], expanded) and static[1] is None
    graphs._copy_into(static, [expanded * 2, None])
    assert torch.equal(static[0], expanded * 2)
    assert graphs._signature([expanded]) == (("tensor", (2, 4, 3), torch.float32, torch.device("cpu")),)
