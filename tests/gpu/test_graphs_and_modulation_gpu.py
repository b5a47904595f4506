"""Shared-input modulation launches and whole-forward CUDA graphs on a real GPU.

Full-width DiT (dim 3072, 24 heads x 128), 2 blocks, random weights; 512x512 edit with one reference and
prompts of 300 / 287 text tokens (as tests/gpu/test_fast_forward_gpu.py). Run on the device machine::

    python3 -m pytest tests/gpu/test_graphs_and_modulation_gpu.py -m gpu -q -rs

The model's compiled blocks and CUDA graphs are held by its ``PreparedDit``; shared-input modulation is switched
through the forward's options (``ForwardOptions.shared_modulation``).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from qwen_edit_hopper.fp8 import Fp8Config, quantize_linears
from qwen_edit_hopper.fp8.linear import ScaledMMLinear, WeightOnlyLinear
from qwen_edit_hopper.fp8.shared_input_gemv import (
    DOT_CONFIG,
    ONE_ROW_CONFIG,
    SharedInputLinears,
    default_config,
    reference_shared_input,
)
from qwen_edit_hopper.qwen_edit.checkpoints.dit import DiTConfig
from qwen_edit_hopper.qwen_edit.fast.options import SHIPPED
from qwen_edit_hopper.qwen_edit.fast_forward import PreparedDit, batch_prompts, fast_model_fn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_dit import build_random_dit, make_inputs, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WIDE = DiTConfig(dim=3072, num_layers=2, num_heads=24, head_dim=128, text_dim=3584)
FASTEST = Fp8Config(backend="scaled_mm_rowwise", preset="attn+mlp+mod compute", fast_accum=True)


def _layers(kind: str, count: int = 3, k: int = 512, n: int = 384, bias: bool = True):
    g = torch.Generator("cuda").manual_seed(0)
    layers = []
    for i in range(count):
        linear = torch.nn.Linear(k, n, bias=bias, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(n, k, generator=g, device="cuda") * 0.05 * (i + 1))
            if bias:
                linear.bias.copy_(torch.randn(n, generator=g, device="cuda"))
        layers.append(ScaledMMLinear.from_linear(linear, "rowwise") if kind == "scaled_mm"
                      else WeightOnlyLinear.from_linear(linear))  # fmt: skip
    return layers


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("kind", ["scaled_mm", "weight_only"])
def test_shared_input_linears_match_the_layers(kind, rows):
    layers = _layers(kind, bias=rows == 1 or kind == "scaled_mm")
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    group = SharedInputLinears(layers)
    got = group(x)
    assert got.shape == (3, rows, 384) and got.dtype == torch.bfloat16
    with torch.no_grad():
        per_layer = torch.stack([layer(x) for layer in layers])
    assert rel_err(got, reference_shared_input(layers, x)) < 2e-3
    # the layers round the GEMM (and, weight-only, the dequantized weight) to bf16 before the bias
    assert rel_err(got, per_layer) < (4e-3 if kind == "scaled_mm" else 1e-2), rel_err(got, per_layer)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("kind", ["scaled_mm", "weight_only"])
def test_default_kernels_match_the_layers_aligned_or_not(kind, rows):
    # K = 2048: the one-row kernel at one row, the tensor-core kernel at two; N = 1008 leaves the latter a partial
    # last tile in every layer
    layers = _layers(kind, count=5, k=2048, n=1008)
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    group = SharedInputLinears(layers)
    assert default_config(rows, 2048) == (ONE_ROW_CONFIG if rows == 1 else DOT_CONFIG) and group.aligned
    got = group(x)
    assert rel_err(got, reference_shared_input(layers, x)) < 2e-3, rel_err(got, reference_shared_input(layers, x))
    # a weight that is a view one byte into its storage: the kernel runs without the alignment hint (narrow
    # loads; Triton may lay the tile out differently, so the float32 sums may differ in order, not more)
    unaligned = torch.empty(1008 * 2048 + 1, dtype=layers[2].weight.dtype, device="cuda")[1:].view(1008, 2048)
    unaligned.copy_(layers[2].weight)
    layers[2].weight.data = unaligned
    again = group(x)
    assert not group.aligned
    assert rel_err(again, got) < 1e-3, rel_err(again, got)


def test_shared_input_linears_follow_a_replaced_weight():
    layers = _layers("scaled_mm")
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    group = SharedInputLinears(layers)
    before = group(x)
    layers[1].weight.data = (layers[1].weight.float() * 0.5).to(layers[1].weight.dtype)  # new storage
    after = group(x)
    assert torch.equal(after[0], before[0]) and not torch.allclose(after[1], before[1])
    assert rel_err(after, reference_shared_input(layers, x)) < 2e-3


def test_shared_input_linears_refuse_mixed_layers():
    mixed = _layers("scaled_mm", 2) + _layers("weight_only", 1)
    with pytest.raises(ValueError, match="all be row-wise ScaledMMLinear"):
        SharedInputLinears(mixed)


@pytest.fixture(scope="module")
def fp8_model():
    model = build_random_dit(WIDE)
    quantize_linears(model, FASTEST)
    return model


@pytest.fixture(scope="module")
def inputs():
    x = make_inputs(WIDE, size=512)
    prompts = x.pop("prompts")
    return x, prompts


@pytest.mark.parametrize("zero_cond_t", [False, True], ids=["t", "zero_cond_t"])
def test_forward_with_shared_input_modulation_matches_per_block_calls(fp8_model, inputs, zero_cond_t):
    x, prompts = inputs
    prepared = PreparedDit(fp8_model)
    outs = {}
    for fused in (False, True):
        outs[fused] = fast_model_fn(prepared, **x, **prompts[0], zero_cond_t=zero_cond_t, attention_backend="cudnn_fp8",
                                    options=dataclasses.replace(SHIPPED, shared_modulation=fused))
        assert prepared.last_plan.shared_modulation == fused, prepared.last_plan.describe()
    assert rel_err(outs[True], outs[False]) < 1e-2, rel_err(outs[True], outs[False])


def _graph_vs_kernel_by_kernel(prepared, x, prompts):
    """Batch 1, batch 2 with padded text, and new input values: graphed output against kernel-by-kernel."""
    model = prepared.module
    two = {**x, **batch_prompts(prompts), "latents": x["latents"].expand(2, -1, -1, -1)}
    other = {**x, "latents": torch.randn_like(x["latents"])}
    calls = [({**x, **prompts[0]}), two, ({**other, **prompts[0]})]
    plain = [fast_model_fn(prepared, **c, attention_backend="cudnn_fp8") for c in calls]
    state = prepared.enable_cuda_graphs()
    try:
        graphed = [fast_model_fn(prepared, **c, attention_backend="cudnn_fp8") for c in calls]
        again = fast_model_fn(prepared, **calls[0], attention_backend="cudnn_fp8")
        assert state.captures == 2 and state.replays == 4, (state.captures, state.replays)
        for g, p in zip(graphed, plain, strict=True):
            assert rel_err(g, p) < 1e-3, rel_err(g, p)
        assert torch.equal(again, graphed[0])
        assert rel_err(graphed[2], graphed[0]) > 1e-2  # new latents went into the graph
        # a weight moved to new storage: the graphs are dropped and re-captured with it
        block = model.transformer_blocks[1]
        saved = block.img_mlp.net[2].weight.data
        block.img_mlp.net[2].weight.data = (saved.float() * 0.5).to(saved.dtype)
        try:
            moved = fast_model_fn(prepared, **calls[0], attention_backend="cudnn_fp8")
            assert state.captures == 3
            prepared.disable_cuda_graphs()
            assert rel_err(moved, fast_model_fn(prepared, **calls[0], attention_backend="cudnn_fp8")) < 1e-3
            assert rel_err(moved, plain[0]) > 1e-3
        finally:
            block.img_mlp.net[2].weight.data = saved
    finally:
        prepared.disable_cuda_graphs()


def test_cuda_graphs_match_kernel_by_kernel_eager_blocks(fp8_model, inputs):
    x, prompts = inputs
    _graph_vs_kernel_by_kernel(PreparedDit(fp8_model), x, prompts)


def test_invalidate_drops_the_graphs_and_the_next_call_captures_again(fp8_model, inputs):
    """The runtime calls ``invalidate`` where it replaces a model's tensors: the graphs go, the next call captures a
    new one and computes what kernel-by-kernel does."""
    x, prompts = inputs
    prepared = PreparedDit(fp8_model)
    plain = fast_model_fn(prepared, **x, **prompts[0], attention_backend="cudnn_fp8")
    state = prepared.enable_cuda_graphs()
    fast_model_fn(prepared, **x, **prompts[0], attention_backend="cudnn_fp8")
    assert state.captures == 1
    prepared.invalidate()
    assert prepared.graphs is not state and len(prepared.graphs) == 0
    again = fast_model_fn(prepared, **x, **prompts[0], attention_backend="cudnn_fp8")
    assert prepared.graphs.captures == 1 and rel_err(again, plain) < 1e-3
    prepared.disable_cuda_graphs()


@pytest.mark.slow
def test_cuda_graphs_match_kernel_by_kernel_compiled_blocks(fp8_model, inputs):
    x, prompts = inputs
    model = copy.deepcopy(fp8_model)
    torch._dynamo.reset()
    prepared = PreparedDit(model)
    prepared.compile_blocks()
    try:
        _graph_vs_kernel_by_kernel(prepared, x, prompts)
    finally:
        torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_block_keeps_its_buffers_aligned(fp8_model, inputs):
    """Inductor marks a buffer unaligned when an op's input is a view at an offset that is not a multiple of 16
    bytes, then every buffer computed from it, and its Triton launches lose the ``tt.divisibility`` hint (no vector
    loads). The joint v GEMM's scalars once put cuDNN's output scale 4 bytes in: the attention output, the residual
    updates and the LayerNorm kernels after it were all marked. No buffer of the compiled block may be."""
    from torch._inductor.utils import run_and_get_code

    x, prompts = inputs
    model = copy.deepcopy(fp8_model)
    torch._dynamo.reset()
    prepared = PreparedDit(model)
    prepared.compile_blocks()
    try:
        _, codes = run_and_get_code(fast_model_fn, prepared, **x, **prompts[0], attention_backend="cudnn_fp8")
    finally:
        torch._dynamo.reset()
    code = "\n".join(codes)
    assert "joint_v_gemm" in code and "cudnn_fp8_attention" in code, "the block should take the joint v GEMM path"
    unaligned = [line.strip() for line in code.splitlines() if "is assumed to be not aligned" in line]
    assert not unaligned, unaligned
