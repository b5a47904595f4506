#!/usr/bin/env python3
"""The joint v GEMM (``fp8/v_gemm.py``) against the shipped v path, per tile config, at the forward's shapes.

Shipped before: cuBLASLt's v GEMM (bf16 out), then ``fp8.v_quant``'s max and cast kernels over both streams. The
joint v GEMM: one Triton GEMM that writes the image rows of the joint e4m3 v with a bound scale, and the text rows'
cast. Image stream 8192 tokens per sample (batch 1 and 2), 300 text tokens, 24 heads x 128, K = 3072; weights
streamed from HBM (3 copies); CUDA graphs of 12 calls. Run from the repository root on an H100 / H200 (JSON in
``$OUT/joint_v_gemm.json``, table last)::

    python3 bench/joint_v_gemm_bench.py
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

CALLS = 12
CONFIGS = ((128, 256, 128, 8, 3, 16), (128, 256, 128, 8, 3, 8), (128, 256, 128, 8, 4, 16), (128, 256, 128, 8, 4, 8))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    args = parser.parse_args()
    import harness_core as hc
    from pack import load_pack

    load_pack()
    from qwen_edit_hopper.fp8 import v_gemm as vg
    from qwen_edit_hopper.fp8.cublaslt_gemm import cublaslt_rowwise_mm
    from qwen_edit_hopper.fp8.gelu_gemm import column_bound
    from qwen_edit_hopper.fp8.norm_quant import quantized_row_norms
    from qwen_edit_hopper.fp8.quant import quantize_rowwise
    from qwen_edit_hopper.fp8.v_quant import joint_v_quantize_scales

    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    heads, head_dim, k, s_img, length = 24, 128, 3072, 8192, 300
    n = heads * head_dim
    shipped_config = vg.CONFIG
    rows = []

    def one_batch(batch: int) -> None:
        torch.manual_seed(0)
        x = torch.randn(batch * s_img, k, device=dev)
        x[:, :8] *= 20
        x8, xs = quantize_rowwise(x.bfloat16())
        xn = quantized_row_norms(x8, xs)
        copies = max(2, -(-3 * l2 // (n * k)))
        ring = [quantize_rowwise((torch.randn(n, k, device=dev) * 0.02).bfloat16()) for _ in range(copies)]
        bias = (torch.randn(n, device=dev) * 0.1).bfloat16()
        bounds = [column_bound(w8, ws, bias) for w8, ws in ring]
        t8, ts = quantize_rowwise(torch.randn(batch * length, k, device=dev).bfloat16())
        tw8, tws = quantize_rowwise((torch.randn(3 * n, k, device=dev) * 0.02).bfloat16())
        tb = (torch.randn(3 * n, device=dev) * 0.1).bfloat16()
        fused = cublaslt_rowwise_mm(t8, ts, tw8, tws, True).reshape(batch, length, 3, heads, head_dim)
        v_txt, b_txt, tn, tcb = fused[:, :, 2], tb[2 * n:].reshape(heads, head_dim), quantized_row_norms(t8, ts), \
            column_bound(tw8, tws, tb)

        def shipped(i):
            w8, ws = ring[i % copies]
            v_img = cublaslt_rowwise_mm(x8, xs, w8, ws, True).reshape(batch, s_img, heads, head_dim)
            return joint_v_quantize_scales(v_img, v_txt, bias.reshape(heads, head_dim), b_txt)

        rows.append({"batch": batch, "variant": "shipped: cuBLASLt v GEMM + max + cast kernels",
                     "us": hc.graph_ms_per_call(shipped, CALLS) * 1e3})
        for config in CONFIGS:
            vg.CONFIG = config

            def joint(i):
                w8, ws = ring[i % copies]
                return vg.joint_v_gemm(x8, xs, xn, w8, ws, bias, bounds[i % copies], v_txt, b_txt, tn, tcb)

            rows.append({"batch": batch, "variant": f"joint v GEMM {config}",
                         "us": hc.graph_ms_per_call(joint, CALLS) * 1e3})
        vg.CONFIG = shipped_config
        hc.free_memory()

    for batch in (1, 2):
        one_batch(batch)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": dt.date.today().isoformat(),
              "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "joint_v_gemm.json").write_text(json.dumps(result, indent=1))
    print(f"{result['gpu']}, torch {result['torch']}")
    for r in rows:
        print(f"batch {r['batch']}  {r['variant']:52s} {r['us']:8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
