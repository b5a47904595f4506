#!/usr/bin/env python3
"""The LayerNorm + modulate + e4m3 kernel's launch shape: rows per program, warps, and the modulation loaded once per
program (``fp8.norm_quant.UNIFORM_MODULATION``) or once per row.

The image stream's two LayerNorm kernels per block (8192 x 3072 at batch 1, 16384 x 3072 at batch 2; with row norms,
as the GELU GEMM's and the joint v GEMM's bounds need) took 38-40 us each in the forward's timeline, about 2 TB/s.
Per row, the kernel reads 6 KB of x and, for shift and scale, 12 KB of modulation (the same row for every token of a
sample: L1 / L2 hits, but load instructions all the same). With several rows per program sharing one modulation load,
that per-row cost shrinks. Each configuration: alone, and right after an 8192 x 3072 -> 12288 fp8 GEMM (pair minus
GEMM, as in the block), CUDA graphs of 12 calls over three input copies (more than L2), codes compared with the
shipped configuration. Run from the repository root on an H100 / H200 (JSON in ``$OUT/norm_rows.json``)::

    source bench/device_env.sh && python3 bench/norm_rows_bench.py
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

TOKENS, COLS, COPIES, CALLS = 8192, 3072, 3, 12
CONFIGS = ((1, 4, False), (1, 4, True), (2, 4, False), (2, 4, True), (2, 8, True), (4, 4, True), (4, 8, True),
           (8, 8, True), (8, 16, True))
"""(rows per program, warps, modulation once per program)."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == nq.FP8_DTYPE else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bits(a), _bits(b))


def measure_batch(batch: int, up: ScaledMMLinear, device: torch.device) -> dict:
    """{label: us alone, us after the GEMM, same outputs as the shipped configuration, TB/s} at this batch."""
    rows = batch * TOKENS
    xs = [(torch.randn(rows, COLS, device=device) * 3 + 1).bfloat16() for _ in range(COPIES)]
    mod = torch.randn(batch, 6 * COLS, device=device, dtype=torch.bfloat16)
    a8, a_scale = up.quantize_input(xs[0][:TOKENS])

    def gemm(i):
        return cublaslt_rowwise_mm(a8, a_scale, up.weight, up.weight_scale, True)

    def norm(i, per_program, warps, uniform):
        return nq._modulate_quantize_op(xs[i % COPIES], TOKENS, 1e-6, mod, 6, 0, 1, None, warps, True, per_program,
                                        True, False, uniform)

    shipped = norm(0, nq.DEFAULT_ROWS, nq.DEFAULT_WARPS, nq.UNIFORM_MODULATION)
    gemm_us = hc.graph_ms_per_call(gemm, CALLS) * 1e3
    results = {}
    for cfg in CONFIGS:
        per_program, warps, uniform = cfg
        label = f"batch {batch}: {per_program} rows, {warps} warps, modulation per {'program' if uniform else 'row'}"
        same = all(_same(a, b) for a, b in zip(norm(0, *cfg), shipped, strict=True))
        alone = hc.graph_ms_per_call(lambda i, c=cfg: norm(i, *c), CALLS) * 1e3
        after = hc.graph_ms_per_call(lambda i, c=cfg: (gemm(i), norm(i, *c)), CALLS) * 1e3
        results[label] = {"alone": round(alone, 2), "after_gemm": round(after - gemm_us, 2),
                          "same_outputs_as_shipped": same, "TB/s_alone": round(rows * COLS * 3 / alone / 1e6, 2)}
        print(f"{label:60s} {alone:7.2f} us alone {after - gemm_us:7.2f} after GEMM  same={same}", flush=True)
    return results


def main() -> int:
    device = torch.device("cuda")
    out_dir = Path(os.environ.get("OUT", "bench/out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    up = ScaledMMLinear.from_linear(torch.nn.Linear(COLS, 4 * COLS).to(device, torch.bfloat16), "rowwise",
                                    fast_accum=True)
    results = {"gpu": torch.cuda.get_device_name(), "us": {}}
    for batch in (1, 2):
        results["us"].update(measure_batch(batch, up, device))
    (out_dir / "norm_rows.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
