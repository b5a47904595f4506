"""Are the block's row-wise fp8 GEMMs at their best kernel? cuBLASLt as called, transposed, and Inductor's autotune.

The image-stream GEMMs of one Qwen-Image block at batch 1 (M = 8192 tokens): QKV 3072 -> 9216, output
projection 3072 -> 3072, MLP up 3072 -> 12288, MLP down 12288 -> 3072. For each: TFLOP/s of
``torch._scaled_mm`` as the pack calls it (x8 @ w8^T, row-wise scales, fast accumulation); of the
transposed problem (w8 @ x8^T, which gives out^T, plus the transpose copy back); and of the same call
compiled with ``mode="max-autotune-no-cudagraphs"`` (Inductor picks among cuBLAS and its Triton
templates; its choice is printed). CUDA events around 20 back-to-back calls, median of 7. Run from the
repo root on an H100 / H200:

    python3 bench/gemm_shape_bench.py [--out DIR] [--no-autotune]
"""

# ruff: noqa: B023 - each lambda is timed (called) within its own loop iteration

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness_core as hc

SHAPES = (("qkv", 3072, 9216), ("out", 3072, 3072), ("fc1", 3072, 12288), ("fc2", 12288, 3072))


def time_ms(fn, calls: int = 20, reps: int = 7) -> float:
    """Median ms per call of ``calls`` calls back to back between two CUDA events (no launch gaps)."""
    return hc.time_calls(lambda: [fn() for _ in range(calls)], torch.device("cuda"), warmup=3, reps=reps)["ms"] / calls


def scaled_mm(a8, a_scale, b8_t, b_scale):
    return torch._scaled_mm(a8, b8_t, scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16,
                            use_fast_accum=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    parser.add_argument("--no-autotune", action="store_true")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192])
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    compiled = torch.compile(scaled_mm, mode="max-autotune-no-cudagraphs", dynamic=False)
    for m in args.tokens:
        for name, k, n in SHAPES:
            x8 = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
            w8 = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
            xs, ws = torch.rand(m, 1, device=device) + 0.5, torch.rand(n, 1, device=device) + 0.5
            flop = 2 * m * k * n
            row = {"gemm": name, "M": m, "K": k, "N": n}
            row["as called"] = time_ms(lambda: scaled_mm(x8, xs, w8.t(), ws.t()))
            row["transposed"] = time_ms(lambda: scaled_mm(w8, ws, x8.t(), xs.t()))
            row["transposed + copy"] = time_ms(lambda: scaled_mm(w8, ws, x8.t(), xs.t()).t().contiguous())
            ref = scaled_mm(x8, xs, w8.t(), ws.t())
            transposed = scaled_mm(w8, ws, x8.t(), xs.t()).t()
            row["transposed max diff"] = (transposed.float() - ref.float()).abs().max().item()
            if not args.no_autotune:
                torch._dynamo.reset()
                row["autotuned"] = time_ms(lambda: compiled(x8, xs, w8.t(), ws.t()))
                row["autotuned max diff"] = (compiled(x8, xs, w8.t(), ws.t()).float() - ref.float()).abs().max().item()
            for key in ("as called", "transposed", "transposed + copy", "autotuned"):
                if key in row:
                    row[f"{key} TFLOP/s"] = round(flop / row[key] / 1e9, 1)
            rows.append(row)
            print(row, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemm_shape.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                                          "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"\n{'gemm':6s} {'M':>6s} {'as called':>18s} {'transposed':>18s} {'+copy':>8s} {'autotuned':>18s}")
    for r in rows:
        auto = f"{r['autotuned']:.3f} ({r['autotuned TFLOP/s']:.0f})" if "autotuned" in r else "-"
        print(f"{r['gemm']:6s} {r['M']:6d} {r['as called']:.3f} ms ({r['as called TFLOP/s']:5.0f}) "
              f"{r['transposed']:.3f} ms ({r['transposed TFLOP/s']:5.0f}) {r['transposed + copy']:.3f} {auto:>18s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
