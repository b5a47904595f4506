#!/usr/bin/env python3
"""What the row norms cost the LayerNorm + modulate + quantize kernel, and what the forward's context costs it.

In the forward's timeline (fifteenth session) the image stream's LayerNorm kernels took 39-41 us for 8192 x 3072,
against 28 us for the kernel alone without row norms (``bench/gelu_quant_bench.py``). Here, 8192 x 3072 bf16 ->
e4m3, three rotating input copies (150 MB: more than L2), CUDA graphs of 12 calls: the kernel without norms, with
the exact norms of its own e4m3 codes (before the sixteenth session), and with their upper bounds (shipped since;
``fp8.norm_quant`` docstring, "Row norms"), for the fused GELU GEMM's and the joint v GEMM's bounds; then
each after an 8192 x 3072 -> 12288 fp8 GEMM (cuBLASLt), minus the GEMM alone, as in the block where it follows a
GEMM. Run from the repository root on an H100 / H200 (JSON in ``$OUT/norm_quant_norms.json``)::

    python3 bench/norm_quant_norms_bench.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import harness_core as hc
from pack import load_pack

load_pack()
from qwen_edit_hopper.fp8 import norm_quant as nq  # noqa: E402
from qwen_edit_hopper.fp8.cublaslt_gemm import cublaslt_rowwise_mm  # noqa: E402
from qwen_edit_hopper.fp8.linear import ScaledMMLinear  # noqa: E402

ROWS, COLS, COPIES = 8192, 3072, 3


def main() -> int:
    device = torch.device("cuda")
    out_dir = Path(os.environ.get("OUT", "bench/out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    xs = [(torch.randn(ROWS, COLS, device=device) * 3 + 1).bfloat16() for _ in range(COPIES)]
    mod = torch.randn(1, 6 * COLS, device=device, dtype=torch.bfloat16)
    up = ScaledMMLinear.from_linear(torch.nn.Linear(COLS, 4 * COLS).to(device, torch.bfloat16), "rowwise",
                                    fast_accum=True)
    a8, a_scale = up.quantize_input(xs[0])

    def gemm(i):
        return cublaslt_rowwise_mm(a8, a_scale, up.weight, up.weight_scale, True)

    def norm(i, norms):
        return nq._modulate_quantize_op(xs[i % COPIES], ROWS, 1e-6, mod, 6, 0, 1, None, nq.DEFAULT_WARPS, True,
                                        nq.DEFAULT_ROWS, norms != "none", norms == "exact")

    results = {}
    gemm_us = hc.graph_ms_per_call(gemm, 12) * 1e3
    results["GEMM alone"] = round(gemm_us, 2)
    for norms in ("none", "exact", "bound"):
        alone = hc.graph_ms_per_call(lambda i, w=norms: norm(i, w), 12) * 1e3
        after = hc.graph_ms_per_call(lambda i, w=norms: (gemm(i), norm(i, w)), 12) * 1e3
        label = {"none": "without norms", "exact": "with exact norms (from the codes)",
                 "bound": "with norm bounds (shipped)"}[norms]
        results[f"LN kernel {label}, alone"] = round(alone, 2)
        results[f"LN kernel {label}, after the GEMM (pair minus GEMM)"] = round(after - gemm_us, 2)
    (out_dir / "norm_quant_norms.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                                               "us": results}, indent=1))
    for label, us in results.items():
        print(f"{label:60s} {us:8.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
