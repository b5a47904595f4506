#!/usr/bin/env python3
"""How fast can the 120 modulation GEMVs read their 6.8 GB? The shipped launch against a persistent streaming kernel.

The shipped path (``fp8.shared_input_gemv``, ``ONE_ROW_CONFIG``) reads the 120 separate e4m3 weights (3072 -> 18432
each) through an address table in 276 480 short programs per launch, at about 2.4 TB/s on an H200 (2.7-2.9 ms per
forward). This bench asks how far a persistent kernel gets when the weights are one contiguous buffer: grid = a few
programs per SM, each walking tiles of BN weight rows with ``tl.range`` software pipelining (``STAGES`` tiles'
loads in flight). Bench only: the pack's layers keep separate weights. Per config: ms for all 120 layers (CUDA graph
of 5 calls, replayed, median of 5), TB/s of weight read, and the relative difference to the shipped output. Run from
the repository root on an H100 / H200 (JSON in ``$OUT/modulation_stream.json``)::

    python3 bench/modulation_stream_bench.py
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
from qwen_edit_hopper.fp8.linear import ScaledMMLinear  # noqa: E402
from qwen_edit_hopper.fp8.shared_input_gemv import SharedInputLinears  # noqa: E402

LAYERS, N, K = 120, 18432, 3072
CONFIGS = [(bn, bk, warps, stages, per_sm) for bn in (4, 8, 16) for bk, warps in ((1024, 4),)
           for stages in (2, 4) for per_sm in (4, 8)]


@triton.jit
def streaming_gemv_kernel(w_ptr, x_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, n_rows,
                          K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,  # noqa: N803
                          NUM_PROGRAMS: tl.constexpr, STAGES: tl.constexpr):  # noqa: N803
    """out[r] = bf16(x_scale * w_scale[r] * sum_k w[r, k] x[k] + bias[r]) for the rows r of one (n_rows, K) e4m3
    buffer (all layers stacked); persistent over tiles of BN rows."""
    offs_k = tl.arange(0, BK)
    x_scale = tl.load(x_scale_ptr)
    for tile in tl.range(tl.program_id(0), n_rows // BN, NUM_PROGRAMS, num_stages=STAGES):
        rows = tile * BN + tl.arange(0, BN)
        acc = tl.zeros((BN,), tl.float32)
        for k0 in tl.static_range(0, K, BK):
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + (k0 + offs_k)[None, :]).to(tl.float32)
            acc += tl.sum(w * tl.load(x_ptr + k0 + offs_k).to(tl.float32)[None, :], axis=1)
        y = acc * x_scale * tl.load(w_scale_ptr + rows) + tl.load(bias_ptr + rows).to(tl.float32)
        tl.store(out_ptr + rows, y.to(tl.bfloat16))


def main() -> int:
    device = torch.device("cuda")
    out_dir = Path(os.environ.get("OUT", "bench/out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    torch.manual_seed(0)
    layers = [ScaledMMLinear.from_linear(torch.nn.Linear(K, N).to(device, torch.bfloat16), "rowwise", fast_accum=True)
              for _ in range(LAYERS)]
    x = torch.randn(1, K, device=device, dtype=torch.bfloat16)
    shipped = SharedInputLinears(layers)
    want = shipped(x).reshape(-1).float()
    stacked_w = torch.cat([layer.weight for layer in layers])  # (120 * 18432, 3072) e4m3, one buffer
    stacked_ws = torch.cat([layer.weight_scale.reshape(-1) for layer in layers]).float()
    stacked_b = torch.cat([layer.bias for layer in layers])
    x8, x_scale = layers[0].quantize_input(x)
    x8 = x8.reshape(-1)
    x_scale = x_scale.reshape(1).float()
    out = torch.empty(LAYERS * N, device=device, dtype=torch.bfloat16)
    gb = LAYERS * N * K / 1e9
    rows = []

    def record(label, ms, got):
        err = float((got.float() - want).norm() / want.norm())
        row = {"variant": label, "ms": round(ms, 3), "TB/s": round(gb / ms, 2), "rel_diff_vs_shipped": err}
        rows.append(row)
        print(row, flush=True)

    record("shipped: SharedInputLinears (ONE_ROW_CONFIG)", hc.graph_ms_per_call(lambda i: shipped(x), 5, reps=5),
           shipped(x).reshape(-1))
    for bn, bk, warps, stages, per_sm in CONFIGS:
        programs = sms * per_sm

        def call(bn=bn, bk=bk, warps=warps, stages=stages, programs=programs):
            streaming_gemv_kernel[(programs,)](stacked_w, x8, x_scale, stacked_ws, stacked_b, out, LAYERS * N, K=K,
                                               BN=bn, BK=bk, NUM_PROGRAMS=programs, STAGES=stages, num_warps=warps)
            return out

        label = f"streaming: BN {bn}, BK {bk}, {warps} warps, {stages} stages, {per_sm} programs per SM"
        try:
            got = call().clone()
            record(label, hc.graph_ms_per_call(lambda i, c=call: c(), 5, reps=5), got)
        except Exception as exc:  # one config failing to compile must not hide the rest
            rows.append({"variant": label, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            print(rows[-1], flush=True)
    (out_dir / "modulation_stream.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows},
                                                               indent=1))
    print(f"\n{'variant':80s} {'ms':>7} {'TB/s':>6} {'diff':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:80s} {r['error'][:60]}")
        else:
            print(f"{r['variant']:80s} {r['ms']:7.3f} {r['TB/s']:6.2f} {r['rel_diff_vs_shipped']:9.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
