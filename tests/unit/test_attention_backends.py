"""Attention backends on CPU: registry, capability reasons, SDPA numerics, compile, and the 8-bit kernel's math.

The Triton kernels run here under Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess
because the variable is read when kernels are defined). Triton 3.6's interpreter has three bugs
that the kernel works around only in interpreter mode (``INTERPRET`` constexpr): bf16 ``tl.dot``
multiplies bit patterns, fp32->bf16 casts truncate, and fp32->e4m3 casts mis-round when rounding
carries into the next binade; with numpy >= 2.4 it also fails on ``range(runtime_scalar)``, which the
subprocess patches (tests/triton_interpreter.py). int8 and e4m3 ``tl.dot`` run correctly there, so every
format is checked against the plain-torch mirror in :mod:`fp8.attention.reference`. What the
interpreter cannot check (inline PTX of ``fast_math``, wgmma/TMA code generation) is covered by
tests/gpu/test_attention_fp8.py.
"""

from __future__ import annotations

from dataclasses import astuple

import pytest
import torch
from qwen_edit_hopper.fp8.attention import (
    BACKENDS,
    AttentionUnavailableError,
    attention,
    attention_capability,
    available_backends,
)
from qwen_edit_hopper.fp8.attention.reference import (
    quantize_reference,
    reference_attention,
    reference_quantized_attention,
)
from qwen_edit_hopper.fp8.capability import Capability
from qwen_edit_hopper.fp8.quant import relative_error
from triton_interpreter import run_probe


def _qkv(b=1, h=2, s=96, d=64, dtype=torch.bfloat16, seed=0, k_bias=0.0):
    g = torch.Generator().manual_seed(seed)

    def rms(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    q = rms(torch.randn(b, h, s, d, generator=g))
    k = rms(torch.randn(b, h, s, d, generator=g)) + k_bias
    v = torch.randn(b, h, s, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# --------------------------------------------------------------------------------------------------
# Registry and reasons
# --------------------------------------------------------------------------------------------------


def test_registry_lists_every_backend():
    assert BACKENDS == (
        "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math", "flash_attn", "triton_fp8", "cudnn_fp8",
        "cudnn_fp8_emulated",
    )  # fmt: skip
    table = available_backends("cpu")
    assert set(table) == set(BACKENDS)
    for name, capability in table.items():
        assert isinstance(capability, Capability), name
        assert isinstance(capability.ok, bool) and isinstance(capability.reason, str) and capability.reason, name


def test_cpu_reasons():
    ok, reason = astuple(attention_capability("triton_fp8", "cpu"))
    assert not ok and "needs a CUDA GPU with compute capability 9.0" in reason
    ok, reason = astuple(attention_capability("sdpa_cudnn", "cpu"))
    assert not ok and "CUDA" in reason
    ok, reason = astuple(attention_capability("sdpa_efficient", "cpu"))
    assert not ok and "CPU" in reason
    assert attention_capability("sdpa", "cpu").ok
    assert attention_capability("sdpa_math", "cpu").ok
    assert attention_capability("sdpa_flash", "cpu").ok
    ok, reason = astuple(attention_capability("flash_attn", "cpu"))
    assert not ok and ("not installed" in reason or "CUDA" in reason)


def test_triton_fp8_shape_reasons_are_reported_before_the_device():
    # On CPU the device reason wins; the shape reasons are checked once the device passes (GPU tests).
    ok, reason = astuple(attention_capability("triton_fp8", "cpu", head_dim=80, dtype=torch.float16))
    assert not ok and "compute capability 9.0" in reason


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="unknown attention backend 'fa9'"):
        attention_capability("fa9", "cpu")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="known backends"):
        attention(q, k, v, "fa9")


@pytest.mark.parametrize("name", ["triton_fp8", "sdpa_cudnn", "sdpa_efficient"])
def test_unavailable_backend_raises_with_reason(name):
    q, k, v = _qkv()
    with pytest.raises(AttentionUnavailableError, match=name):
        attention(q, k, v, name)


def test_bad_shapes_and_misplaced_config():
    from qwen_edit_hopper.fp8.attention.triton_fp8 import Fp8AttentionConfig

    q, k, v = _qkv()
    with pytest.raises(ValueError, match="share one"):
        attention(q, k[:, :, :10], v, "sdpa")
    with pytest.raises(ValueError, match="triton_fp8 only"):
        attention(q, k, v, "sdpa", config=Fp8AttentionConfig())


# --------------------------------------------------------------------------------------------------
# SDPA backends on CPU against float64
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sdpa", "sdpa_math", "sdpa_flash"])
@pytest.mark.parametrize(("dtype", "bound"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_sdpa_backends_match_float64(name, dtype, bound):
    q, k, v = _qkv(b=2, h=3, s=77, d=64, dtype=dtype, seed=1)
    out = attention(q, k, v, name)
    assert out.shape == (2, 77, 3 * 64) and out.dtype == dtype
    err = relative_error(out, reference_attention(q, k, v))
    assert err < bound, f"{name} {dtype}: {err:.2e}"


def test_output_layout_is_b_s_hd():
    q, k, v = _qkv(b=2, h=3, s=20, d=64, dtype=torch.float32)
    out = attention(q, k, v, "sdpa_math")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)  # (B, H, S, D)
    torch.testing.assert_close(out.view(2, 20, 3, 64), ref.transpose(1, 2))


@pytest.mark.parametrize("name", ["sdpa", "sdpa_math", "sdpa_flash"])
def test_sdpa_backends_compile_without_graph_breaks(name):
    q, k, v = _qkv(dtype=torch.float32)

    def fn(q, k, v):
        return attention(q, k, v, name) * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), fn(q, k, v))


def test_triton_fp8_traces_under_compile_and_fails_loudly_at_run_time_on_cpu():
    q, k, v = _qkv(d=128)

    def fn(q, k, v):
        return attention(q, k, v, "triton_fp8") * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager", fullgraph=True)  # a graph break would raise here
    with pytest.raises(AttentionUnavailableError, match=r"compute capability 9\.0"):
        compiled(q, k, v)


def test_fp8_custom_op_has_a_fake_kernel():
    from qwen_edit_hopper.fp8.attention.backends import fp8_attention_op

    q = torch.empty(2, 3, 50, 128, dtype=torch.bfloat16, device="meta")
    out = fp8_attention_op(q, q, q, "int8", "bf16", 128, 128, 8, 2, True, False)
    assert out.shape == (2, 50, 3 * 128) and out.dtype == torch.bfloat16 and out.device.type == "meta"


# --------------------------------------------------------------------------------------------------
# Config validation
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"qk_format": "fp16"}, "qk_format"),
        ({"pv_format": "e5m2"}, "pv_format"),
        ({"block_m": 32}, "block_m"),
        ({"block_n": 256}, "block_n"),
        ({"num_warps": 2}, "num_warps"),
        ({"num_stages": 0}, "num_stages"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    from qwen_edit_hopper.fp8.attention.triton_fp8 import Fp8AttentionConfig

    with pytest.raises(ValueError, match=match):
        Fp8AttentionConfig(**kwargs)


def test_config_rejects_non_bool_flags():
    from qwen_edit_hopper.fp8.attention.triton_fp8 import Fp8AttentionConfig

    with pytest.raises(TypeError, match="fast_math"):
        Fp8AttentionConfig(fast_math=1)


# --------------------------------------------------------------------------------------------------
# The kernel's numerics, mirrored in plain torch
# --------------------------------------------------------------------------------------------------


def test_quantized_operands_respect_their_ranges():
    q, k, v = _qkv(s=300, d=128, k_bias=0.7)
    for qk, pv in (("int8", "int8"), ("e4m3", "e4m3")):
        t = quantize_reference(q, k, v, qk, pv)
        qmax = 127.0 if qk == "int8" else 448.0
        assert t["q8"].abs().max() <= qmax and t["k8"].abs().max() <= qmax
        assert t["k8"][:, :, 300:].abs().max() == 0  # padding rows are zero
        if qk == "int8":
            assert torch.equal(t["q8"], t["q8"].round())
        # dequantized K is K minus its mean over tokens
        k_deq = (t["k8"].view(1, 2, 3, 128, 128) * t["ks"].view(1, 2, 3, 1, 1)).view(1, 2, 384, 128)[:, :, :300]
        k_c = k.float() - k.float().mean(2, keepdim=True)
        assert relative_error(k_deq, k_c) < (1e-2 if qk == "int8" else 4e-2)
        v_deq = t["v8"] * t["vs"] + t["vm"]
        assert relative_error(v_deq, v.float()) < (1e-2 if pv == "int8" else 4e-2)


def test_key_bias_does_not_change_the_quantized_output():
    """Adding one vector to every key leaves softmax unchanged; K smoothing makes the 8-bit path agree."""
    q, k, v = _qkv(s=200, d=128, seed=3)
    bias = torch.randn(128) * 4
    k_biased = (k.float() + bias).to(torch.bfloat16)
    a = reference_quantized_attention(q, k, v, "int8", "bf16")
    b = reference_quantized_attention(q, k_biased, v, "int8", "bf16")
    exact = reference_attention(q, k, v)
    # the difference is bf16 rounding of k + bias, not a quantization blow-up from the bias
    assert relative_error(b, exact) < 2.0 * relative_error(a, exact) + 2e-3


def test_int8_is_more_accurate_than_e4m3_on_gaussian_inputs():
    """Why int8 QK^T is the default: e4m3 keeps 3 mantissa bits on every element (see the notes)."""
    q, k, v = _qkv(h=2, s=1024, d=128, seed=5)
    exact = reference_attention(q, k, v)
    err = {
        (qk, pv): relative_error(reference_quantized_attention(q, k, v, qk, pv), exact)
        for qk, pv in (("int8", "bf16"), ("int8", "int8"), ("int8", "e4m3"), ("e4m3", "bf16"), ("e4m3", "e4m3"))
    }
    assert err[("int8", "bf16")] < 1.5e-2
    assert err[("int8", "int8")] < 2.5e-2
    assert err[("int8", "bf16")] < err[("int8", "int8")] < err[("int8", "e4m3")]
    assert err[("int8", "bf16")] < err[("e4m3", "bf16")] < err[("e4m3", "e4m3")]


# --------------------------------------------------------------------------------------------------
# The Triton kernels under the interpreter
# --------------------------------------------------------------------------------------------------

_INTERPRETER_PROBE = """
import json, torch
from qwen_edit_hopper.fp8.attention import triton_fp8 as tf
from qwen_edit_hopper.fp8.attention.reference import reference_attention, reference_quantized_attention
from qwen_edit_hopper.fp8.quant import relative_error

def rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

results = []
for i, (b, h, s, d, fmt, kw) in enumerate({cases!r}):
    g = torch.Generator().manual_seed(i)
    # (B, S, H, D) storage viewed as (B, H, S, D): the kernels take strided inputs
    q = rms(torch.randn(b, s, h, d, generator=g)).bfloat16().transpose(1, 2)
    k = (rms(torch.randn(b, s, h, d, generator=g)) + 0.5).bfloat16().transpose(1, 2)
    v = (torch.randn(b, s, h, d, generator=g) + 0.25).bfloat16().transpose(1, 2)
    cfg = tf.Fp8AttentionConfig(qk_format=fmt[0], pv_format=fmt[1], fast_math=False, **kw)
    prep = tf.quantize_qkv(q, k, v, cfg)
    out = torch.full((b, s, h * d), float("nan"), dtype=torch.bfloat16)
    tf.attention_from_quantized(prep, cfg, out=out)
    mirror = reference_quantized_attention(q, k, v, fmt[0], fmt[1], block_n=cfg.block_n)
    exact = reference_attention(q, k, v)
    results.append(dict(label=cfg.label, shape=[b, h, s, d], finite=bool(torch.isfinite(out).all()),
                        vs_mirror=relative_error(out, mirror.bfloat16()), err=relative_error(out, exact),
                        mirror_err=relative_error(mirror, exact)))
print(json.dumps(results))
"""

# (B, H, S, D, (qk_format, pv_format), config overrides): ragged tails, S < block, D=64, pipelined loop.
_CASES = [
    (1, 2, 300, 128, ("int8", "bf16"), {}),
    (1, 2, 300, 128, ("int8", "int8"), {}),
    (1, 2, 300, 128, ("int8", "e4m3"), {}),
    (1, 2, 300, 128, ("e4m3", "e4m3"), {}),
    (1, 2, 300, 128, ("e4m3", "bf16"), {}),
    (2, 1, 256, 128, ("int8", "bf16"), {"block_n": 64, "pipeline_qk": True}),
    (2, 1, 256, 128, ("int8", "int8"), {"block_n": 64, "pipeline_qk": True}),
    (1, 2, 200, 128, ("int8", "int8"), {"block_m": 64, "block_n": 32, "num_warps": 4, "pipeline_qk": True}),
    (1, 1, 5, 128, ("int8", "bf16"), {}),
    (2, 2, 129, 64, ("int8", "int8"), {"pipeline_qk": True}),
    (1, 2, 150, 64, ("int8", "bf16"), {"block_n": 64}),
]


@pytest.mark.slow
def test_triton_kernels_match_the_mirror_under_the_interpreter():
    rows = run_probe(_INTERPRETER_PROBE.format(cases=_CASES))
    assert len(rows) == len(_CASES)
    for row in rows:
        where = f"{row['label']} {row['shape']}: {row}"
        assert row["finite"], f"unwritten or non-finite output: {where}"
        # kernel (bf16 out) vs its float64 mirror rounded to bf16: rounding-boundary flips only
        assert row["vs_mirror"] < 6e-3, where
        # and the kernel's error against exact attention is the mirror's
        assert abs(row["err"] - row["mirror_err"]) < 0.15 * row["mirror_err"] + 1e-3, where
