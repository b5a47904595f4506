#!/usr/bin/env python3
"""The text stream's MLP down-projection (M = 300, 12288 -> 3072): cuBLASLt against the pack's small-M kernel
split over K.

Its 24 column tiles leave most of the 132 SMs idle without a K split (docs/experiments/forward.md, twelfth
session). Variants: the pack's workspace-free cuBLASLt call (``fp8.cublaslt_gemm``, what the layer runs
without a split), and ``fp8.small_m_gemm`` with K splits of 1-4 over a few tiles, the float32 partials
summed by torch afterwards (a separate kernel here; in the model Inductor folds the sum into the residual
update). Each is a CUDA graph of 40 calls over weight copies larger than the L2 cache (weights from HBM).
Error: relative Frobenius difference to the exact product (float64 of the same e4m3 operands and scales);
fast accumulation without promotion loses precision over a long K, so a split can be more exact. Run from the
repository root on an H100 / H200 (JSON in ``$OUT/text_down_split.json``, table last)::

    python3 bench/text_down_split_bench.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import harness_core as hc
from pack import load_pack

M, K, N = 300, 12288, 3072
CALLS = 40


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    args = parser.parse_args()
    load_pack()
    from qwen_edit_hopper.fp8 import small_m_gemm
    from qwen_edit_hopper.fp8.cublaslt_gemm import cublaslt_rowwise_mm

    device = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    copies = max(2, -(-3 * l2 // (N * K)))
    gen = torch.Generator(device).manual_seed(0)
    ring = [(torch.randn(N, K, device=device, generator=gen) * 0.5).to(torch.float8_e4m3fn) for _ in range(copies)]
    w_scale = (torch.rand(N, 1, device=device, generator=gen) + 0.5) / 64
    x8 = torch.randn(M, K, device=device, generator=gen).to(torch.float8_e4m3fn)
    x_scale = (torch.rand(M, 1, device=device, generator=gen) + 0.5) / 16
    exact = ((x8.double() @ ring[0].double().t()) * x_scale.double() * w_scale.double().t()).float()

    variants = {"cuBLASLt (pack call, fast accumulation)": lambda w: cublaslt_rowwise_mm(x8, x_scale, w, w_scale)}
    configs = {}
    for bm, bn, split, stages in itertools.product((64, 128), (64, 128), (1, 2, 3, 4), (3, 4)):
        if K % (128 * split):
            continue
        config = (bm, bn, 128, 4, stages, split)
        label = f"small-M {bm}x{bn}, split {split}, {stages} stages"
        configs[label] = list(config)
        variants[label] = lambda w, config=config: small_m_gemm.fp8_gemm_small_m(x8, x_scale, w, w_scale, config)
    rows = []
    for label, fn in variants.items():
        try:
            err = ((fn(ring[0]).float() - exact).norm() / exact.norm()).item()
            us = hc.graph_ms_per_call(lambda i, fn=fn: fn(ring[i % copies]), CALLS, reps=7) * 1e3
        except Exception as exc:  # a config Triton cannot build (shared memory) is reported, not fatal
            rows.append({"variant": label, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
            continue
        rows.append({"variant": label, "config": configs.get(label), "us": round(us, 2),
                     "tflops": round(2 * M * K * N / us / 1e6, 1), "rel_err_vs_exact": err})
        print(json.dumps(rows[-1]), flush=True)
    qkv_rows = qkv_three_or_one(device, l2, small_m_gemm, cublaslt_rowwise_mm)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [M, K, N], "rows": rows,
              "qkv": qkv_rows}
    (args.out / "text_down_split.json").write_text(json.dumps(result, indent=1))
    timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    print(f"\n{'variant':48s} {'us':>7s} {'TFLOP/s':>8s} {'err vs exact':>12s}")
    for r in timed[:10] + [r for r in timed[10:] if r["variant"].startswith("cuBLASLt")]:
        print(f"{r['variant']:48s} {r['us']:7.2f} {r['tflops']:8.1f} {r['rel_err_vs_exact']:12.2e}")
    for r in qkv_rows:
        print(f"Q/K/V at M = {r['M']:3d}: three 3072 -> 3072 GEMMs {r['three_us']:6.2f} us, one 3072 -> 9216 "
              f"{r['one_us']:6.2f} us ({r['path']})")
    return 0


def qkv_three_or_one(device, l2, small_m_gemm, cublaslt_rowwise_mm) -> list[dict]:
    """The text stream's Q/K/V at M = 300 (small-M kernel) and 600 (cuBLASLt): three GEMMs or one fused."""
    return [qkv_at(m, device, l2, small_m_gemm, cublaslt_rowwise_mm) for m in (300, 600)]


def qkv_at(m: int, device, l2, small_m_gemm, cublaslt_rowwise_mm) -> dict:
    copies = max(2, -(-3 * l2 // (9216 * 3072)))
    ring = [torch.randn(9216, 3072, device=device).to(torch.float8_e4m3fn) for _ in range(copies)]
    ws = (torch.rand(9216, 1, device=device) + 0.5) / 64
    x8 = torch.randn(m, 3072, device=device).to(torch.float8_e4m3fn)
    xs = (torch.rand(m, 1, device=device) + 0.5) / 16

    def gemm(w, s):
        config = small_m_gemm.small_m_config(x8, w, xs, torch.bfloat16, True)
        if config is not None:
            return small_m_gemm.fp8_gemm_small_m(x8, xs, w, s, config)
        return cublaslt_rowwise_mm(x8, xs, w, s)

    def three(i):
        w = ring[i % copies]
        return [gemm(w[j * 3072:(j + 1) * 3072], ws[j * 3072:(j + 1) * 3072]) for j in range(3)]

    three_us = hc.graph_ms_per_call(three, CALLS, reps=7) * 1e3
    one_us = hc.graph_ms_per_call(lambda i: gemm(ring[i % copies], ws), CALLS, reps=7) * 1e3
    path = "small-M kernel" if small_m_gemm.small_m_config(x8, ring[0], xs, torch.bfloat16, True) else "cuBLASLt"
    return {"M": m, "three_us": round(three_us, 2), "one_us": round(one_us, 2), "path": path}

if __name__ == "__main__":
    sys.exit(main())
