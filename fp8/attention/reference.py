"""Plain-torch mirror of the Triton 8-bit attention's numerics (any device, slow, for tests and studies).

``reference_quantized_attention`` quantizes exactly as ``triton_fp8._quantize_kernel``
does (same scales, same rounding, same padding) and runs the same block-by-block
online softmax as ``_attn_kernel``, in float64 between the quantization points.
What it does not mirror: fp32 rounding inside the kernel (summation order of the
statistics, ex2.approx), which can move a P or V element across a rounding
boundary now and then; kernel and reference agree to ~1e-3 relative, far under
the quantization error itself (~1e-2).

``reference_attention`` is the exact answer: float64 softmax(q k^T / sqrt(D)) v.
"""

from __future__ import annotations

import math

import torch

__all__ = ["quantize_reference", "reference_attention", "reference_quantized_attention"]

QUANT_BLOCK = 128
_QMAX = {"int8": 127.0, "e4m3": 448.0}
AMAX_FLOOR = 1e-30
LOG2_127 = 6.988684686772166


def _quant(x: torch.Tensor, inv: torch.Tensor, fmt: str) -> torch.Tensor:
    """x * inv rounded as the kernel does; returned as float32 holding the 8-bit values."""
    y = x * inv
    if fmt == "int8":
        return torch.round(y.clamp(-127.0, 127.0))  # nearest, ties to even, like the kernel's magic-number add
    return y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32)


def quantize_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_format: str, pv_format: str
) -> dict[str, torch.Tensor]:
    """The kernel's quantized operands, unpadded except K (padded to a multiple of 128 tokens).

    q, k, v: (B, H, S, D). Returns float32 tensors: q8 (B,H,S,D), qs (B,H,S,1) = Q scale (without
    sm_scale*log2 e), k8 (B,H,S_pad,D), ks (B,H,S_pad/128,1), and for 8-bit PV v8 (B,H,S,D),
    vs (B,H,1,D), vm (B,H,1,D).
    """
    b, h, s, d = q.shape
    qmax = _QMAX[qk_format]
    q32, k32, v32 = q.float(), k.float(), v.float()
    q_amax = q32.abs().amax(-1, keepdim=True).clamp_min(AMAX_FLOOR)
    out = {"q8": _quant(q32, qmax / q_amax, qk_format), "qs": q_amax / qmax}
    s_pad = math.ceil(s / QUANT_BLOCK) * QUANT_BLOCK
    kc = k32 - k32.sum(2, keepdim=True) * (1.0 / s)
    kc = torch.nn.functional.pad(kc, (0, 0, 0, s_pad - s)).view(b, h, s_pad // QUANT_BLOCK, QUANT_BLOCK, d)
    k_amax = kc.abs().amax((-1, -2), keepdim=True).clamp_min(AMAX_FLOOR)
    out["k8"] = _quant(kc, qmax / k_amax, qk_format).view(b, h, s_pad, d)
    out["ks"] = (k_amax / qmax).view(b, h, s_pad // QUANT_BLOCK, 1)
    if pv_format != "bf16":
        vmax_q = 127.0 if pv_format == "int8" else 448.0
        vmean = v32.sum(2, keepdim=True) * (1.0 / s)
        v_amax = torch.maximum(v32.amax(2, keepdim=True) - vmean, vmean - v32.amin(2, keepdim=True))
        v_amax = v_amax.clamp_min(AMAX_FLOOR)
        out["v8"] = _quant(v32 - vmean, vmax_q / v_amax, pv_format)
        out["vs"] = v_amax / vmax_q
        out["vm"] = vmean
    return out


def reference_quantized_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qk_format: str = "int8",
    pv_format: str = "bf16",
    block_n: int = 128,
) -> torch.Tensor:
    """What ``triton_fp8.fp8_attention`` computes, in torch: (B, H, S, D) in, (B, S, H*D) float32 out."""
    b, h, s, d = q.shape
    t = quantize_reference(q, k, v, qk_format, pv_format)
    f64 = torch.float64
    q8 = t["q8"].to(f64)
    c_row = t["qs"].to(f64) * ((1.0 / math.sqrt(d)) * 1.4426950408889634)  # (B,H,S,1)
    k8 = t["k8"][:, :, :s].to(f64)
    ks_tok = t["ks"].repeat_interleave(QUANT_BLOCK, dim=2)[:, :, :s].to(f64)  # (B,H,S,1)
    v_op = v.to(f64) if pv_format == "bf16" else t["v8"].to(f64)
    m = torch.full((b, h, s, 1), -math.inf, dtype=f64, device=q.device)
    l_sum = torch.zeros((b, h, s, 1), dtype=f64, device=q.device)
    acc = torch.zeros((b, h, s, d), dtype=f64, device=q.device)
    for j in range(0, s, block_n):
        kb = k8[:, :, j : j + block_n]
        c = c_row * ks_tok[:, :, j : j + 1]  # one K scale per step (block_n divides 128)
        sc = (q8 @ kb.transpose(-1, -2)) * c
        blk_max = sc.amax(-1, keepdim=True)
        m_new = torch.maximum(m, blk_max)
        alpha = torch.exp2(m - m_new)
        vb = v_op[:, :, j : j + block_n]
        if pv_format == "int8":
            p = torch.exp2(sc - blk_max + LOG2_127)
            beta = torch.exp2(blk_max - m_new)
            l_sum = l_sum * alpha + p.sum(-1, keepdim=True) * beta
            p8 = torch.round(p.clamp(max=127.0))
            acc = acc * alpha + (p8 @ vb) * beta
        elif pv_format == "e4m3":
            p = torch.exp2(sc - m_new + 8.0)
            l_sum = l_sum * alpha + p.sum(-1, keepdim=True)
            p8 = p.float().to(torch.float8_e4m3fn).to(f64)
            acc = acc * alpha + p8 @ vb
        else:
            p = torch.exp2(sc - m_new)
            l_sum = l_sum * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + p.to(torch.bfloat16).to(f64) @ vb
        m = m_new
    out = acc / l_sum
    if pv_format != "bf16":
        out = out * t["vs"].to(f64) + t["vm"].to(f64)
    return out.transpose(1, 2).reshape(b, s, h * d).to(torch.float32)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact non-causal attention in float64: (B, H, S, D) in, (B, S, H*D) float64 out."""
    b, h, s, d = q.shape
    out = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    return out.transpose(1, 2).reshape(b, s, h * d)
