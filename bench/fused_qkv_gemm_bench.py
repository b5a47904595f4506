#!/usr/bin/env python3
"""Can one Triton GEMM do the image stream's Q/K/V projection and write FP8 attention's e4m3 inputs directly?

Shipped, per block: three cuBLASLt GEMMs (8192 x 3072 -> 3072 each) write q, k, v in bf16 (150 MB); the QK
kernel (``fp8.qk_norm_quant``) reads q and k back for bias + RMSNorm + RoPE + the static-bound e4m3 cast; v's
two kernels (``fp8.v_quant``) read v twice (its max, then the cast). Here one persistent TMA GEMM (N = 9216)
does it in the epilogue: a 128-column tile is one head, so RMSNorm and RoPE are tile-local; q and k take the
static bound they already use; v takes a Cauchy-Schwarz bound known before the GEMM,
``(max_t ||x[t]|| * max_j ||Wv[j]|| + max |bv|) * 1.02`` (the text stream's bound likewise; the larger one).
The text stream's 300 tokens still go through the QK kernel (text rows only) and a small cast.

Timed in CUDA graphs (weights streamed from HBM), per config; errors of the dequantized q, k, v against float64
from the same e4m3 operands, for the shipped path and this one. Run from the repository root on an H100 / H200
(JSON in ``$OUT/fused_qkv_gemm.json``, table last)::

    python3 bench/fused_qkv_gemm_bench.py
    python3 bench/fused_qkv_gemm_bench.py --compile-only
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from pack import load_pack

load_pack()
from qwen_edit_hopper.fp8.gelu_gemm import _tile_ids  # noqa: E402  (the shipped kernel's tile order)

CALLS = 12
E4M3_MAX = 448.0
HEADS, HEAD_DIM = 24, 128
D_MODEL = HEADS * HEAD_DIM
# (BM, BN, BK, warps, stages, group_m, flatten); BN is one head
CONFIGS = (
    (128, 128, 128, 8, 4, 8, True),
    (128, 128, 128, 8, 4, 8, False),
    (128, 128, 128, 8, 3, 8, True),
    (128, 128, 128, 4, 4, 8, True),
    (64, 128, 128, 4, 5, 8, True),
)


@triton.jit
def qkv_gemm_kernel(a_desc, b_desc, out_desc, cos_desc, sin_desc, xs_ptr, ws_ptr, bias_ptr, normw_ptr,
                    inv_ptr, M, N, K, s_img, s_joint, plane, eps,  # noqa: N803
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,  # noqa: N803
                    NUM_SMS: tl.constexpr, HEAD_DIM: tl.constexpr, D_MODEL: tl.constexpr,  # noqa: N803
                    FLATTEN: tl.constexpr):  # noqa: N803
    """Image-stream Q/K/V: e4m3 q / k (bias, RMSNorm, RoPE, static bound) and v (bias, bound) into the joint
    sequences, stacked as out (3 * plane, D_MODEL) with plane = B * s_joint: GEMM row m = b * s_img + t goes to
    row region * plane + b * s_joint + t. Needs s_img % BM == 0 (a tile never spans two samples) and
    BN == HEAD_DIM (a tile is one head). cos_desc / sin_desc: (s_joint, HEAD_DIM) float32 tables expanded to
    (cos, cos) and (-sin, sin) per channel pair."""
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile_id in tl.range(start, num_pid_m * num_pid_n, NUM_SMS, flatten=FLATTEN):
        pid_m, pid_n = _tile_ids(tile_id, num_pid_m, num_pid_n, GROUP_M)
        om = pid_m * BM
        on = pid_n * BN
        acc = tl.zeros((BM, BN), tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([om, ki * BK])
            b = b_desc.load([on, ki * BK])
            acc = tl.dot(a, b.T, acc)
        rows = om + tl.arange(0, BM)
        cols = on + tl.arange(0, BN)
        xs = tl.load(xs_ptr + rows)
        ws = tl.load(ws_ptr + cols)
        y = (acc * xs[:, None] * ws[None, :]).to(tl.bfloat16).to(tl.float32)  # the GEMM's bf16 output
        y = (y + tl.load(bias_ptr + cols).to(tl.float32)[None, :]).to(tl.bfloat16).to(tl.float32)  # bias in bf16
        region = on // D_MODEL
        t0 = om % s_img
        rstd = tl.rsqrt(tl.sum(y * y, axis=1) / HEAD_DIM + eps)
        yn = (y * rstd[:, None]).to(tl.bfloat16).to(tl.float32)
        w = tl.load(normw_ptr + (region % 2) * HEAD_DIM + tl.arange(0, HEAD_DIM)).to(tl.float32)
        yn = (yn * w[None, :]).to(tl.bfloat16).to(tl.float32)
        re, im = tl.split(tl.reshape(yn, (BM, BN // 2, 2)))
        swapped = tl.reshape(tl.join(im, re), (BM, BN))  # (x1, x0) per pair
        c2 = cos_desc.load([t0, 0])
        s2 = sin_desc.load([t0, 0])
        o = (yn * c2 + swapped * s2).to(tl.bfloat16).to(tl.float32)
        o = tl.where(region < 2, o, y)
        inv = tl.load(inv_ptr + region)
        code = tl.clamp(o * inv, -448.0, 448.0).to(tl.float8e4nv)
        out_desc.store([region * plane + (om // s_img) * s_joint + t0, on % D_MODEL], code)


def launch(x8, xs, w8, ws, bias, normw, cos2, sin2, inv, out, s_img, s_joint, eps, cfg, num_sms):
    """out: (3, B * s_joint, D_MODEL) e4m3; cos2 / sin2: (s_joint, HEAD_DIM) float32 expanded tables."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, warps, stages, group_m, flatten = cfg
    m, k = x8.shape
    n = w8.shape[0]
    plane = out.shape[1]
    a_desc = TensorDescriptor.from_tensor(x8, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(w8, [bn, bk])
    out_desc = TensorDescriptor.from_tensor(out.view(3 * plane, D_MODEL), [bm, bn])
    cos_desc = TensorDescriptor.from_tensor(cos2, [bm, HEAD_DIM])
    sin_desc = TensorDescriptor.from_tensor(sin2, [bm, HEAD_DIM])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    qkv_gemm_kernel[(min(num_sms, tiles),)](
        a_desc, b_desc, out_desc, cos_desc, sin_desc, xs, ws, bias, normw, inv, m, n, k, s_img, s_joint, plane, eps,
        BM=bm, BN=bn, BK=bk, GROUP_M=group_m, NUM_SMS=num_sms, HEAD_DIM=HEAD_DIM, D_MODEL=D_MODEL, FLATTEN=flatten,
        num_warps=warps, num_stages=stages)


def compile_only() -> None:
    from fused_up_gemm_bench import ptxas_report
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for cfg in CONFIGS:
        bm, bn, bk, warps, stages, group_m, flatten = cfg
        sig = {"a_desc": f"tensordesc<fp8e4nv[{bm}, {bk}]>", "b_desc": f"tensordesc<fp8e4nv[{bn}, {bk}]>",
               "out_desc": f"tensordesc<fp8e4nv[{bm}, {bn}]>", "cos_desc": f"tensordesc<fp32[{bm}, {HEAD_DIM}]>",
               "sin_desc": f"tensordesc<fp32[{bm}, {HEAD_DIM}]>", "xs_ptr": "*fp32", "ws_ptr": "*fp32",
               "bias_ptr": "*bf16", "normw_ptr": "*bf16", "inv_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
               "s_img": "i32", "s_joint": "i32", "plane": "i32", "eps": "fp32"}
        const = {"BM": bm, "BN": bn, "BK": bk, "GROUP_M": group_m, "NUM_SMS": 132, "HEAD_DIM": HEAD_DIM,
                 "D_MODEL": D_MODEL, "FLATTEN": flatten}
        sig.update(dict.fromkeys(const, "constexpr"))
        try:
            kern = triton.compile(ASTSource(fn=qkv_gemm_kernel, signature=sig, constexprs=const),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
            report = ptxas_report(kern.asm["ptx"])
            print(f"{cfg}: regs {report['regs']} spills {report['spills']} smem {kern.metadata.shared} "
                  f"serialized {report['serialized']}")
        except Exception as exc:  # a survey: report and go on
            print(f"{cfg}: ERROR {type(exc).__name__}: {str(exc)[:600]}")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    args = parser.parse_args()
    if args.compile_only:
        compile_only()
        return 0
    import harness_core as hc
    from qwen_edit_hopper.fp8 import cublaslt_gemm as lt
    from qwen_edit_hopper.fp8.qk_norm_quant import qk_norm_rope_quantize_scaled
    from qwen_edit_hopper.fp8.quant import quantize_rowwise
    from qwen_edit_hopper.fp8.v_quant import joint_v_quantize_scales

    torch.manual_seed(0)
    dev = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    bsz, s_img, s_txt, k = args.batch, 8192, 300, 3072
    s_joint = s_img + s_txt
    m = bsz * s_img
    eps = 1e-6

    def rows_quantized(rows):
        x = torch.randn(rows, k, device=dev)
        x[:, :8] *= 20
        return quantize_rowwise(x.to(torch.bfloat16))

    x8, xs = rows_quantized(m)
    t8, ts = rows_quantized(bsz * s_txt)
    copies = max(2, -(-3 * l2 // (3 * D_MODEL * k)))
    ring = []
    for _ in range(copies):
        w8, wsc = quantize_rowwise((torch.randn(3 * D_MODEL, k, device=dev) * 0.02).to(torch.bfloat16))
        ring.append((w8.contiguous(), wsc.reshape(-1).contiguous().float()))
    w8, wsv = ring[0]
    bias = (torch.randn(3 * D_MODEL, device=dev) * 0.1).to(torch.bfloat16)
    txt_w8, txt_ws = quantize_rowwise((torch.randn(3 * D_MODEL, k, device=dev) * 0.02).to(torch.bfloat16))
    txt_bias = (torch.randn(3 * D_MODEL, device=dev) * 0.1).to(torch.bfloat16)
    norm_img = (1 + 0.1 * torch.randn(2, HEAD_DIM, device=dev)).to(torch.bfloat16)  # norm_q, norm_k
    norm_txt = (1 + 0.1 * torch.randn(2, HEAD_DIM, device=dev)).to(torch.bfloat16)
    ang = torch.rand(s_joint, HEAD_DIM // 2, device=dev) * 6.28
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    xs_flat = xs.reshape(-1).contiguous().float()
    txt_out = lt.cublaslt_rowwise_mm(t8, ts, txt_w8, txt_ws, True).reshape(bsz, s_txt, 3, HEADS, HEAD_DIM)

    # static bounds: q / k from the norm weights (the shipped kernel's rule), v by Cauchy-Schwarz
    qk_factor = HEAD_DIM ** 0.5 * 1.02
    bound_q = max(norm_img[0].float().abs().max().item(), norm_txt[0].float().abs().max().item()) * qk_factor
    bound_k = max(norm_img[1].float().abs().max().item(), norm_txt[1].float().abs().max().item()) * qk_factor

    def v_bound(x8_, xs_, w8_, ws_, b_):
        x_norm = (x8_.float().pow(2).sum(1).sqrt() * xs_.reshape(-1)).max()
        wv = w8_[2 * D_MODEL:].float().pow(2).sum(1).sqrt() * ws_.reshape(-1)[2 * D_MODEL:]
        return ((x_norm * wv.max() + b_[2 * D_MODEL:].float().abs().max()) * 1.02).item()

    bound_v = max(v_bound(x8, xs, w8, wsv, bias), v_bound(t8, ts, txt_w8, txt_ws, txt_bias))
    inv = torch.tensor([E4M3_MAX / bound_q, E4M3_MAX / bound_k, E4M3_MAX / bound_v], device=dev)
    img_norms = (x8.float().pow(2).sum(1).sqrt() * xs_flat)  # what the LayerNorm kernel would hand over

    def shipped(i):
        wi, si_ = ring[i % copies]
        outs = [lt.cublaslt_rowwise_mm(x8, xs, wi[j * D_MODEL:(j + 1) * D_MODEL], si_[j * D_MODEL:(j + 1) * D_MODEL]
                                       .reshape(-1, 1), True).reshape(bsz, s_img, HEADS, HEAD_DIM) for j in range(3)]
        bq, bk_, bv = (bias[j * D_MODEL:(j + 1) * D_MODEL] for j in range(3))
        tq, tk, tv = (txt_bias[j * D_MODEL:(j + 1) * D_MODEL] for j in range(3))
        q8, dq = qk_norm_rope_quantize_scaled(outs[0], txt_out[:, :, 0], norm_img[0], norm_txt[0], eps, eps, cos, sin,
                                              bq, tq)
        k8, dk = qk_norm_rope_quantize_scaled(outs[1], txt_out[:, :, 1], norm_img[1], norm_txt[1], eps, eps, cos, sin,
                                              bk_, tk)
        v = joint_v_quantize_scales(outs[2], txt_out[:, :, 2], bv, tv)
        return q8, dq, k8, dk, v.v8, v.descale

    out = torch.empty(3, bsz * s_joint, D_MODEL, device=dev, dtype=torch.float8_e4m3fn)
    q8n, k8n, v8n = (out[j].view(bsz, s_joint, HEADS, HEAD_DIM) for j in range(3))
    cos2 = cos.repeat_interleave(2, dim=1).contiguous()
    sin2 = torch.stack((-sin, sin), dim=-1).flatten(1).contiguous()
    normw = norm_img.reshape(-1).contiguous()
    txt_bias_v = txt_bias[2 * D_MODEL:].reshape(HEADS, HEAD_DIM)

    def fused(i, cfg):
        wi, si_ = ring[i % copies]
        vmax = img_norms.amax()  # the max the v bound needs (the norms would come from the LayerNorm kernel)
        launch(x8, xs_flat, wi, si_, bias, normw, cos2, sin2, inv, out, s_img, s_joint, eps, cfg, num_sms)
        tq, tk = (txt_bias[j * D_MODEL:(j + 1) * D_MODEL] for j in range(2))
        empty = txt_out[:, :0, 0]
        q_t, _ = qk_norm_rope_quantize_scaled(empty, txt_out[:, :, 0], norm_img[0], norm_txt[0], eps, eps,
                                              cos[s_img:], sin[s_img:], None, tq)
        k_t, _ = qk_norm_rope_quantize_scaled(empty, txt_out[:, :, 1], norm_img[1], norm_txt[1], eps, eps,
                                              cos[s_img:], sin[s_img:], None, tk)
        v_t = ((txt_out[:, :, 2] + txt_bias_v).float() * inv[2]).clamp(-448, 448).to(torch.float8_e4m3fn)
        return vmax, q_t, k_t, v_t

    # float64 references of the image rows
    y = ((x8.double() * xs_flat.double()[:, None]) @ (w8.double() * wsv.double()[:, None]).t()).to(torch.bfloat16)
    y = y.reshape(bsz, s_img, 3, HEADS, HEAD_DIM)

    def exact_qk(j):
        z = y[:, :, j].double() + bias[j * D_MODEL:(j + 1) * D_MODEL].double().reshape(HEADS, HEAD_DIM)
        z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) * norm_img[j].double()
        pr = z.unflatten(-1, (-1, 2))
        c, s = cos[:s_img].double()[:, None, :], sin[:s_img].double()[:, None, :]
        return torch.stack((pr[..., 0] * c - pr[..., 1] * s, pr[..., 0] * s + pr[..., 1] * c), -1).flatten(-2)

    exact = [exact_qk(0), exact_qk(1), y[:, :, 2].double() + bias[2 * D_MODEL:].double().reshape(HEADS, HEAD_DIM)]
    sq8, sdq, sk8, sdk, sv8, sdv = shipped(0)
    err_shipped = [rel(t8_[:, :s_img].double() * d.double().reshape(()), e)
                   for t8_, d, e in ((sq8, sdq, exact[0]), (sk8, sdk, exact[1]), (sv8, sdv, exact[2]))]
    rows = [{"variant": "shipped: 3 x cuBLASLt + QK kernel x2 + v kernels", "err_qkv": err_shipped,
             "ms": hc.graph_ms_per_call(shipped, CALLS)},
            {"variant": "shipped GEMMs alone (3 x cuBLASLt)",
             "ms": hc.graph_ms_per_call(lambda i: [lt.cublaslt_rowwise_mm(
                 x8, xs, ring[i % copies][0][j * D_MODEL:(j + 1) * D_MODEL],
                 ring[i % copies][1][j * D_MODEL:(j + 1) * D_MODEL].reshape(-1, 1), True) for j in range(3)], CALLS)}]
    descales = (1 / inv).double()
    for cfg in CONFIGS:
        label = f"fused Triton {cfg}"
        try:
            fused(0, cfg)
            torch.cuda.synchronize()
            errs = [rel(t8_[:, :s_img].double() * descales[j], exact[j]) for j, t8_ in enumerate((q8n, k8n, v8n))]
            same_q = (q8n[:, :s_img].view(torch.uint8) == sq8[:, :s_img].view(torch.uint8)).float().mean().item()
            ms = hc.graph_ms_per_call(lambda i, cfg=cfg: fused(i, cfg), CALLS)
            rows.append({"variant": label, "ms": ms, "err_qkv": errs, "q_codes_equal": same_q})
        except Exception as exc:  # a survey: report and go on
            rows.append({"variant": label, "error": f"{type(exc).__name__}: {str(exc)[:400]}"})
        hc.free_memory()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": dt.date.today().isoformat(), "batch": bsz, "rows": rows,
              "v_bound_over_amax": bound_v / float(sdv.item() * E4M3_MAX)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"fused_qkv_gemm_b{bsz}.json").write_text(json.dumps(result, indent=1))
    print(f"{result['gpu']}, torch {result['torch']}, triton {result['triton']}, batch {bsz}; "
          f"v bound / v amax = {result['v_bound_over_amax']:.1f}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:52s} ERROR {r['error']}")
            continue
        errs = " ".join(f"{e:.2e}" for e in r.get("err_qkv", []))
        print(f"{r['variant']:52s} {r['ms'] * 1e3:8.1f} us  err q k v {errs}  q codes equal "
              f"{r.get('q_codes_equal', float('nan')):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
