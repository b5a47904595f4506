"""The fast forward under torch.compile on CPU: no graph breaks in a block, one graph for all blocks but the last
(which computes only the target tokens after its attention: a second graph), no recompiles, and the kernel plan
reaching the compiled block as a value Dynamo guards by value (no recompile for an equal plan of another call).

Graph breaks are checked with ``torch._dynamo.explain`` (no code generation). Recompiles are counted
with a backend that counts the graphs dynamo hands it; one Inductor compile (CPU C++) checks that the
compiled forward computes what eager computes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from qwen_edit_hopper.fp8 import Fp8Config, LayerPreset, quantize_linears
from qwen_edit_hopper.fp8.presets import QWEN_ATTN, QWEN_KEEP, QWEN_MLP, QWEN_MOD
from qwen_edit_hopper.qwen_edit import fast_forward
from qwen_edit_hopper.qwen_edit.fast.block import fast_block
from qwen_edit_hopper.qwen_edit.fast.block_kernels import BlockKernels
from qwen_edit_hopper.qwen_edit.fast.options import SHIPPED, UNFUSED
from qwen_edit_hopper.qwen_edit.fast_forward import (
    FUSED_QKV_PATTERN,
    PreparedDit,
    batch_prompts,
    fast_model_fn,
    fuse_qkv,
)
from test_fast_forward import BF16_TOL, build_dit, make_inputs, reference, rel


class CountingBackend:
    """A torch.compile backend that runs graphs eagerly and counts them."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _batch2(x: dict, other_tokens: int = 6) -> dict:
    """x as batch 2: the same latents with x's prompt and a shorter one (right-padded)."""
    other = make_inputs(x["latents"].dtype, text_tokens=other_tokens, seed=11)
    return {**x, **batch_prompts([x, other]), "latents": x["latents"].expand(2, -1, -1, -1)}


def _block_calls(monkeypatch, dit, **inputs) -> list[tuple]:
    """The argument tuples fast_model_fn passes to the block function, one per block."""
    calls = []

    def record(*args):
        calls.append(args)
        return fast_block(*args)

    monkeypatch.setattr(fast_forward, "fast_block", record)
    fast_model_fn(dit, **inputs)
    return calls


FP8_PRESET = LayerPreset("fused", "test", compute=(QWEN_ATTN, FUSED_QKV_PATTERN, QWEN_MLP), storage=(QWEN_MOD,),
                         keep=QWEN_KEEP)
CASES = [  # (fuse_qkv, fp8 config, batch 2, zero_cond_t, text_padding)
    pytest.param(False, None, False, False, "split", id="bf16"),
    pytest.param(True, None, False, True, "split", id="fused-zero_cond_t"),
    pytest.param(True, None, True, False, "split", id="batch2-split"),
    pytest.param(False, None, True, True, "mask", id="batch2-mask"),
    pytest.param(True, Fp8Config(backend="scaled_mm_rowwise", emulate=True, preset=FP8_PRESET), True, False, "split",
                 id="fp8-rowwise-emulated"),
    pytest.param(False, Fp8Config(backend="weight_only"), False, False, "split", id="fp8-weight-only"),
]


@pytest.mark.parametrize(("fuse", "fp8", "batch2", "zero_cond_t", "text_padding"), CASES)
def test_block_has_no_graph_breaks(monkeypatch, fuse, fp8, batch2, zero_cond_t, text_padding):
    dit = build_dit(torch.bfloat16)
    if fuse:
        fuse_qkv(dit)
    if fp8 is not None:
        quantize_linears(dit, fp8)
    x = make_inputs(torch.bfloat16)
    x = _batch2(x) if batch2 else x
    args = _block_calls(monkeypatch, dit, **x, zero_cond_t=zero_cond_t, text_padding=text_padding)[0]
    explained = torch._dynamo.explain(fast_block)(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("trim_last_block", [True, False], ids=["last-block-trimmed", "last-block-whole"])
def test_one_graph_for_all_blocks_and_no_recompile_for_new_shapes_or_weights(trim_last_block):
    options = dataclasses.replace(SHIPPED, trim_last_block=trim_last_block)
    per_batch = 2 if trim_last_block else 1  # blocks 0..n-2, and the last block's target-only graph
    model = build_dit(torch.bfloat16, layers=4)
    dit = PreparedDit(model)
    counter = CountingBackend()
    dit.compile_blocks(backend=counter)

    def fast_model_fn(dit, **inputs):  # every call with this test's options
        return fast_forward.fast_model_fn(dit, **inputs, options=options)

    first = make_inputs(torch.bfloat16)
    fast_model_fn(dit, **first)
    assert counter.graphs == per_batch  # 4 blocks: parameters are inputs, not constants
    # Another resolution, another reference size, another text length: same graphs (sequence dims dynamic).
    second = make_inputs(torch.bfloat16, latent=(8, 12), refs=((16, 8),), text_tokens=21, seed=5)
    fast_model_fn(dit, **second)
    assert counter.graphs == per_batch, counter.graphs
    # Weights changed in place (a LoRA strength): no recompile, and the output follows the weights.
    before = fast_model_fn(dit, **first)
    with torch.no_grad():
        model.transformer_blocks[1].attn.to_v.weight.mul_(1.5)
    after = fast_model_fn(dit, **first)
    assert counter.graphs == per_batch
    assert rel(after, before) > 1e-3
    # Batch 2 with prompts of different lengths: more graphs (the batch size is static), then none for
    # other lengths (they are tensor sizes marked dynamic, not ints), resolutions or numbers of references.
    fast_model_fn(dit, **_batch2(first))
    assert counter.graphs == 2 * per_batch, counter.graphs
    fast_model_fn(dit, **_batch2(second, other_tokens=9))
    third = make_inputs(torch.bfloat16, latent=(12, 12), refs=((12, 8), (8, 8)), text_tokens=15, seed=6)
    fast_model_fn(dit, **_batch2(third, other_tokens=4))
    assert counter.graphs == 2 * per_batch, counter.graphs


def test_inductor_compiled_forward_matches_eager():
    dit = build_dit(torch.bfloat16)
    fuse_qkv(dit)
    x = make_inputs(torch.bfloat16)
    y = make_inputs(torch.bfloat16, latent=(8, 12), refs=((16, 8),), text_tokens=21, seed=5)
    eager = [fast_model_fn(dit, **x, zero_cond_t=True), fast_model_fn(dit, **y, zero_cond_t=True)]
    prepared = PreparedDit(dit)
    prepared.compile_blocks()
    compiled = [fast_model_fn(prepared, **x, zero_cond_t=True), fast_model_fn(prepared, **y, zero_cond_t=True)]
    ref = reference(build_dit(torch.bfloat16), **x, zero_cond_t=True)
    for c, e in zip(compiled, eager, strict=True):
        assert rel(c, e) < BF16_TOL, rel(c, e)
    assert rel(compiled[0], ref) < BF16_TOL


def test_the_kernel_plan_is_guarded_by_value():
    """The block function takes the kernel plan's ``BlockKernels`` as an argument: an equal value from another call
    (other options object, other shape, so another plan) reuses the graph; a different value is a new graph, and an
    equal copy of that one reuses it in turn."""
    model = build_dit(torch.bfloat16, layers=3)
    dit = PreparedDit(model)
    counter = CountingBackend()
    dit.compile_blocks(backend=counter)
    x = make_inputs(torch.bfloat16)
    fast_model_fn(dit, **x)
    assert counter.graphs == 2  # blocks 0..n-2, and the trimmed last block
    first = dit.last_plan
    # Other options with the same outcome on this CPU model (the fused kernels are left out here anyway), and
    # another shape: new plan objects, equal block values.
    fast_model_fn(dit, **x, options=dataclasses.replace(UNFUSED, trim_last_block=True))
    fast_model_fn(dit, **make_inputs(torch.bfloat16, latent=(8, 12), refs=((16, 8),), text_tokens=21, seed=5))
    assert dit.last_plan is not first and dit.last_plan.block == first.block
    assert counter.graphs == 2, counter.graphs
    # A different value reaches the compiled function: a new graph; an equal new object: none.
    calls = []
    real = dit.compiled.fn
    object.__setattr__(dit.compiled, "fn", lambda *args: calls.append(args) or real(*args))
    fast_model_fn(dit, **x)
    args = list(calls[0])
    kernels_at = args.index(first.block)
    for value in (BlockKernels(small_m_gemm=True), BlockKernels(small_m_gemm=True)):
        args[kernels_at] = value
        real(*args)
    assert counter.graphs == 3, counter.graphs
