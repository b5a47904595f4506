#!/usr/bin/env python3
"""The fused QK RMSNorm + RoPE + e4m3 kernel at the DiT's shape: the shipped launch against a tried one.

Full-size shape of one call (q or k of one block): 1024x1024 edit with one reference image, 8192 image +
300 text tokens, 24 heads x 128, both streams strided views into fused QKV outputs (row stride 9216), the
projection biases added in the kernel, batch 1 and 2. Rows: the shipped kernel (``fp8/qk_norm_quant.py``: one
token x 8 heads per program, a branch per stream), then a tried variant kept here (several tokens x 8 heads per
program, the stream chosen per row by selects) at each launch shape (tokens per program x warps; 16 tokens
spill registers in ptxas, so they are not timed). Per row: microseconds per call (CUDA graph of 50 calls,
replayed, median of 5), bytes moved per second (bf16 read + e4m3 written), and the fraction of e4m3 codes
equal to the torch reference and to the shipped kernel.

Outcome on an H100 (docs/benchmarks.md, seventh session): the shipped launch was the fastest; the tried
kernel was not adopted. No model, no diffsynth. Run from the repository root on an H100 / H200 (JSON in
``$OUT/qk_quant.json``, table last)::

    python3 bench/qk_quant_bench.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import harness_core as hc
from pack import load_pack

load_pack()
from qwen_edit_hopper.fp8.attention.triton_fp8 import _to_e4m3  # noqa: E402
from qwen_edit_hopper.qwen_edit.kernels import qk_norm_rope_quant as qq  # noqa: E402

H, D, S_IMG, S_TXT = 24, 128, 8192, 300
SHAPES = [(t, w) for t in (1, 2, 4) for w in (2, 4, 8)] + [(8, 4), (8, 8)]  # 16 tokens spill (ptxas)


@triton.jit
def _multi_token_kernel(
    img_ptr,
    txt_ptr,
    w_img_ptr,
    w_txt_ptr,
    b_img_ptr,
    b_txt_ptr,
    cos_ptr,
    sin_ptr,
    bound_ptr,
    out_ptr,
    n_rows,
    s_img,
    s_joint,
    heads,
    sib,
    sis,
    sih,
    stb,
    sts,
    sth,
    eps_img,
    eps_txt,
    HAS_BIAS: tl.constexpr,  # noqa: N803
    HG: tl.constexpr,  # noqa: N803
    BT: tl.constexpr,  # noqa: N803
    HEAD_DIM: tl.constexpr,  # noqa: N803
    INTERPRET: tl.constexpr,  # noqa: N803
):
    """The tried variant. One program per BT joint tokens x HG heads: a (BT * HG, HEAD_DIM) tile, each row one
    head of one token; a row takes the image or the text stream's pointers, weight, bias and eps by its token."""
    first = tl.program_id(0).to(tl.int64) * BT
    group = tl.program_id(1)
    lanes = tl.arange(0, BT * HG)
    token = first + lanes // HG  # flat (b, t) index into the joint sequence
    valid = token < n_rows
    token = tl.where(valid, token, 0)
    hs = group * HG + lanes % HG
    b = token // s_joint
    t = token % s_joint
    is_img = t < s_img
    dims = tl.arange(0, HEAD_DIM)
    img_rows = img_ptr + b * sib + t * sis + hs * sih
    txt_rows = txt_ptr + b * stb + tl.where(is_img, 0, t - s_img) * sts + hs * sth
    ptrs = tl.where(is_img, img_rows, txt_rows)[:, None] + dims[None, :]
    x = tl.load(ptrs, mask=valid[:, None], other=0.0)
    tile = hs[:, None] * HEAD_DIM + dims[None, :]
    if HAS_BIAS:  # the projection's bias, added in bf16 as the linear layer adds it
        bias = tl.load(tl.where(is_img[:, None], b_img_ptr + tile, b_txt_ptr + tile))
        x = (x.to(tl.float32) + bias.to(tl.float32)).to(tl.bfloat16)
    x = x.to(tl.float32)
    eps = tl.where(is_img, eps_img, eps_txt)
    rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)
    y = (x * rms[:, None]).to(tl.bfloat16).to(tl.float32)
    w = tl.where(is_img[:, None], tl.load(w_img_ptr + dims)[None, :], tl.load(w_txt_ptr + dims)[None, :])
    y = (y * w.to(tl.float32)).to(tl.bfloat16).to(tl.float32)
    re, im = tl.split(tl.reshape(y, (BT * HG, HEAD_DIM // 2, 2)))
    half = t[:, None] * (HEAD_DIM // 2) + tl.arange(0, HEAD_DIM // 2)[None, :]
    c = tl.load(cos_ptr + half)
    s = tl.load(sin_ptr + half)
    o_re = (re * c - im * s).to(tl.bfloat16).to(tl.float32)
    o_im = (re * s + im * c).to(tl.bfloat16).to(tl.float32)
    o = tl.reshape(tl.join(o_re, o_im), (BT * HG, HEAD_DIM))
    inv = 448.0 / tl.load(bound_ptr)
    q = tl.clamp(o * inv, -448.0, 448.0)
    out = out_ptr + token[:, None] * heads * HEAD_DIM + tile
    tl.store(out, _to_e4m3(q, INTERPRET), mask=valid[:, None])


def multi_token(x_img, x_txt, w_img, w_txt, eps_img, eps_txt, cos, sin, bound, b_img, b_txt, block_tokens, num_warps):
    """The tried kernel, launched as the pack launches its own (biases given, 8 heads per program)."""
    b, si, h, d = x_img.shape
    sj = si + x_txt.shape[1]
    out = torch.empty((b, sj, h, d), dtype=torch.float8_e4m3fn, device=x_img.device)
    rows = b * sj
    _multi_token_kernel[(triton.cdiv(rows, block_tokens), h // 8)](
        x_img, x_txt, w_img, w_txt, b_img, b_txt, cos, sin, bound.reshape(1), out, rows, si, sj, h,
        *x_img.stride()[:3], *x_txt.stride()[:3], eps_img, eps_txt, HAS_BIAS=True, HG=8, BT=block_tokens, HEAD_DIM=d,
        INTERPRET=False, num_warps=num_warps,
    )  # fmt: skip
    return out


def inputs(batch: int, device: torch.device):
    g = torch.Generator(device=device).manual_seed(batch)
    qkv_img = (torch.randn(batch, S_IMG, 3, H, D, generator=g, device=device) * 2 + 0.5).bfloat16()
    qkv_txt = (torch.randn(batch, S_TXT, 3, H, D, generator=g, device=device) * 3).bfloat16()
    w_img = (1.5 + 0.3 * torch.randn(D, generator=g, device=device)).bfloat16()
    w_txt = (1.2 + 0.3 * torch.randn(D, generator=g, device=device)).bfloat16()
    angles = torch.rand(S_IMG + S_TXT, D // 2, generator=g, device=device) * 6.3
    bound = torch.tensor(D**0.5 * 1.02 * 2.4, device=device)
    b_img, b_txt = ((torch.randn(H, D, generator=g, device=device) * 2).bfloat16() for _ in range(2))
    return (qkv_img[:, :, 0], qkv_txt[:, :, 0], w_img, w_txt, 1e-6, 1e-6, angles.cos().contiguous(),
            angles.sin().contiguous(), bound, b_img, b_txt)  # fmt: skip


def time_us(fn, calls: int = 50) -> float:
    """us per call of ``fn()``: ``calls`` calls in one CUDA graph, replayed (median)."""
    return hc.graph_ms_per_call(lambda i: fn(), calls, reps=5) * 1000


def main() -> int:
    device = torch.device("cuda")
    out_dir = Path(os.environ.get("OUT", "bench/out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for batch in (1, 2):
        args = inputs(batch, device)
        want = qq.reference_qk_norm_rope_quantize(*args).float()
        before = qq.qk_norm_rope_quantize(*args)
        moved = batch * (S_IMG + S_TXT) * H * D * 3  # bf16 read + e4m3 written
        candidates = [("shipped kernel (1 token, 4 warps)", lambda a=args: qq.qk_norm_rope_quantize(*a))]
        candidates += [(f"tried: {t} tokens, {w} warps", lambda a=args, t=t, w=w: multi_token(*a, t, w))
                       for t, w in SHAPES]  # fmt: skip
        for label, fn in candidates:
            try:
                got = fn().float()
                us = time_us(fn)
                row = {"batch": batch, "shape": label, "us": round(us, 2), "GB/s": round(moved / us / 1e3),
                       "same_as_reference": float((got == want).float().mean()),
                       "same_as_shipped": float((got == before.float()).float().mean())}  # fmt: skip
            except Exception as exc:
                row = {"batch": batch, "shape": label, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            rows.append(row)
            print(row, flush=True)
            (out_dir / "qk_quant.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}))
    print(f"\n{'batch':>5} {'launch shape':36s} {'us':>8} {'GB/s':>6} {'=ref':>7} {'=shipped':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['batch']:5d} {r['shape']:36s} {r['error'][:60]}")
        else:
            print(
                f"{r['batch']:5d} {r['shape']:36s} {r['us']:8.2f} {r['GB/s']:6d} {r['same_as_reference']:7.4f} "
                f"{r['same_as_shipped']:7.4f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
