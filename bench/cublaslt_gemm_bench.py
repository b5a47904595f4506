#!/usr/bin/env python3
"""The pack's workspace-free cuBLASLt GEMM (``fp8/cublaslt_gemm.py``) against ``torch._scaled_mm``, per shape.

The forward's row-wise fp8 GEMM shapes (K -> N: QKV 3072 -> 9216, output projection 3072 -> 3072, MLP up
3072 -> 12288, MLP down 12288 -> 3072) at the image stream's M = 8192 / 16384 tokens and the text stream's
M = 300 / 600. Per shape:

* ``torch._scaled_mm`` as the pack calls it (fast accumulation, bf16 out; cuBLASLt with PyTorch's workspace,
  a memset before stream-K kernels);
* ``lt heuristic``: the pack's call with the heuristic's first workspace-free algorithm;
* ``lt timed``: the pack's call as shipped: the fastest of up to ``CANDIDATES`` workspace-free algorithms,
  timed on the first call.

Each is timed as a CUDA graph of 24 calls cycling through copies of the weight totalling more than twice the
L2 cache (weights come from HBM as in the model); memsets are graph nodes as in the pack's graphed forward.
Error: relative Frobenius difference to ``torch._scaled_mm``. Run from the repository root on an H100 / H200
(JSON in ``$OUT/cublaslt_gemm.json``, table last)::

    python3 bench/cublaslt_gemm_bench.py
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
import harness_core as hc
from pack import load_pack

SHAPES = (("qkv", 3072, 9216), ("out", 3072, 3072), ("mlp up", 3072, 12288), ("mlp down", 12288, 3072))
CALLS = 24


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def load_binding():
    """The pack's cuBLASLt binding (``fp8.cublaslt_gemm``), or None after printing why it cannot run here."""
    load_pack()
    from qwen_edit_hopper.fp8 import cublaslt_gemm as lt

    problem = lt.cublaslt_problem()
    if problem:
        print("cuBLASLt GEMM cannot run here:", problem)
        return None
    return lt


def measure(lt, device: torch.device, l2: int, m: int, name: str, k: int, n: int, shipped_candidates: int) -> dict:
    copies = max(2, -(-3 * l2 // (n * k)))
    ring = [torch.randn(n, k, device=device).to(torch.float8_e4m3fn) for _ in range(copies)]
    w_scale = (torch.rand(n, 1, device=device) + 0.5) / 16
    x8 = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    x_scale = (torch.rand(m, 1, device=device) + 0.5) / 16

    def torch_mm(w):
        return torch._scaled_mm(x8, w.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=torch.bfloat16,
                                use_fast_accum=True)

    ref = torch_mm(ring[0])
    row = {"gemm": name, "M": m, "K": k, "N": n, "weight_copies": copies}
    row["torch_ms"] = hc.graph_ms_per_call(lambda i: torch_mm(ring[i % copies]), CALLS, reps=9)

    out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    lt.CANDIDATES = 1
    lt._PLANS.clear()
    plan = lt.plan_for(x8, x_scale, ring[0], w_scale, True, out)
    row["heuristic_config"] = plan.config
    row["lt_heuristic_ms"] = hc.graph_ms_per_call(
        lambda i: lt.cublaslt_rowwise_mm(x8, x_scale, ring[i % copies], w_scale, True), CALLS, reps=9)
    row["lt_heuristic_err"] = rel_err(lt.cublaslt_rowwise_mm(x8, x_scale, ring[0], w_scale, True), ref)

    lt.CANDIDATES = shipped_candidates
    lt._PLANS.clear()
    plan = lt.plan_for(x8, x_scale, ring[0], w_scale, True, out)
    row["timed_config"], row["candidate_us"], row["candidates"] = plan.config, plan.timings_us, plan.candidates
    row["lt_timed_ms"] = hc.graph_ms_per_call(
        lambda i: lt.cublaslt_rowwise_mm(x8, x_scale, ring[i % copies], w_scale, True), CALLS, reps=9)
    row["lt_timed_err"] = rel_err(lt.cublaslt_rowwise_mm(x8, x_scale, ring[0], w_scale, True), ref)
    row["tflops_torch"] = 2 * m * n * k / row["torch_ms"] / 1e9
    row["tflops_lt_timed"] = 2 * m * n * k / row["lt_timed_ms"] / 1e9
    ring.clear()
    hc.free_memory()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 300, 600])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    args = parser.parse_args()
    lt = load_binding()
    if lt is None:
        return 2
    device = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    shipped = lt.CANDIDATES
    rows = [measure(lt, device, l2, m, name, k, n, shipped) for m in args.tokens for name, k, n in SHAPES]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cublaslt": lt._library().version,
              "date": dt.date.today().isoformat(), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cublaslt_gemm.json").write_text(json.dumps(result, indent=1))
    print(f"{result['gpu']}, torch {result['torch']}, cuBLASLt {result['cublaslt']}")
    print(f"{'gemm':9s} {'M':>6s} {'torch us':>9s} {'lt heur us':>10s} {'lt timed us':>11s} {'timed/torch':>11s} "
          f"{'err':>8s} {'tile':>5s} {'splitk':>6s}")
    for r in rows:
        print(f"{r['gemm']:9s} {r['M']:6d} {r['torch_ms'] * 1e3:9.1f} {r['lt_heuristic_ms'] * 1e3:10.1f} "
              f"{r['lt_timed_ms'] * 1e3:11.1f} {r['lt_timed_ms'] / r['torch_ms']:11.3f} {r['lt_timed_err']:8.1e} "
              f"{r['timed_config']['tile']!s:>5s} {r['timed_config']['splitk']!s:>6s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
