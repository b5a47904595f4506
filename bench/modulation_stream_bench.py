#!/usr/bin/env python3
"""How fast can the 120 modulation GEMVs read their 6.8 GB? The pack's launch configurations against a stacked buffer.

``fp8.shared_input_gemv.SharedInputLinears`` reads the 120 separate e4m3 weights (3072 -> 18432 each) through an
address table. Measured here, at one and two input rows (batch 1 and true-CFG batch 2):

* the configurations before the sixteenth session (``rowsum`` one-row kernel, tensor-core kernel at two rows)
  without the 16-byte alignment hint: the addresses read from the table got byte-wide loads;
* the same kernels with the hint (``SharedInputLinears.aligned``, shipped since the sixteenth session);
* a reference: a persistent kernel over the weights stacked in one buffer (the fifteenth session's bench, where
  the pointer is an argument and so known to be aligned).

(The sixteenth session also measured a persistent kernel over the address table, with the hint: 1.558 ms at one
row, 2.87 ms at two, against 1.508 / 1.601 for the kernels below; not kept.)

Per variant: ms for all 120 layers (CUDA graph of 5 calls, replayed, median of 5), TB/s of weight read, and the
relative difference to the layers' own reference (``reference_shared_input``). Run from the repository root on an
H100 / H200 (JSON in ``$OUT/modulation_stream.json``)::

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
from qwen_edit_hopper.fp8.shared_input_gemv import (  # noqa: E402
    DOT_CONFIG,
    FMA_CONFIG,
    ONE_ROW_CONFIG,
    SharedInputLinears,
    reference_shared_input,
)

LAYERS, N, K = 120, 18432, 3072


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
    group = SharedInputLinears(layers)
    assert group.aligned
    stacked_w = torch.cat([layer.weight for layer in layers])  # (120 * 18432, 3072) e4m3, one buffer
    stacked_ws = torch.cat([layer.weight_scale.reshape(-1) for layer in layers]).float()
    stacked_b = torch.cat([layer.bias for layer in layers])
    out = torch.empty(LAYERS * N, device=device, dtype=torch.bfloat16)
    gb = LAYERS * N * K / 1e9
    rows_out = []

    for rows in (1, 2):
        x = torch.randn(rows, K, device=device, dtype=torch.bfloat16)
        want = reference_shared_input(layers, x).float()

        def record(label, ms, got, rows=rows, want=want):
            err = float((got.float().reshape(want.shape) - want).norm() / want.norm())
            row = {"rows": rows, "variant": label, "ms": round(ms, 3), "TB/s": round(gb / ms, 2),
                   "rel_diff_vs_reference": err}
            rows_out.append(row)
            print(row, flush=True)

        variants = [(f"before: {ONE_ROW_CONFIG if rows == 1 else DOT_CONFIG}, no alignment hint",
                     ONE_ROW_CONFIG if rows == 1 else DOT_CONFIG, False)]
        variants += [(f"{c}, alignment hint", c, True) for c in ((ONE_ROW_CONFIG, FMA_CONFIG) if rows == 1 else
                                                                  (DOT_CONFIG, (4, 1024, 2, 2, "rowsum")))]
        for label, config, aligned in variants:
            group.config, group.aligned = config, aligned
            try:
                got = group(x).clone()
                record(label, hc.graph_ms_per_call(lambda i, x=x: group(x), 5, reps=5), got)
            except Exception as exc:  # one config failing to compile must not hide the rest
                rows_out.append({"rows": rows, "variant": label, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                print(rows_out[-1], flush=True)
        if rows == 1:
            x8, x_scale = layers[0].quantize_input(x)
            x8, x_scale = x8.reshape(-1), x_scale.reshape(1).float()
            for bn, per_sm in ((16, 8),):
                programs = sms * per_sm

                def call(bn=bn, programs=programs, x8=x8, x_scale=x_scale):
                    streaming_gemv_kernel[(programs,)](stacked_w, x8, x_scale, stacked_ws, stacked_b, out, LAYERS * N,
                                                       K=K, BN=bn, BK=1024, NUM_PROGRAMS=programs, STAGES=2,
                                                       num_warps=4)  # fmt: skip
                    return out

                got = call().clone()
                record(f"reference: stacked buffer, BN {bn}, {per_sm} programs per SM",
                       hc.graph_ms_per_call(lambda i, c=call: c(), 5, reps=5), got)
    group.config, group.aligned = None, True
    (out_dir / "modulation_stream.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                                                "rows": rows_out}, indent=1))
    print(f"\n{'rows':>4} {'variant':72s} {'ms':>7} {'TB/s':>6} {'diff':>9}")
    for r in rows_out:
        if "error" in r:
            print(f"{r['rows']:4d} {r['variant']:72s} {r['error'][:60]}")
        else:
            diff = r["rel_diff_vs_reference"]
            print(f"{r['rows']:4d} {r['variant']:72s} {r['ms']:7.3f} {r['TB/s']:6.2f} {diff:9.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
