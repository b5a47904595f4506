"""The fused v bias + concatenation + per-tensor e4m3 kernels (qwen_edit/kernels/joint_v_quant.py) and their
reference, on CPU.

The reference is checked against the block's former torch path (bias add, ``torch.cat``,
``quantize_per_tensor``); the kernels run under Triton's interpreter in a subprocess against a reference
with the interpreter's truncating bf16 casts. The GPU comparison with round-to-nearest casts is in tests/gpu.
"""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.fp8.attention.cudnn_fp8 import quantize_per_tensor
from qwen_edit_hopper.qwen_edit.kernels.joint_v_quant import (
    joint_v_quant_capability,
    joint_v_quantize,
    reference_joint_v_quantize,
)
from triton_interpreter import run_probe


def _streams(b=2, si=12, st=5, h=4, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(b, si, 3, h, d, generator=g) * 2 + 0.5).bfloat16()
    v_txt = (torch.randn(b, st, 3, h, d, generator=g) * 3).bfloat16()[:, :, 2]
    b_img, b_txt = (torch.randn(h, d, generator=g) * 4).bfloat16(), (torch.randn(h * d, generator=g)).bfloat16()
    return qkv[:, :, 2], v_txt, b_img, b_txt  # strided views, as in the DiT


def test_refuses_cpu_tensors_with_the_reason():
    capability = joint_v_quant_capability(torch.device("cpu"), 128)
    assert not capability.ok and "CUDA" in capability.reason
    v_img, v_txt, _, _ = _streams()
    with pytest.raises(ValueError, match="CUDA"):
        joint_v_quantize(v_img, v_txt)


def test_reference_is_the_block_path():
    v_img, v_txt, b_img, b_txt = _streams()
    want8, want_descale = quantize_per_tensor(torch.cat([v_img + b_img, v_txt + b_txt.reshape(4, 32)], dim=1))
    got8, descale = reference_joint_v_quantize(v_img, v_txt, b_img, b_txt)
    assert got8.shape == (2, 17, 4, 32) and got8.dtype == torch.float8_e4m3fn
    assert torch.equal(got8.float(), want8.float()) and torch.equal(descale, want_descale)
    # the scale maps the joint max |v + b| to 448, and the bias changes the result
    joint = torch.cat([v_img + b_img, v_txt + b_txt.reshape(4, 32)], dim=1).float()
    assert descale.item() == pytest.approx(joint.abs().max().item() / 448, rel=1e-6)
    assert not torch.equal(reference_joint_v_quantize(v_img, v_txt)[0].float(), got8.float())


_INTERPRETER_PROBE = """
import json, torch
from qwen_edit_hopper.qwen_edit.kernels import joint_v_quant as vq

def truncate_bf16(x):  # the interpreter's fp32 -> bf16 cast
    return (x.float().view(torch.int32) & -65536).view(torch.float32)

g = torch.Generator().manual_seed(0)
rows = []
for b, si, st, h, d, with_bias in ((1, 70, 3, 8, 16, False), (2, 37, 4, 12, 32, True), (2, 4, 2, 3, 8, True)):
    qkv = (torch.randn(b, si, 3, h, d, generator=g) * 2 + 0.5).bfloat16()
    v_img = qkv[:, :, 2]
    v_txt = (torch.randn(b, st, h, d, generator=g) * 3).bfloat16()
    b_img = (torch.randn(h, d, generator=g) * 2).bfloat16() if with_bias else None
    b_txt = (torch.randn(h, d, generator=g) * 2).bfloat16() if with_bias else None
    out, amax, descale, scale_o, img_rows, txt_rows = vq._joint_v_quantize_op(v_img, v_txt, b_img, b_txt)
    joint = torch.cat([v_img.float() if b_img is None else truncate_bf16(v_img.float() + b_img.float()),
                       v_txt.float() if b_txt is None else truncate_bf16(v_txt.float() + b_txt.float())], dim=1)
    want_amax = joint.abs().max()
    want_descale = want_amax.clamp_min(1e-12) * torch.tensor(1.0 / 448.0, dtype=torch.float32)
    want8 = (joint * (448.0 / want_amax)).clamp(-448, 448).to(torch.float8_e4m3fn)
    rows.append(dict(case=[b, si, st, h, d, with_bias], shape=list(out.shape), contiguous=out.is_contiguous(),
                     amax=float(amax.reshape(())), want_amax=float(want_amax),
                     # torch on CUDA divides by a scalar as a multiplication by its float32 reciprocal
                     descale=float(descale.reshape(())), want_descale=float(want_descale),
                     scale_o=float(scale_o.reshape(())), want_scale_o=float(want_descale.reciprocal()),
                     row_shapes=[list(img_rows.shape), list(txt_rows.shape)],
                     rows_all_descale=bool((img_rows == descale.reshape(())).all() and
                                           (txt_rows == descale.reshape(())).all()),
                     same_codes=float((out.float() == want8.float()).float().mean())))
print(json.dumps(rows))
"""


@pytest.mark.slow
def test_kernels_match_the_reference_under_the_interpreter():
    rows = run_probe(_INTERPRETER_PROBE, ("qwen_edit_hopper.qwen_edit.kernels.joint_v_quant",))
    assert len(rows) == 3
    for row in rows:
        b, si, st, h, d, _ = row["case"]
        assert row["shape"] == [b, si + st, h, d] and row["contiguous"], row
        # the max pass covers every token (70 + 3 tokens span three programs of 32) and head group exactly
        assert row["amax"] == row["want_amax"], row
        # a wrong stream, token or head order gives mismatches everywhere
        assert row["same_codes"] == 1.0, row
        # the scalars the cast kernel writes for cuDNN and the output projections: IEEE divisions, as torch does
        assert row["descale"] == row["want_descale"] and row["scale_o"] == row["want_scale_o"], row
        assert row["row_shapes"] == [[b * si, 1], [b * st, 1]] and row["rows_all_descale"], row


def test_stream_biases_fill_a_missing_one_with_zeros():
    """What the q / k / v kernels receive as biases (qwen_edit.kernels.qk_norm_rope_quant.stream_biases)."""
    from qwen_edit_hopper.qwen_edit.kernels.qk_norm_rope_quant import stream_biases

    v_img, _, b_img, b_txt = _streams()
    assert stream_biases(None, None, v_img) == (None, None)
    img, txt = stream_biases(None, b_txt.float(), v_img)  # flat (H * Dh,) fp32 -> (H, Dh) in v's dtype
    assert img.shape == txt.shape == (4, 32) and img.dtype == txt.dtype == torch.bfloat16
    assert not img.any() and torch.equal(txt, b_txt.reshape(4, 32)) and txt.is_contiguous()
    img, txt = stream_biases(b_img, None, v_img)
    assert torch.equal(img, b_img) and not txt.any()
