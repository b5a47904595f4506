"""Whole-forward CUDA graphs (qwen_edit/fast/graphs.py) and their switch, on CPU.

Capture and replay need a GPU (tests/gpu/test_graphs_and_modulation_gpu.py compares them with kernel-by-kernel
forwards, batch 1 and 2, new inputs, moved weights). Here: the switch (Compile Model's choice, the registry),
that a CPU forward ignores it, and the weight-address check that drops stale graphs.
"""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.qwen_edit.compile import set_regional_compile
from qwen_edit_hopper.qwen_edit.fast import graphs
from qwen_edit_hopper.qwen_edit.fast_forward import fast_model_fn
from qwen_edit_hopper.qwen_edit.memory import Resident
from qwen_edit_hopper.qwen_edit.plan import CompileChoice
from test_fast_forward import build_dit, make_inputs, rel


@pytest.fixture
def dit():
    return build_dit(torch.float32, layers=2)


def test_compile_choice_switches_graphs_on_and_off(dit):
    resident = Resident(key=("test",), module=dit, nbytes=0, label="test")
    set_regional_compile(resident, CompileChoice(cuda_graphs=True))
    assert graphs.cuda_graphs_enabled(dit)
    set_regional_compile(resident, CompileChoice())
    assert not graphs.cuda_graphs_enabled(dit)
    set_regional_compile(resident, CompileChoice(cuda_graphs=True))
    set_regional_compile(resident, None)
    assert not graphs.cuda_graphs_enabled(dit)
    assert CompileChoice(cuda_graphs=True).describe() == "default, CUDA graphs"
    with pytest.raises(ValueError, match="max_graphs"):
        graphs.enable_cuda_graphs(dit, max_graphs=0)


def test_a_cpu_forward_runs_kernel_by_kernel_with_graphs_on(dit):
    x = make_inputs()
    plain = fast_model_fn(dit, **x)
    state = graphs.enable_cuda_graphs(dit)
    try:
        out = fast_model_fn(dit, **x)
    finally:
        graphs.disable_cuda_graphs(dit)
    assert state.captures == 0 and state.replays == 0 and len(state) == 0
    assert rel(out, plain) == 0.0


def test_weight_address_check_sees_new_storage_and_new_tensors(dit):
    state = graphs.enable_cuda_graphs(dit)
    try:
        assert state._weights_moved(dit)  # first look: nothing recorded yet
        assert not state._weights_moved(dit)
        block = dit.transformer_blocks[0]
        block.img_mlp.net[2].weight.data = block.img_mlp.net[2].weight.data.clone()  # new storage, same Parameter
        assert state._weights_moved(dit)
        assert not state._weights_moved(dit)
        with torch.no_grad():
            block.img_mlp.net[2].weight.mul_(2)  # in place: graphs stay valid (they read the new values)
        assert not state._weights_moved(dit)
        block.img_mlp.net[2] = torch.nn.Linear(block.img_mlp.net[2].in_features,
                                               block.img_mlp.net[2].out_features)  # fmt: skip
        assert state._weights_moved(dit)  # a replaced module: caught by the registration hooks
    finally:
        graphs.disable_cuda_graphs(dit)


def test_a_module_built_elsewhere_does_not_drop_the_graphs(dit):
    """The registration hooks are process-wide: any new module (a text encoder, a VAE, a LoRA's layers, Inductor's
    helpers) bumps the generation. Only a change in this model's tensors may count as moved."""
    state = graphs.enable_cuda_graphs(dit)
    try:
        state._weights_moved(dit)
        assert not state._weights_moved(dit)
        torch.nn.Linear(4, 4)  # unrelated: registers two parameters on a module that is not dit
        assert not state._weights_moved(dit)
        dit.transformer_blocks[0].register_buffer("extra", torch.zeros(2))  # a new tensor in dit itself
        assert state._weights_moved(dit)
        assert not state._weights_moved(dit)
        # a layer replaced by another that holds the very same tensors: nothing moved, but the code that runs did
        old = dit.transformer_blocks[0].img_mlp.net[2]
        new = torch.nn.Linear(old.in_features, old.out_features)
        new.weight, new.bias = old.weight, old.bias
        dit.transformer_blocks[0].img_mlp.net[2] = new
        assert state._weights_moved(dit)
        assert not state._weights_moved(dit)
    finally:
        graphs.disable_cuda_graphs(dit)


def test_static_buffers_take_any_strides():
    base = torch.randn(1, 4, 3)
    expanded = base.expand(2, -1, -1)
    static = graphs._static_copy([expanded, None])
    assert static[0].is_contiguous() and torch.equal(static[0], expanded) and static[1] is None
    graphs._copy_into(static, [expanded * 2, None])
    assert torch.equal(static[0], expanded * 2)
    assert graphs._signature([expanded]) == (("tensor", (2, 4, 3), torch.float32, torch.device("cpu")),)
