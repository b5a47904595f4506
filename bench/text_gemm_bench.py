#!/usr/bin/env python3
"""Can the text stream's small row-wise fp8 GEMMs (M = 300 / 600 tokens) run faster than cuBLASLt's choice?

In the fastest forward the text-stream GEMMs (M = 300 text tokens at batch 1, 600 at batch 2) take about
8.5 ms per forward at 240-620 TFLOP/s, where the image stream's reach about 1280. At 1300 TFLOP/s they would
take about 3 ms. Candidates, per GEMM shape of one block's text stream (QKV 3072 -> 9216, output projection
3072 -> 3072, MLP up 3072 -> 12288, MLP down 12288 -> 3072):

* ``torch._scaled_mm`` as the pack calls it (x8 @ w8^T, row-wise scales, fast accumulation, bf16 out);
* the same with M zero-padded to 304 / 320 / 384 rows (cuBLASLt's heuristic keys on M);
* the transposed problem (w8 @ x8^T, then the transpose copy back);
* a Triton GEMM over a sweep of tiles: the pack's kernel (``fp8/small_m_gemm.py``, which this bench chose)
  without split-K; with split-K, a kernel in this file (a float32 partial per split, then one kernel that sums
  the splits in a fixed order, scales and casts: deterministic) so that N = 3072 fills 132 SMs.

Each variant is timed as a CUDA graph of 40 calls that cycle through copies of the weight totalling more than
twice the L2 cache, so weights come from HBM as in the model (one copy would stay in L2). Error: relative
Frobenius difference to ``torch._scaled_mm``. Run from the repository root on an H100 / H200 (JSON in
``$OUT/text_gemm.json``, table last)::

    python3 bench/text_gemm_bench.py [--tokens 300 600]
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
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

SHAPES = (("qkv", 3072, 9216), ("out", 3072, 3072), ("fc1", 3072, 12288), ("fc2", 12288, 3072))
CALLS = 40


@triton.jit
def _split_k_partial_kernel(x_ptr, w_ptr, part_ptr, M, N, K,  # noqa: N803
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr):  # noqa: N803
    """The tried split-K variant (not in the pack): part[s, m, n] = sum over split s's K range of x[m, k] w[n, k]
    in float32. x: (M, K), w: (N, K) e4m3 row-major; tiles ordered as the pack's kernel
    (fp8/small_m_gemm.py); needs N % BN == 0 and K % (BK * SPLIT_K) == 0."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BM)
    offs_m = (pid % num_m) * BM + tl.arange(0, BM)
    offs_n = (pid // num_m) * BN + tl.arange(0, BN)
    k_iters = K // (BK * SPLIT_K)
    offs_k = pid_k * k_iters * BK + tl.arange(0, BK)
    a_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    b_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
    row_ok = offs_m[:, None] < M
    acc = tl.zeros((BM, BN), tl.float32)
    for _ in range(k_iters):
        acc = tl.dot(tl.load(a_ptrs, mask=row_ok, other=0.0), tl.load(b_ptrs), acc)
        a_ptrs += BK
        b_ptrs += BK
    tl.store(part_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=row_ok)


@triton.jit
def _splitk_reduce_kernel(part_ptr, xs_ptr, ws_ptr, out_ptr, M, N,  # noqa: N803
                          SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803
    """out = bf16(xs[m] * ws[n] * sum_s part[s, m, n]), splits summed in order (deterministic)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * M * N + offs, mask=ok, other=0.0)
    xs = tl.load(xs_ptr + offs // N, mask=ok, other=0.0)
    ws = tl.load(ws_ptr + offs % N, mask=ok, other=0.0)
    tl.store(out_ptr + offs, (acc * xs * ws).to(tl.bfloat16), mask=ok)


def triton_gemm(x8, xs, w8, ws, cfg):
    """Row-wise fp8 GEMM in Triton; x8 (M, K), w8 (N, K) e4m3; xs (M,), ws (N,) float32. Split-K 1: the pack's
    kernel (``fp8.small_m_gemm``); more: the split-K partials above, then their fixed-order sum."""
    from qwen_edit_hopper.fp8 import small_m_gemm

    (m, k), n = x8.shape, w8.shape[0]
    bm, bn, bk, split, warps, stages = cfg
    if split == 1:
        return small_m_gemm._fp8_gemm_small_m_op(x8, xs.reshape(m, 1), w8, ws.reshape(n, 1), bm, bn, bk, warps,
                                                 stages)  # fmt: skip
    out = torch.empty(m, n, device=x8.device, dtype=torch.bfloat16)
    part = torch.empty(split, m, n, device=x8.device, dtype=torch.float32)
    _split_k_partial_kernel[(triton.cdiv(m, bm) * (n // bn), split)](x8, w8, part, m, n, k, BM=bm, BN=bn, BK=bk,
                                                                     SPLIT_K=split, num_warps=warps,
                                                                     num_stages=stages)  # fmt: skip
    _splitk_reduce_kernel[(triton.cdiv(m * n, 1024),)](part, xs, ws, out, m, n, SPLIT_K=split, BLOCK=1024)
    return out


def scaled_mm(x8, xs, w8, ws):
    return torch._scaled_mm(x8, w8.t(), scale_a=xs[:, None], scale_b=ws[None, :], out_dtype=torch.bfloat16,
                            use_fast_accum=True)


def graph_ms(step, calls: int = CALLS) -> float:
    """Median ms per call of ``step(i)`` for i in 0..calls-1, captured as one CUDA graph and replayed."""
    return hc.graph_ms_per_call(step, calls, reps=9)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def configs():
    for bm, bn, split, stages in itertools.product((64, 128), (64, 128, 256), (1, 2, 3, 4), (3, 4)):
        for warps in ((4,) if bm == 64 else (4, 8)):
            yield (bm, bn, 128, split, warps, stages)


def measure_shape(device: torch.device, l2: int, m: int, name: str, k: int, n: int) -> dict:
    """Every variant for one (M, K, N); ms per call, Triton configs with their error against cuBLAS."""
    copies = max(2, -(-3 * l2 // (n * k)))
    ring = [torch.randn(n, k, device=device).to(torch.float8_e4m3fn) for _ in range(copies)]
    wsc = torch.rand(n, device=device) + 0.5
    x8 = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    xs = torch.rand(m, device=device) + 0.5
    ref = scaled_mm(x8, xs, ring[0], wsc)
    row = {"gemm": name, "M": m, "K": k, "N": n, "weight_copies": copies}
    row["cublas"] = graph_ms(lambda i: scaled_mm(x8, xs, ring[i % copies], wsc))
    for pad in (304, 320, 384) if m < 384 else (608, 640, 768):
        xp = torch.zeros(pad, k, device=device, dtype=x8.dtype)
        xp[:m] = x8
        xsp = torch.ones(pad, device=device)
        xsp[:m] = xs
        row[f"cublas M={pad}"] = graph_ms(lambda i, a=xp, s=xsp: scaled_mm(a, s, ring[i % copies], wsc))
    mt = -(-m // 16) * 16  # the transposed problem's N must be a multiple of 16: padded rows
    xt, xst = torch.zeros(mt, k, device=device, dtype=x8.dtype), torch.ones(mt, device=device)
    xt[:m], xst[:m] = x8, xs
    row["cublas transposed + copy"] = graph_ms(
        lambda i: torch._scaled_mm(ring[i % copies], xt.t(), scale_a=wsc[:, None], scale_b=xst[None, :],
                                   out_dtype=torch.bfloat16, use_fast_accum=True)[:, :m].t().contiguous())
    best, row["triton"] = None, []
    for cfg in configs():
        _, bn, bk, split, _, _ = cfg
        if n % bn or k % (bk * split):
            continue
        try:
            err = rel_err(triton_gemm(x8, xs, ring[0], wsc, cfg), ref)
            ms = graph_ms(lambda i, c=cfg: triton_gemm(x8, xs, ring[i % copies], wsc, c))
        except Exception as exc:  # a config that does not compile (shared memory) is skipped, and said
            hc.log(f"{name} M={m} {cfg}: skipped ({type(exc).__name__}: {str(exc)[:80]})")
            continue
        row["triton"].append({"cfg": cfg, "ms": ms, "err": err})
        if best is None or ms < best["ms"]:
            best = {"cfg": cfg, "ms": ms, "err": err}
    row["triton best"] = best
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    parser.add_argument("--tokens", type=int, nargs="+", default=[300, 600])
    args = parser.parse_args()
    load_pack()
    device = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    rows, table = [], []
    for m, (name, k, n) in itertools.product(args.tokens, SHAPES):
        row = measure_shape(device, l2, m, name, k, n)
        rows.append(row)
        flop, base, best = 2 * m * k * n, row["cublas"], row["triton best"]
        pads = " ".join(f"{key[9:]} {row[key] * 1e3:.1f}" for key in row if key.startswith("cublas M="))
        triton_text = "-" if best is None else (f"{best['ms'] * 1e3:.1f} ({flop / best['ms'] / 1e9:.0f}) "
                                                f"{best['cfg']} err {best['err']:.1e}")
        table.append(f"| {name} | {m} | {base * 1e3:.1f} ({flop / base / 1e9:.0f}) | {pads} | "
                     f"{row['cublas transposed + copy'] * 1e3:.1f} | {triton_text} |")
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "python3 bench/text_gemm_bench.py " + " ".join(sys.argv[1:])}
    (args.out / "text_gemm.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    print(f"\n{torch.cuda.get_device_name(device)}: us per call (TFLOP/s); Triton cfg = BM, BN, BK, split-K, "
          "warps, stages")
    print("| GEMM | M | cuBLAS | cuBLAS, M padded | transposed + copy | Triton best |")
    print("|---|---|---|---|---|---|")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
