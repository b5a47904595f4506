"""cuDNN FP8 attention's quantization, its fp32 mirror and the block path, on CPU (the kernel itself: tests/gpu).

What runs here is the code users hit, with the cuDNN kernel replaced by ``reference_kernel`` only where the
backend is ``cudnn_fp8_emulated`` (the Load node's choice under ``where_unsupported: emulate``).
"""

from __future__ import annotations

import math

import pytest
import torch
from qwen_edit_hopper.fp8.attention import attention, attention_capability
from qwen_edit_hopper.fp8.attention import cudnn_fp8 as cf
from qwen_edit_hopper.qwen_edit.fast.fp8_attention import Fp8AttentionOutput, split_output
from qwen_edit_hopper.qwen_edit.fast.prequant import Prequantized
from qwen_edit_hopper.qwen_edit.fast.rope import qk_norm_rope
from qwen_edit_hopper.qwen_edit.fast_forward import batch_prompts, fast_model_fn
from test_fast_forward import build_dit, make_inputs, rel

E4M3_STEP = 2.0**-3
"""e4m3 keeps 3 mantissa bits: a rounding moves a normal value by at most half a step, 1/16 relative."""


def _exact(q, k, v):
    """float64 attention: (B, H, S, D) -> (B, S, H*D)."""
    p = torch.softmax(q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    o = p @ v.double()
    return o.transpose(1, 2).flatten(2)


def _qkv(b=1, h=2, s=256, d=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=g) for _ in range(3))
    rms = lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))  # noqa: E731
    return rms(q).bfloat16(), rms(k).bfloat16(), (v * 3 + 1).bfloat16()


def test_rms_norm_bound_holds_after_rope_even_for_one_hot_rows():
    g = torch.Generator().manual_seed(3)
    d, s = 128, 64
    x = torch.randn(1, s, 4, d, generator=g)
    x[0, :8, 0] = 0.0
    x[0, torch.arange(8), 0, torch.arange(8) * 2] = 5.0  # one-hot rows: |x_i| / rms = sqrt(D), the extreme
    weight = 1.5 + torch.randn(d, generator=g)
    angles = torch.rand(s, d // 2, generator=g) * 6.3
    y = qk_norm_rope(x.bfloat16(), weight.bfloat16(), 1e-6, angles.cos(), angles.sin())
    bound = cf.rms_norm_bound(weight.bfloat16(), d)
    assert y.abs().max().item() <= bound.item()
    assert y.abs().max().item() > 0.3 * bound.item()  # not a vacuous bound
    assert cf.rms_norm_bound(None, d) == pytest.approx(math.sqrt(d) * 1.02)


def test_quantize_with_bound_and_per_tensor():
    q, _, v = _qkv()
    bshd = v.transpose(1, 2).contiguous().transpose(1, 2)  # the DiT's memory order
    v8, dv = cf.quantize_per_tensor(bshd)
    assert v8.dtype == torch.float8_e4m3fn and v8.stride() == bshd.stride() and dv.shape == (1, 1, 1, 1)
    assert v8.float().abs().max().item() == cf.E4M3_MAX  # amax maps to 448
    back = v8.float() * dv
    assert ((back - bshd.float()).abs() <= E4M3_STEP / 2 * bshd.float().abs() + 1e-3).all()
    q8, dq = cf.quantize_with_bound(q, torch.tensor(40.0))
    assert dq.item() == pytest.approx(40.0 / cf.E4M3_MAX)
    assert ((q8.float() * dq - q.float()).abs() <= E4M3_STEP / 2 * q.float().abs() + 1e-3).all()


def test_mirror_is_fp8_accurate_and_not_a_bf16_copy():
    q, k, v = _qkv(s=300)
    exact = _exact(q, k, v)
    out = attention(q, k, v, "cudnn_fp8_emulated")
    assert out.shape == (1, 300, 256) and out.dtype == torch.bfloat16
    err = rel(out, exact)
    bf16_err = rel(attention(q, k, v, "sdpa_math"), exact)
    # e4m3 Q, K, P, V and O: a few percent (the H200 kernel: 5.8e-2 at logit std ~1); bf16: ~3e-3.
    assert 1e-2 < err < 8e-2 and err > 5 * bf16_err, (err, bf16_err)


def test_backend_checks_name_what_is_missing():
    capability = attention_capability("cudnn_fp8", "cpu")
    assert not capability.ok and "CUDA" in capability.reason
    capability = attention_capability("cudnn_fp8_emulated", "cpu")
    assert capability.ok and "mirror" in capability.reason
    frontend = cf.frontend_capability()
    assert ("cuDNN 9" in frontend.reason) if frontend.ok else (
        "pip install nvidia-cudnn-frontend" in frontend.reason or "could not" in frontend.reason)


def test_split_output_hands_fp8_rows_to_the_output_projections():
    b, s, width, si = 2, 10, 32, 6
    out8 = (torch.randn(b, s, width) * 100).to(torch.float8_e4m3fn)
    descale = torch.tensor([[0.25]])
    img, txt = split_output(Fp8AttentionOutput(out8, descale), si)
    assert isinstance(img, Prequantized) and isinstance(txt, Prequantized)
    assert img.x8.shape == (b * si, width) and txt.x8.shape == (b * (s - si), width)
    assert (img.batch, img.tokens, txt.tokens) == (b, si, s - si)
    assert img.scale.shape == (b * si, 1) and (img.scale == 0.25).all()
    value = out8.float() * 0.25
    torch.testing.assert_close(img.x8.float().reshape(b, si, width) * img.scale.reshape(b, si, 1), value[:, :si])
    torch.testing.assert_close(txt.x8.float().reshape(b, s - si, width) * 0.25, value[:, si:])
    plain = torch.randn(b, s, width)
    a, t = split_output(plain, si)
    assert a.data_ptr() == plain.data_ptr() and t.shape == (b, s - si, width)


def test_split_output_takes_the_row_scales_the_v_kernel_wrote():
    """With row scales from qwen_edit.kernels.joint_v_quant, the output projections get those tensors, not a fresh
    expansion."""
    b, s, width, si = 2, 10, 32, 6
    out8 = (torch.randn(b, s, width) * 100).to(torch.float8_e4m3fn)
    rows = torch.full((b * si, 1), 0.5), torch.full((b * (s - si), 1), 0.5)
    img, txt = split_output(Fp8AttentionOutput(out8, torch.tensor([[0.5]]), rows), si)
    assert img.scale is rows[0] and txt.scale is rows[1]
    assert img.x8.shape == (b * si, width) and txt.x8.shape == (b * (s - si), width)


@pytest.mark.parametrize("with_row_scales", [False, True], ids=["descale", "row-scales"])
def test_split_output_keeps_the_first_image_tokens_only(with_row_scales):
    """The last block: the image part holds each sample's first ``image_kept`` tokens (from an output of all S rows,
    or of those rows alone), the text part is None."""
    b, s, width, si, kept = 2, 10, 32, 6, 4
    rows = (torch.full((b * si, 1), 0.5), torch.full((b * (s - si), 1), 0.5)) if with_row_scales else None
    for out8 in ((torch.randn(b, s, width) * 100).to(torch.float8_e4m3fn),
                 (torch.randn(b, kept, width) * 100).to(torch.float8_e4m3fn)):
        img, txt = split_output(Fp8AttentionOutput(out8, torch.tensor([[0.5]]), rows), si, kept)
        assert txt is None and (img.batch, img.tokens) == (b, kept)
        assert img.scale.shape == (b * kept, 1) and (img.scale == 0.5).all()
        assert torch.equal(img.x8.view(torch.uint8).reshape(b, kept, width), out8[:, :kept].view(torch.uint8))
    plain = torch.randn(b, s, width)
    a, t = split_output(plain, si, kept)
    assert t is None and torch.equal(a, plain[:, :kept])


def test_mirror_for_the_first_query_rows_against_every_key():
    """q's first rows against all keys (the last block's attention) give the whole call's first rows, padded keys
    included."""
    q, k, v = _qkv(b=2, s=64, seed=5)
    (q8, dq), (k8, dk), (v8, dv) = cf.quantize_per_tensor(q), cf.quantize_per_tensor(k), cf.quantize_per_tensor(v)
    keys = torch.tensor([64, 50])
    whole = cf.attention_quantized(q8, k8, v8, dq, dk, dv, emulate=True, seq_len_kv=keys)
    first = cf.attention_quantized(q8[:, :, :24], k8, v8, dq, dk, dv, emulate=True, seq_len_kv=keys)
    assert first.shape == (2, 24, whole.shape[-1])
    assert torch.equal(first.view(torch.uint8), whole[:, :24].view(torch.uint8))


def test_block_path_with_the_mirror_batch1_and_batch2():
    """fast_model_fn with cudnn_fp8_emulated: the block's static q/k scales and v's per-tensor scale."""
    dit = build_dit(torch.bfloat16)
    x = make_inputs(torch.bfloat16)
    ref = fast_model_fn(dit, **x, attention_backend="sdpa")
    out = fast_model_fn(dit, **x, attention_backend="cudnn_fp8_emulated")
    assert 1e-3 < rel(out, ref) < 6e-2, rel(out, ref)
    other = make_inputs(torch.bfloat16, text_tokens=9, seed=4)
    text = batch_prompts([x, other])
    shared = {k: x[k] for k in ("timestep", "height", "width", "edit_latents")}
    both = fast_model_fn(dit, **shared, latents=x["latents"].expand(2, -1, -1, -1), **text,
                         attention_backend="cudnn_fp8_emulated")  # fmt: skip
    assert rel(both[:1], out) < 3e-2
    alone = fast_model_fn(dit, **shared, latents=x["latents"], prompt_emb=other["prompt_emb"],
                          prompt_emb_mask=other["prompt_emb_mask"], attention_backend="cudnn_fp8_emulated")  # fmt: skip
    assert rel(both[1:], alone) < 3e-2


def test_mask_padding_is_refused_for_fp8_attention():
    dit = build_dit(torch.bfloat16)
    x = make_inputs(torch.bfloat16)
    other = make_inputs(torch.bfloat16, text_tokens=9, seed=4)
    shared = {k: x[k] for k in ("timestep", "height", "width", "edit_latents")}
    with pytest.raises(ValueError, match="text_padding='mask'"):
        fast_model_fn(dit, **shared, latents=x["latents"].expand(2, -1, -1, -1), **batch_prompts([x, other]),
                      attention_backend="cudnn_fp8_emulated", text_padding="mask")  # fmt: skip


def test_mirror_compiles_with_inductor():
    """The fastest workflow compiles its blocks; on a CPU test server the mirror goes through Inductor too."""
    q, k, v = _qkv(s=64, d=32)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: attention(q, k, v, "cudnn_fp8_emulated"), fullgraph=True)
    try:
        out = compiled(q, k, v)
    finally:
        torch._dynamo.reset()
    assert rel(out, attention(q, k, v, "cudnn_fp8_emulated")) < 1e-2
