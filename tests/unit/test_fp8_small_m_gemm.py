"""The small-M row-wise fp8 GEMM (fp8/small_m_gemm.py) on CPU: which calls take it, and the kernel under Triton's
interpreter against the float32 reference. The GPU comparison with ``torch._scaled_mm`` is in
tests/gpu/test_fp8_backends.py."""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.fp8.linear import ScaledMMLinear
from qwen_edit_hopper.fp8.small_m_gemm import CONFIGS, MAX_ROWS, MIN_ROWS, config_for_shape, small_m_config
from triton_interpreter import run_probe

HOPPER = (9, 0)


@pytest.mark.parametrize("k, n", sorted(CONFIGS))
def test_text_stream_shapes_on_hopper_take_the_kernel(k, n):
    assert config_for_shape(300, k, n, HOPPER) == CONFIGS[(k, n)]
    assert config_for_shape(MIN_ROWS, k, n, HOPPER) == CONFIGS[(k, n)]
    assert config_for_shape(MAX_ROWS, k, n, HOPPER) == CONFIGS[(k, n)]


@pytest.mark.parametrize("m, k, n, capability", [
    (600, 3072, 9216, HOPPER),         # batch 2's text: cuBLASLt measured faster
    (MAX_ROWS + 1, 3072, 3072, HOPPER),
    (1, 3072, 18432, HOPPER),          # the modulation GEMV
    (MIN_ROWS - 1, 3072, 3072, HOPPER),
    (300, 12288, 3072, HOPPER),        # MLP down: no gain measured, not in the table
    (300, 3072, 3072, HOPPER),         # output projection: slower than cuBLASLt right after the attention
    (8192, 3072, 9216, HOPPER),        # the image stream
    (300, 3072, 9216, (8, 9)),         # Ada: configs are Hopper's
    (300, 3072, 9216, (10, 0)),
])
def test_other_calls_keep_cublas(m, k, n, capability):
    assert config_for_shape(m, k, n, capability) is None


def test_cpu_tensors_and_unfused_accumulation_keep_cublas():
    x8 = torch.zeros(300, 3072, dtype=torch.float8_e4m3fn)
    w8 = torch.zeros(9216, 3072, dtype=torch.float8_e4m3fn)
    scale = torch.ones(300, 1)
    assert small_m_config(x8, w8, scale, torch.bfloat16, fast_accum=True) is None  # not CUDA
    assert small_m_config(x8, w8, scale, torch.bfloat16, fast_accum=False) is None


def test_a_gemm_asked_for_cublas_never_asks_for_a_config(monkeypatch):
    """``ScaledMMLinear.gemm(..., small_m=False)`` (the fast forward's ``small_m_gemm`` option off) does not
    consult :func:`small_m_config` at all."""
    asked, ran = [], []
    monkeypatch.setattr("qwen_edit_hopper.fp8.linear.small_m_config", lambda *a: asked.append(1))
    monkeypatch.setattr("qwen_edit_hopper.fp8.linear.scaled_mm", lambda *a: ran.append(1))
    layer = ScaledMMLinear.from_linear(torch.nn.Linear(64, 64).to(torch.bfloat16), "rowwise", emulate=False,
                                       fast_accum=True)
    x8, scale = layer.quantize_input(torch.randn(20, 64, dtype=torch.bfloat16))
    layer.gemm(x8, scale, torch.bfloat16, small_m=False)
    assert asked == [] and ran == [1]
    layer.gemm(x8, scale, torch.bfloat16)
    assert asked == [1] and ran == [1, 1]


def test_emulated_layers_never_reach_the_kernel(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("small-M kernel called for an emulated layer")

    monkeypatch.setattr("qwen_edit_hopper.fp8.linear.fp8_gemm_small_m", fail)
    linear = torch.nn.Linear(256, 256).to(torch.bfloat16)
    layer = ScaledMMLinear.from_linear(linear, "rowwise", emulate=True, fast_accum=True)
    out = layer(torch.randn(40, 256, dtype=torch.bfloat16))
    assert out.shape == (40, 256)


_PROBE = """
import json, torch
from qwen_edit_hopper.fp8 import small_m_gemm as smg
from qwen_edit_hopper.fp8.quant import quantize_rowwise

g = torch.Generator().manual_seed(0)
k, n = 256, 256
w8, ws = quantize_rowwise(torch.randn(n, k, generator=g).bfloat16())
results = []
for m, row_stride, expanded_scale in [(20, k, False), (70, k, False), (70, 2 * k, True)]:
    big = torch.randn(m, row_stride, generator=g).bfloat16()
    x8_full, xs = quantize_rowwise(big)
    x8 = x8_full[:, :k]  # rows of ``row_stride`` elements: contiguous rows, not a contiguous tensor
    if expanded_scale:
        xs = torch.full((1, 1), 0.01).expand(m, 1)
    want = (x8.float() @ w8.float().t()) * xs * ws.reshape(1, n)
    got = smg._fp8_gemm_small_m_op(x8, xs, w8, ws.reshape(n, 1).contiguous(), 64, 128, 128, 4, 3)
    err = ((got.float() - want).norm() / want.norm()).item()
    swapped = smg._fp8_gemm_small_m_op(x8, xs.flip(0).contiguous() if not expanded_scale else xs * 2, w8,
                                       ws.reshape(n, 1).contiguous(), 64, 128, 128, 4, 3)
    swapped_err = ((swapped.float() - want).norm() / want.norm()).item()
    results.append([m, row_stride, expanded_scale, list(got.shape), str(got.dtype), err, swapped_err])
refusal = None
try:
    smg.fp8_gemm_small_m(x8, xs, torch.zeros(200, k, dtype=w8.dtype), torch.ones(200, 1), (64, 128, 128, 4, 3))
except ValueError as exc:
    refusal = str(exc)
print(json.dumps({"results": results, "refusal": refusal}))
"""


def test_kernel_under_the_interpreter_matches_the_float32_reference():
    probe = run_probe(_PROBE, wrap_triton_modules=("qwen_edit_hopper.fp8.small_m_gemm",))
    for m, row_stride, expanded, shape, dtype, err, swapped_err in probe["results"]:
        assert shape == [m, 256] and dtype == "torch.bfloat16"
        # the interpreter truncates float32 -> bf16 (up to 2^-8 relative), so a few 1e-3 is its rounding
        assert err < 5e-3, (m, row_stride, expanded, err)
        assert swapped_err > 0.1, "the row scales are not applied per row"
    assert "do not fit tiles of 128 columns" in probe["refusal"]
