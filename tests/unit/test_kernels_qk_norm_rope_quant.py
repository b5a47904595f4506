"""The fused QK RMSNorm + RoPE + e4m3 kernel (qwen_edit/kernels/qk_norm_rope_quant.py) and its reference, on CPU.

The reference is checked against the block's own path (``qk_norm_rope`` + ``quantize_with_bound``); the
kernel runs under Triton's interpreter in a subprocess against a reference with the interpreter's
truncating bf16 casts. The GPU comparison with round-to-nearest casts is in tests/gpu.
"""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.fp8.attention.cudnn_fp8 import quantize_with_bound, rms_norm_bound
from qwen_edit_hopper.qwen_edit.fast.rope import qk_norm_rope
from qwen_edit_hopper.qwen_edit.kernels.qk_norm_rope_quant import (
    qk_norm_rope_quant_capability,
    qk_norm_rope_quantize,
    reference_qk_norm_rope_quantize,
)
from triton_interpreter import run_probe


def _streams(b=2, si=12, st=5, h=4, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(b, si, 3, h, d, generator=g) * 2 + 0.5).bfloat16()
    x_txt = (torch.randn(b, st, h, d, generator=g) * 3).bfloat16()
    w_img = (1.5 + 0.3 * torch.randn(d, generator=g)).bfloat16()
    w_txt = (1.2 + 0.3 * torch.randn(d, generator=g)).bfloat16()
    angles = torch.rand(si + st, d // 2, generator=g) * 6.3
    return qkv[:, :, 0], x_txt, w_img, w_txt, angles.cos(), angles.sin()  # x_img: a strided view, as in the DiT


def test_refuses_cpu_tensors_with_the_reason():
    assert "CUDA" in qk_norm_rope_quant_capability(torch.device("cpu"), 128).reason
    x_img, x_txt, w_img, w_txt, cos, sin = _streams()
    with pytest.raises(ValueError, match="CUDA"):
        qk_norm_rope_quantize(x_img, x_txt, w_img, w_txt, 1e-6, 1e-6, cos, sin, torch.tensor(50.0))


def test_reference_is_the_block_path():
    x_img, x_txt, w_img, w_txt, cos, sin = _streams()
    si = x_img.shape[1]
    bound = torch.maximum(rms_norm_bound(w_img, 32), rms_norm_bound(w_txt, 32))
    want = torch.cat([qk_norm_rope(x_img, w_img, 1e-6, cos[:si], sin[:si]),
                      qk_norm_rope(x_txt, w_txt, 1e-5, cos[si:], sin[si:])], dim=1)  # fmt: skip
    want8, _ = quantize_with_bound(want, bound)
    got8 = reference_qk_norm_rope_quantize(x_img, x_txt, w_img, w_txt, 1e-6, 1e-5, cos, sin, bound)
    assert got8.shape == want.shape and got8.dtype == torch.float8_e4m3fn
    # eager qk_norm_rope rotates with a complex64 multiply, the reference with real arithmetic: rare 1-ulp ties
    assert (got8.float() == want8.float()).float().mean() > 0.99
    # A bias not yet added is added first, in bf16, as the linear layer adds it.
    b_img, b_txt = torch.randn(4, 32).bfloat16(), torch.randn(4, 32).bfloat16()
    with_bias = reference_qk_norm_rope_quantize(x_img, x_txt, w_img, w_txt, 1e-6, 1e-5, cos, sin, bound, b_img, b_txt)
    added = reference_qk_norm_rope_quantize(x_img + b_img, x_txt + b_txt, w_img, w_txt, 1e-6, 1e-5, cos, sin, bound)
    assert torch.equal(with_bias.float(), added.float()) and not torch.equal(with_bias.float(), got8.float())


_INTERPRETER_PROBE = """
import json, torch
from qwen_edit_hopper.qwen_edit.kernels import qk_norm_rope_quant as qq
from qwen_edit_hopper.fp8.attention.cudnn_fp8 import rms_norm_bound

def truncate_bf16(x):  # the interpreter's fp32 -> bf16 cast
    return (x.float().view(torch.int32) & -65536).view(torch.float32)

def truncating_reference(x_img, x_txt, w_img, w_txt, eps_img, eps_txt, cos, sin, bound, b_img, b_txt):
    def stream(x, w, eps, c, s, bias):
        xf = x.float() if bias is None else truncate_bf16(x.float() + bias.float())
        y = truncate_bf16(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))
        y = truncate_bf16(y * w.float())
        re, im = y[..., 0::2], y[..., 1::2]
        c, s = c[:, None, :], s[:, None, :]
        return torch.stack((truncate_bf16(re * c - im * s), truncate_bf16(re * s + im * c)), -1).flatten(-2)
    si = x_img.shape[1]
    joint = torch.cat([stream(x_img, w_img, eps_img, cos[:si], sin[:si], b_img),
                       stream(x_txt, w_txt, eps_txt, cos[si:], sin[si:], b_txt)], dim=1)
    return (joint * (448.0 / bound)).clamp(-448, 448)

g = torch.Generator().manual_seed(0)
rows = []
for b, si, st, h, d, with_bias in ((1, 6, 3, 8, 16, False), (2, 5, 4, 12, 32, True), (2, 4, 2, 3, 8, False)):
    qkv = (torch.randn(b, si, 3, h, d, generator=g) * 2 + 0.5).bfloat16()
    x_img = qkv[:, :, 1]
    x_txt = (torch.randn(b, st, h, d, generator=g) * 3).bfloat16()
    w_img = (1.5 + 0.3 * torch.randn(d, generator=g)).bfloat16()
    w_txt = (1.2 + 0.3 * torch.randn(d, generator=g)).bfloat16()
    angles = torch.rand(si + st, d // 2, generator=g) * 6.3
    cos, sin = angles.cos(), angles.sin()
    bound = torch.tensor([float(d) ** 0.5 * 1.02 * 1.9])
    b_img = (torch.randn(h, d, generator=g) * 2).bfloat16() if with_bias else None
    b_txt = (torch.randn(h, d, generator=g) * 2).bfloat16() if with_bias else None
    out, descale = qq._qk_norm_rope_quantize_op(x_img, x_txt, w_img, w_txt, b_img, b_txt, 1e-6, 1e-5, cos, sin,
                                                bound)
    # the bound from the weights inside the kernel: the larger stream's rms_norm_bound, as the block computed it
    w_bound = torch.maximum(rms_norm_bound(w_img, d), rms_norm_bound(w_txt, d)).reshape(1)
    w_out, w_descale = qq._qk_norm_rope_quantize_op(x_img, x_txt, w_img, w_txt, b_img, b_txt, 1e-6, 1e-5, cos, sin,
                                                    None)
    for label, got, got_descale, used in (("given", out, descale, bound), ("weights", w_out, w_descale, w_bound)):
        want = truncating_reference(x_img, x_txt, w_img, w_txt, 1e-6, 1e-5, cos, sin, used, b_img, b_txt)
        want8 = want.to(torch.float8_e4m3fn)  # torch rounds to nearest even, as the kernel's emulated cast
        rows.append(dict(case=[b, si, st, h, d, with_bias], bound=label, shape=list(got.shape),
                         finite=bool(torch.isfinite(got.float()).all()),
                         same_codes=float((got.float() == want8.float()).float().mean()),
                         err=float((got.float() - want8.float()).norm() / want8.float().norm()),
                         descale_exact=bool(got_descale == used * torch.tensor(1 / 448, dtype=torch.float32))))
print(json.dumps(rows))
"""


@pytest.mark.slow
def test_kernel_matches_the_reference_under_the_interpreter():
    rows = run_probe(_INTERPRETER_PROBE, ("qwen_edit_hopper.qwen_edit.kernels.qk_norm_rope_quant",))
    assert len(rows) == 6 and {row["bound"] for row in rows} == {"given", "weights"}
    for row in rows:
        b, si, st, h, d, _ = row["case"]
        assert row["shape"] == [b, si + st, h, d] and row["finite"], row
        assert row["descale_exact"], row
        # a wrong stream, token, head or pair order gives errors of order 1; what remains are sum-order ties
        assert row["same_codes"] > 0.98 and row["err"] < 1e-2, row
