"""The 8-bit Triton attention on a Hopper GPU: accuracy against float64, against its torch mirror, and sanity timing.

Run on the device machine:
    python3 -m pytest tests/gpu/test_attention_fp8.py -m gpu -q -rs -s

Bounds (relative error ||out - ref|| / ||ref|| against float64 attention, 24 heads x 128, RMS-normalized
Gaussian q/k, Gaussian v) come from a CPU study of the quantized attention numerics with ~1.7x headroom:
int8 QK^T + bf16 PV predicted 1.1e-2, int8 PV 2.0e-2, e4m3 PV 3.8e-2, e4m3 QK^T + e4m3 PV 5.2e-2.
bf16 SDPA itself lands near 2.5e-3. The mirror check (kernel vs the float64 torch mirror of the same
quantization, rounded to bf16) is what catches code-generation bugs: it must be a few 1e-3 at most.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import astuple

import pytest
import torch
from qwen_edit_hopper.fp8.attention import attention, attention_capability
from qwen_edit_hopper.fp8.attention import triton_fp8 as tf
from qwen_edit_hopper.fp8.attention.reference import reference_quantized_attention
from qwen_edit_hopper.fp8.quant import relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

H, D = 24, 128
BOUNDS = {
    ("int8", "bf16"): 2.0e-2,
    ("int8", "int8"): 3.5e-2,
    ("int8", "e4m3"): 6.0e-2,
    ("e4m3", "bf16"): 6.5e-2,
    ("e4m3", "e4m3"): 9.0e-2,
}
MIRROR_BOUND = 6e-3
E4M3_MIRROR_BOUND = 1e-2
"""The mirror's e4m3 rounding of P and Q/K follows the GPU's only to ~8.5e-3 (H200, S=8492, 2026-11-21)."""


def mirror_bound(*formats: str) -> float:
    return E4M3_MIRROR_BOUND if "e4m3" in formats else MIRROR_BOUND


@pytest.fixture(autouse=True)
def _hopper():
    ok, reason = astuple(attention_capability("triton_fp8", "cuda"))
    if not ok:
        pytest.skip(reason)


def _inputs(b, s, kind="gauss", seed=0, h=H):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda")

    def rms(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    q, k, v = randn(b, h, s, D), randn(b, h, s, D), randn(b, h, s, D)
    if kind == "outlier":
        w = torch.ones(D, device="cuda")
        w[[3, 40, 77, 100]] = 8.0
        kb = torch.zeros(D, device="cuda")
        kb[[5, 9, 60]] = 3.0
        vw = torch.ones(D, device="cuda")
        vw[[1, 64]] = 10.0
        q, k, v = q * w, k * w + kb, v * vw + 0.5
    return rms(q).bfloat16(), rms(k).bfloat16(), v.bfloat16()


def _exact(q, k, v):
    """float64 attention one head at a time: (B, H, S, D) -> (B, S, H*D)."""
    b, h, s, d = q.shape
    out = torch.empty(b, s, h, d, dtype=torch.float64, device=q.device)
    for bi in range(b):
        for hi in range(h):
            qh, kh, vh = (t[bi, hi].double() for t in (q, k, v))
            out[bi, :, hi] = torch.softmax(qh @ kh.T / math.sqrt(d), dim=-1) @ vh
    return out.reshape(b, s, h * d)


def _cfg(qk, pv, **kw):
    return tf.Fp8AttentionConfig(qk_format=qk, pv_format=pv, **kw)


@pytest.mark.parametrize("s", [300, 2304, 8492])
@pytest.mark.parametrize("fmt", list(BOUNDS), ids=lambda f: f"{f[0]}-{f[1]}")
def test_accuracy_against_float64_and_the_mirror(s, fmt):
    q, k, v = _inputs(1, s, seed=s)
    cfg = _cfg(*fmt)
    out = attention(q, k, v, "triton_fp8", config=cfg)
    assert out.shape == (1, s, H * D) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    exact = _exact(q, k, v)
    err = relative_error(out, exact)
    sdpa_err = relative_error(attention(q, k, v, "sdpa"), exact)
    mirror = reference_quantized_attention(q, k, v, *fmt, block_n=cfg.block_n)
    vs_mirror = relative_error(out, mirror.bfloat16())
    print(f"\nS={s} {cfg.label}: err {err:.3e} (bf16 SDPA {sdpa_err:.3e}), vs mirror {vs_mirror:.2e}")
    assert vs_mirror < mirror_bound(*fmt)
    assert err < BOUNDS[fmt]


@pytest.mark.parametrize(
    "cfg",
    [
        _cfg("int8", "bf16", block_n=64, num_stages=3, pipeline_qk=True),
        _cfg("int8", "bf16", pipeline_qk=True),
        _cfg("int8", "bf16", block_m=64, num_warps=4),
        _cfg("int8", "bf16", block_m=64, block_n=64, num_warps=4, num_stages=3),
        _cfg("int8", "int8", block_n=64, num_stages=3, pipeline_qk=True),
        _cfg("int8", "int8", block_m=64, num_warps=4),
        _cfg("int8", "int8", block_m=64, block_n=64, num_warps=4, num_stages=3),
        _cfg("int8", "int8", fast_math=False),
        _cfg("int8", "e4m3", block_m=64, num_warps=4),
    ],
    ids=lambda c: c.label,
)
def test_every_benchmarked_variant_matches_the_mirror(cfg):
    """Ragged S (not a multiple of any block), B=2, strided inputs, poisoned output."""
    b, s = 2, 1111
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in _inputs(b, s, seed=7))  # (B,S,H,D) storage
    prep = tf.quantize_qkv(q, k, v, cfg)
    out = torch.full((b, s, H * D), float("nan"), device="cuda", dtype=torch.bfloat16)
    tf.attention_from_quantized(prep, cfg, out=out)
    assert torch.isfinite(out).all(), "some output tile was not written"
    mirror = reference_quantized_attention(q, k, v, cfg.qk_format, cfg.pv_format, block_n=cfg.block_n)
    assert relative_error(out, mirror.bfloat16()) < mirror_bound(cfg.qk_format, cfg.pv_format)


@pytest.mark.parametrize("fmt", [("int8", "bf16"), ("int8", "int8")], ids=lambda f: f"{f[0]}-{f[1]}")
def test_outlier_channels(fmt):
    q, k, v = _inputs(1, 2304, kind="outlier", seed=3)
    err = relative_error(attention(q, k, v, "triton_fp8", config=_cfg(*fmt)), _exact(q, k, v))
    print(f"\noutlier inputs {fmt}: err {err:.3e}")
    assert err < BOUNDS[fmt]


def test_head_dim_64_and_tiny_shapes():
    for b, h, s, d in ((1, 3, 1, 64), (2, 2, 77, 64), (1, 2, 129, 128)):
        g = torch.Generator(device="cuda").manual_seed(s)
        q, k, v = (torch.randn(b, h, s, d, generator=g, device="cuda").bfloat16() for _ in range(3))
        out = attention(q, k, v, "triton_fp8")
        exact = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
        assert relative_error(out, exact.transpose(1, 2).reshape(b, s, h * d)) < 3e-2, (b, h, s, d)


def test_rejects_what_it_cannot_run():
    q = torch.randn(1, 2, 64, 80, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(Exception, match="head dim"):
        attention(q, q, q, "triton_fp8")
    q = torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.float16)
    with pytest.raises(Exception, match="bfloat16"):
        attention(q, q, q, "triton_fp8")


@pytest.mark.parametrize("name", ["triton_fp8"])
def test_torch_compile_traces_around_the_custom_op(name):
    ok, reason = astuple(attention_capability(name, "cuda"))
    if not ok:
        pytest.skip(reason)
    q, k, v = _inputs(1, 1000, seed=11)

    def fn(q, k, v):
        return attention(q, k, v, name) * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), fn(q, k, v), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flash_attn"])
def test_bf16_backends_against_float64(name):
    ok, reason = astuple(attention_capability(name, "cuda"))
    if not ok:
        pytest.skip(reason)
    q, k, v = _inputs(1, 2304, seed=5)
    err = relative_error(attention(q, k, v, name), _exact(q, k, v))
    assert err < 1e-2, f"{name}: {err:.2e}"


def test_timing_sanity():
    """Prints ms for the default 8-bit path and cuDNN at S=8492 (no speed assertion)."""
    q, k, v = _inputs(1, 8492, seed=1)
    results = {}
    for name in ("sdpa_cudnn", "triton_fp8", "cudnn_fp8"):
        if not attention_capability(name, "cuda").ok:
            continue
        for _ in range(3):
            attention(q, k, v, name)
        torch.cuda.synchronize()
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            attention(q, k, v, name)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        results[name] = statistics.median(times)
    flops = 4.0 * H * 8492**2 * D
    print("\n" + ", ".join(f"{n}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)" for n, ms in results.items()))
    assert all(ms > 0 for ms in results.values())


def _bshd(t):
    """(B, H, S, D) values in (B, S, H, D) memory, as the DiT's transposes produce them."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)



# --------------------------------------------------------------------------------------------------
# cuDNN's FP8 attention (fp8/attention/cudnn_fp8.py): per-tensor e4m3 everywhere
# --------------------------------------------------------------------------------------------------

CUDNN_FP8_BOUND = 8e-2
"""e4m3 Q, K, P and V: 5.8-5.9e-2 against float64 on these inputs (H200, 2026-11-21)."""


def _need_cudnn_fp8():
    ok, reason = astuple(attention_capability("cudnn_fp8", "cuda", head_dim=D, dtype=torch.bfloat16))
    if not ok:
        pytest.skip(reason)


CUDNN_FP8_CASES = [(1, 100, "bhsd", "gauss"), (1, 8492, "bshd", "gauss"), (2, 300, "bshd", "gauss"),
                   (1, 2304, "bshd", "outlier")]  # fmt: skip


@pytest.mark.parametrize(("b", "s", "layout", "kind"), CUDNN_FP8_CASES)
def test_cudnn_fp8_against_float64_and_sdpa(b, s, layout, kind):
    _need_cudnn_fp8()
    q, k, v = _inputs(b, s, kind, seed=s + b)
    if layout == "bshd":
        q, k, v = _bshd(q), _bshd(k), _bshd(v)
    out = attention(q, k, v, "cudnn_fp8")
    assert out.shape == (b, s, H * D) and out.dtype == torch.bfloat16
    exact = _exact(q, k, v)
    err = relative_error(out, exact)
    assert err < CUDNN_FP8_BOUND, f"{err:.2e}"
    # Not a copy of the bf16 kernel's answer: e4m3 rounding shows (bf16 SDPA: ~2.3e-3).
    assert err > 5 * relative_error(attention(q, k, v, "sdpa_cudnn"), exact)


def test_cudnn_fp8_under_torch_compile():
    _need_cudnn_fp8()
    q, k, v = (_bshd(t) for t in _inputs(1, 1000, seed=12))

    def fn(q, k, v):
        return attention(q, k, v, "cudnn_fp8") * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    out = compiled(q, k, v)
    # Inductor fuses the quantization; its fp32 arithmetic may round a few e4m3 codes differently.
    assert relative_error(out, fn(q, k, v)) < 1e-2
    assert relative_error(out, 2.0 * _exact(q, k, v).float()) < CUDNN_FP8_BOUND


def test_cudnn_fp8_kernel_matches_its_mirror():
    """The CPU emulation (``reference_kernel``) computes what the kernel computes, up to P's block-wise rounding."""
    from qwen_edit_hopper.fp8.attention import cudnn_fp8 as cf

    _need_cudnn_fp8()
    q, k, v = (_bshd(t) for t in _inputs(1, 2304, "outlier", seed=21, h=4))
    (q8, dq), (k8, dk), (v8, dv) = cf.quantize_per_tensor(q), cf.quantize_per_tensor(k), cf.quantize_per_tensor(v)
    kernel = cf.attention_quantized(q8, k8, v8, dq, dk, dv).float()
    mirror = cf.attention_quantized(q8, k8, v8, dq, dk, dv, emulate=True).float()
    diff = relative_error(kernel, mirror)
    assert diff < 3e-2, f"{diff:.2e}"


@pytest.mark.parametrize("b", [1, 2])
def test_cudnn_fp8_first_query_rows_against_every_key(b):
    """The last block's attention: q's first T rows against all keys (S_q < S_kv) give the first T rows of the whole
    call (right-padded keys at batch 2), and what the mirror computes up to P's block-wise rounding (H200: identical
    codes; 3.7e-2 from the mirror on these Gaussian inputs, 24 heads)."""
    from qwen_edit_hopper.fp8.attention import cudnn_fp8 as cf

    _need_cudnn_fp8()
    s, t = 2304, 1024
    q, k, v = (_bshd(x) for x in _inputs(b, s, seed=31 + b))
    (q8, dq), (k8, dk), (v8, dv) = cf.quantize_per_tensor(q), cf.quantize_per_tensor(k), cf.quantize_per_tensor(v)
    keys = torch.tensor([s, s - 100][:b], dtype=torch.int32, device="cuda")
    whole = cf.attention_quantized(q8, k8, v8, dq, dk, dv, seq_len_kv=keys).float()
    first = cf.attention_quantized(q8[:, :, :t], k8, v8, dq, dk, dv, seq_len_kv=keys).float()
    mirror = cf.attention_quantized(q8[:, :, :t], k8, v8, dq, dk, dv, emulate=True, seq_len_kv=keys).float()
    errors = (relative_error(first, whole[:, :t]), relative_error(first, mirror))
    print(f"\nfirst rows vs whole {errors[0]:.2e}, vs mirror {errors[1]:.2e}")
    assert first.shape == (b, t, H * D)
    assert errors[0] == 0.0 and errors[1] < 5e-2, errors


@pytest.mark.parametrize(("b", "with_bias"), [(1, False), (2, True)])
def test_fused_qk_norm_rope_quantize_matches_its_reference(b, with_bias):
    """qwen_edit/kernels/qk_norm_rope_quant.py on the GPU (round-to-nearest casts) against the torch reference,
    DiT-like strides."""
    from qwen_edit_hopper.qwen_edit.kernels.qk_norm_rope_quant import (
        qk_norm_rope_quantize,
        reference_qk_norm_rope_quantize,
    )

    g = torch.Generator(device="cuda").manual_seed(b)
    si, st = 1024, 77
    qkv = (torch.randn(b, si, 3, H, D, generator=g, device="cuda") * 2 + 0.5).bfloat16()
    x_txt = (torch.randn(b, st, 3, H, D, generator=g, device="cuda") * 3).bfloat16()[:, :, 1]
    w_img = (1.5 + 0.3 * torch.randn(D, generator=g, device="cuda")).bfloat16()
    w_txt = (1.2 + 0.3 * torch.randn(D, generator=g, device="cuda")).bfloat16()
    angles = torch.rand(si + st, D // 2, generator=g, device="cuda") * 6.3
    bound = torch.tensor(D**0.5 * 1.02 * 2.4, device="cuda")
    biases = [(torch.randn(H, D, generator=g, device="cuda") * 2).bfloat16() for _ in range(2)] if with_bias else []
    args = (qkv[:, :, 0], x_txt, w_img, w_txt, 1e-6, 1e-5, angles.cos(), angles.sin(), bound, *biases)
    got, want = qk_norm_rope_quantize(*args), reference_qk_norm_rope_quantize(*args)
    assert got.shape == (b, si + st, H, D) and got.is_contiguous()
    assert (got.float() == want.float()).float().mean() > 0.99
    assert relative_error(got.float(), want.float()) < 1e-2
    # the bound from the weights inside the kernel: the same codes as with the block's bound, given, and the
    # descale torch computes from it (bound / 448 on CUDA: times float32(1 / 448))
    from qwen_edit_hopper.fp8.attention.cudnn_fp8 import rms_norm_bound
    from qwen_edit_hopper.qwen_edit.kernels.qk_norm_rope_quant import qk_norm_rope_quantize_scaled

    w_bound = torch.maximum(rms_norm_bound(w_img, D), rms_norm_bound(w_txt, D))
    given = qk_norm_rope_quantize(*args[:8], w_bound, *biases)
    x8, descale = qk_norm_rope_quantize_scaled(*args[:8], *biases)
    assert torch.equal(x8.view(torch.uint8), given.view(torch.uint8))
    assert torch.equal(descale, (w_bound / 448.0).reshape(1))


@pytest.mark.parametrize(("b", "with_bias"), [(1, False), (2, True)])
def test_fused_v_quantize_matches_its_reference(b, with_bias):
    """qwen_edit/kernels/joint_v_quant.py on the GPU against the block's torch path, DiT-like strides (views into QKV
    outputs)."""
    from qwen_edit_hopper.qwen_edit.kernels.joint_v_quant import joint_v_quantize, reference_joint_v_quantize

    g = torch.Generator(device="cuda").manual_seed(b)
    si, st = 1024, 77
    qkv = (torch.randn(b, si, 3, H, D, generator=g, device="cuda") * 2 + 0.5).bfloat16()
    qkv_txt = (torch.randn(b, st, 3, H, D, generator=g, device="cuda") * 3).bfloat16()
    biases = [(torch.randn(H, D, generator=g, device="cuda") * 2).bfloat16() for _ in range(2)] if with_bias else []
    args = (qkv[:, :, 2], qkv_txt[:, :, 2], *biases)
    (got, got_descale), (want, want_descale) = joint_v_quantize(*args), reference_joint_v_quantize(*args)
    assert got.shape == (b, si + st, H, D) and got.is_contiguous()
    assert torch.equal(got_descale, want_descale)
    assert torch.equal(got.float(), want.float())
