"""The fast DiT forward on a real GPU, at full width (dim 3072, 24 heads x 128, text dim 3584), 2 blocks.

Run on the device machine::

    .testenv/bin/python -m pytest tests/gpu/test_fast_forward_gpu.py -m gpu -q -rs
    # -m "gpu and not slow" skips the Inductor compiles (about a minute each)

Inputs: a 512x512 edit with one 512x512 reference (2 x 1024 image tokens) and prompts of 300 / 287
text tokens; random weights (tests/gpu/random_dit.py). Fused kernels are switched through the forward's options
(``ForwardOptions``, ``dataclasses.replace(SHIPPED, ...)``). Timing is the harness's job (bench/harness.py).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from qwen_edit_hopper.fp8 import Fp8Config, quantize_linears
from qwen_edit_hopper.fp8.attention import attention_capability
from qwen_edit_hopper.qwen_edit.checkpoints.dit import DiTConfig
from qwen_edit_hopper.qwen_edit.fast.options import SHIPPED
from qwen_edit_hopper.qwen_edit.fast_forward import PreparedDit, batch_prompts, fast_model_fn, fuse_qkv

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_dit import build_random_dit, fused_preset, make_inputs, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WIDE = DiTConfig(dim=3072, num_layers=2, num_heads=24, head_dim=128, text_dim=3584)
BF16_TOL = 2e-2
FP8_TOL = 5e-2  # one fp8 GEMM alone is ~3.7e-2 on Gaussian data


def _need(backend: str) -> None:
    capability = attention_capability(backend, "cuda", head_dim=WIDE.head_dim, dtype=torch.bfloat16)
    if not capability.ok:
        pytest.skip(capability.reason)


@pytest.fixture(scope="module")
def dit():
    return build_random_dit(WIDE)


@pytest.fixture(scope="module")
def inputs():
    x = make_inputs(WIDE, size=512)
    prompts = x.pop("prompts")
    return x, prompts


def _diffsynth(dit, x, prompt, **kw):
    from diffsynth.pipelines.qwen_image import model_fn_qwen_image

    with torch.no_grad():
        return model_fn_qwen_image(dit=dit, **x, **prompt, **kw)


@pytest.mark.parametrize("zero_cond_t", [False, True], ids=["t", "zero_cond_t"])
@pytest.mark.parametrize("backend", ["sdpa", "sdpa_cudnn", "sdpa_flash"])
def test_matches_diffsynth(dit, inputs, backend, zero_cond_t):
    _need(backend)
    x, prompts = inputs
    ref = _diffsynth(dit, x, prompts[0], zero_cond_t=zero_cond_t)
    out = fast_model_fn(dit, **x, **prompts[0], zero_cond_t=zero_cond_t, attention_backend=backend)
    assert rel_err(out, ref) < BF16_TOL


@pytest.mark.parametrize(("backend", "text_padding"),
                         [("sdpa", "split"), ("sdpa", "mask"), ("sdpa_cudnn", "split"), ("triton_fp8", "split"),
                          ("cudnn_fp8", "split")])
def test_batch2_matches_two_batch1_calls(dit, inputs, backend, text_padding):
    _need(backend)
    x, prompts = inputs
    two = {**x, **batch_prompts(prompts), "latents": x["latents"].expand(2, -1, -1, -1)}
    out = fast_model_fn(dit, **two, attention_backend=backend, text_padding=text_padding)
    # cudnn_fp8: V's per-tensor scale spans both samples at batch 2, one at batch 1 (other e4m3 roundings).
    same_tol = 3e-2 if backend == "cudnn_fp8" else 1e-2
    for i, prompt in enumerate(prompts):
        one = fast_model_fn(dit, **x, **prompt, attention_backend=backend)
        assert rel_err(out[i : i + 1], one) < same_tol, (i, rel_err(out[i : i + 1], one))
    # ... and the batch-1 forwards equal DiffSynth's (sdpa: same math; triton_fp8 / cudnn_fp8: 8-bit error).
    ref = _diffsynth(dit, x, prompts[1])
    assert rel_err(out[1:], ref) < (BF16_TOL if backend not in ("triton_fp8", "cudnn_fp8") else FP8_TOL)


def test_no_host_sync_in_a_warm_forward(dit, inputs):
    """After the first call per shape (RoPE tables, text lengths), a forward never waits for the GPU."""
    x, prompts = inputs
    text = batch_prompts(prompts)
    two = {**x, **text, "latents": x["latents"].expand(2, -1, -1, -1)}
    fast_model_fn(dit, **x, **prompts[0], zero_cond_t=True)
    fast_model_fn(dit, **two)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fast_model_fn(dit, **x, **prompts[0], zero_cond_t=True)
        fast_model_fn(dit, **two)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.slow
def test_compiled_matches_eager_and_reuses_the_graph(dit, inputs):
    from torch._dynamo.utils import counters

    x, prompts = inputs
    eager = fast_model_fn(dit, **x, **prompts[0])
    torch._dynamo.reset()
    prepared = PreparedDit(dit)
    prepared.compile_blocks()
    try:
        compiled = fast_model_fn(prepared, **x, **prompts[0])
        graphs = counters["stats"]["unique_graphs"]
        other = make_inputs(WIDE, size=384, text_tokens=(211,), seed=3)
        other_prompt = other.pop("prompts")[0]
        fast_model_fn(prepared, **other, **other_prompt)  # another resolution and text length
        assert counters["stats"]["unique_graphs"] == graphs, "a new shape recompiled the block"
    finally:
        torch._dynamo.reset()
    assert rel_err(compiled, eager) < BF16_TOL


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sdpa", "triton_fp8", "cudnn_fp8"])
def test_fused_fp8_compiled(dit, inputs, backend):
    _need(backend)
    x, prompts = inputs
    ref = _diffsynth(dit, x, prompts[0])
    model = copy.deepcopy(dit)
    fuse_qkv(model)
    report = quantize_linears(model, Fp8Config(backend="scaled_mm_rowwise", preset=fused_preset()))
    converted = {d.name for d in report.converted}
    assert "transformer_blocks.0.attn.to_qkv" in converted and "transformer_blocks.0.attn.add_qkv_proj" in converted
    torch._dynamo.reset()
    prepared = PreparedDit(model)
    prepared.compile_blocks()
    try:
        out = fast_model_fn(prepared, **x, **prompts[0], attention_backend=backend)
        two = {**x, **batch_prompts(prompts), "latents": x["latents"].expand(2, -1, -1, -1)}
        both = fast_model_fn(prepared, **two, attention_backend=backend)
    finally:
        torch._dynamo.reset()
    tol = FP8_TOL if backend == "sdpa" else FP8_TOL + 1e-2
    assert rel_err(out, ref) < tol
    assert rel_err(both[:1], out) < 1e-2


@pytest.mark.parametrize("zero_cond_t", [False, True], ids=["t", "zero_cond_t"])
def test_fused_norm_and_gelu_quantize_kernels_are_as_accurate_as_inductor(dit, inputs, zero_cond_t):
    """The fastest preset's layout (row-wise everywhere, fast accumulation), compiled, with the two fused kernels
    (LayerNorm + modulate + quantize, bias + GELU + quantize) on and off (``fused_norm_quant``,
    ``fused_gelu_quant``): the same error against DiffSynth bf16."""
    from qwen_edit_hopper.qwen_edit.fast import prequant

    x, prompts = inputs
    ref = _diffsynth(dit, x, prompts[0], zero_cond_t=zero_cond_t)
    model = copy.deepcopy(dit)
    quantize_linears(model, Fp8Config(backend="scaled_mm_rowwise", preset="attn+mlp+mod compute", fast_accum=True))
    block = model.transformer_blocks[0]
    assert prequant.takes_prequantized(block.attn.to_q) and prequant.takes_prequantized(block.attn.add_k_proj)
    errors = {}
    try:
        for fused in (False, True):
            options = dataclasses.replace(SHIPPED, fused_norm_quant=fused, fused_gelu_quant=fused)
            torch._dynamo.reset()
            prepared = PreparedDit(model)
            prepared.compile_blocks()
            out = fast_model_fn(prepared, **x, **prompts[0], zero_cond_t=zero_cond_t, options=options)
            used = prepared.last_plan.used
            assert ("norm_quant" in used) == fused, prepared.last_plan.describe()
            errors[fused] = rel_err(out, ref)
    finally:
        torch._dynamo.reset()
    print(f"\nvs DiffSynth bf16: Inductor quantization {errors[False]:.3e}, fused kernels {errors[True]:.3e}")
    assert errors[False] < FP8_TOL
    assert errors[True] < 1.05 * errors[False] + 1e-3


def _spied_option_runs(dit, inputs, zero_cond_t, monkeypatch, module, spied: str, field: str, settings: tuple):
    """The fastest preset's layers (row-wise, fast accumulation, cuBLASLt GEMMs), eager, cuDNN FP8 attention: for each
    of ``settings`` of the option ``field`` (``dataclasses.replace(SHIPPED, field=setting)``), (batch-1 output, batch-2
    output, calls of ``module.<spied>`` at batch 1, at batch 2)."""
    x, prompts = inputs
    model = copy.deepcopy(dit)
    quantize_linears(model, Fp8Config(backend="scaled_mm_rowwise", preset="attn+mlp+mod compute", fast_accum=True,
                                      gemm_kernel="cublaslt"))
    calls = []
    real = getattr(module, spied)
    monkeypatch.setattr(module, spied, lambda *a: calls.append(1) or real(*a))
    two = {**x, **batch_prompts(prompts), "latents": x["latents"].expand(2, -1, -1, -1)}
    outs = {}
    for setting in settings:
        options = dataclasses.replace(SHIPPED, **{field: setting})
        with torch.no_grad():
            one = fast_model_fn(model, **x, **prompts[0], zero_cond_t=zero_cond_t, attention_backend="cudnn_fp8",
                                options=options)
            counted = len(calls)
            both = fast_model_fn(model, **two, zero_cond_t=zero_cond_t, attention_backend="cudnn_fp8",
                                 options=options)
        outs[setting] = (one, both, counted, len(calls) - counted)
        calls.clear()
    return outs


@pytest.mark.parametrize("zero_cond_t", [False, True], ids=["t", "zero_cond_t"])
def test_residual_updates_in_the_gemm_epilogue_match_the_unfused_path(dit, inputs, zero_cond_t, monkeypatch):
    """The fastest preset's layers (row-wise, fast accumulation, cuBLASLt GEMMs, cuDNN FP8 attention), eager:
    both gated residual updates in the output projections' epilogue (``ForwardOptions.residual_epilogue``) against
    neither. A spy counts the fused calls per block: the image stream's two and the text stream's two, at batch 1 and
    2 (the text output projection takes cuBLASLt at 300 rows too). With zero_cond_t the image gate varies per token:
    only the text stream's. The last block runs no text stream after its attention (``trim_last_block``)."""
    _need("cudnn_fp8")
    from qwen_edit_hopper.qwen_edit.fast import residual_gemm

    x, prompts = inputs
    ref = _diffsynth(dit, x, prompts[0], zero_cond_t=zero_cond_t)
    outs = _spied_option_runs(dit, inputs, zero_cond_t, monkeypatch, residual_gemm, "cublaslt_rowwise_mm_residual",
                              "residual_epilogue", (("attention", "mlp"), ()))
    one, both, batch1_calls, batch2_calls = outs[("attention", "mlp")]
    blocks = WIDE.num_layers
    expected = (2 if zero_cond_t else 4) * blocks - (2 if SHIPPED.trim_last_block else 0)
    assert batch1_calls == batch2_calls == expected
    assert outs[()][2] == outs[()][3] == 0
    assert rel_err(one, outs[()][0]) < 5e-3 and rel_err(both, outs[()][1]) < 5e-3
    assert rel_err(one, ref) < FP8_TOL + 1e-2
    assert rel_err(both[:1], one) < 1e-2


def _assert_one_call_per_block_and_no_loss(outs: dict, ref: torch.Tensor, off: str, on: str,
                                            per_block: int = 1, text_stream_calls: int = 0) -> None:
    """For :func:`_spied_option_runs` over (on, off): the spied op ran ``per_block`` times per block at batch 1 and at
    batch 2 when on (less the ``text_stream_calls`` of the last block's text stream after its attention, which does
    not run: ``trim_last_block``) and never when off; the batch-1 error against ``ref`` is the off path's; batch 2's
    first sample is batch 1's output."""
    on_key, off_key = list(outs)
    blocks = WIDE.num_layers * per_block - (text_stream_calls if SHIPPED.trim_last_block else 0)
    assert outs[on_key][2:] == (blocks, blocks)
    assert outs[off_key][2:] == (0, 0)
    err_on, err_off = rel_err(outs[on_key][0], ref), rel_err(outs[off_key][0], ref)
    print(f"\nvs DiffSynth bf16: {off} {err_off:.3e}, {on} {err_on:.3e}; on vs off "
          f"{rel_err(outs[on_key][0], outs[off_key][0]):.3e}")
    assert err_on < 1.05 * err_off + 1e-3
    assert rel_err(outs[on_key][1][:1], outs[on_key][0]) < 1e-2


@pytest.mark.parametrize("zero_cond_t", [False, True], ids=["t", "zero_cond_t"])
def test_fused_gelu_gemm_matches_the_two_kernel_path(dit, inputs, zero_cond_t, monkeypatch):
    """The fastest preset's layers, eager: both streams' MLP up-projection + GELU + e4m3 cast in one GEMM
    (``ForwardOptions.gelu_gemm``) against cuBLASLt (the text stream: the small-M GEMM) + the GELU-quantize kernel. A
    spy counts the fused calls: two per block at batch 1 and 2 (the image stream's and the text stream's 300 / 600
    rows), none when off. The error against DiffSynth bf16 stays where the two-kernel path has it."""
    _need("cudnn_fp8")
    from qwen_edit_hopper.qwen_edit.fast import mlp as fast_mlp

    x, prompts = inputs
    ref = _diffsynth(dit, x, prompts[0], zero_cond_t=zero_cond_t)
    outs = _spied_option_runs(dit, inputs, zero_cond_t, monkeypatch, fast_mlp, "gelu_gemm_rowwise", "gelu_gemm",
                              (("image", "text"), ()))
    _assert_one_call_per_block_and_no_loss(outs, ref, "two kernels", "fused GELU GEMM", per_block=2,
                                           text_stream_calls=1)


@pytest.mark.parametrize("zero_cond_t", [False, True], ids=["t", "zero_cond_t"])
def test_joint_v_gemm_matches_the_v_kernels(dit, inputs, zero_cond_t, monkeypatch):
    """The fastest preset's layers, eager: the joint e4m3 v written by the image v GEMM with a bound scale
    (``ForwardOptions.joint_v_gemm``) against cuBLASLt + the max and cast kernels. One call per block at batch 1
    and 2, none when off; the error against DiffSynth bf16 stays where the kernels have it."""
    _need("cudnn_fp8")
    from qwen_edit_hopper.qwen_edit.fast import block as fast_block

    x, prompts = inputs
    ref = _diffsynth(dit, x, prompts[0], zero_cond_t=zero_cond_t)
    outs = _spied_option_runs(dit, inputs, zero_cond_t, monkeypatch, fast_block, "joint_v_gemm", "joint_v_gemm",
                              (True, False))
    _assert_one_call_per_block_and_no_loss(outs, ref, "v kernels", "joint v GEMM")
