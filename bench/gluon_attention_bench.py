#!/usr/bin/env python3
"""The Gluon int8-QK attention kernel against cuDNN SDPA and the Triton 8-bit kernel: accuracy and time.

Run from the repository root on the device machine (about a minute)::

    python3 bench/gluon_attention_bench.py      # $OUT/gluon_attention.json, table last

Accuracy: ||out - ref|| / ||ref|| against float64 attention for S in (100, 300, 2304, 8492), B = 1
(contiguous (B, H, S, D)) and B = 2 (the DiT's (B, S, H, D) memory seen as (B, H, S, D)); and the
difference to ``triton_fp8`` with the same quantization (int8 QK, bf16 PV), which isolates the
kernel from the numerics. Time: CUDA-graph replays (``attention_bench.time_graphed``) at S = 8492,
B = 1 and 2, of the whole backend call (quantization passes included) and of the attention
kernel alone on prequantized inputs. TFLOP/s counts 4*B*H*S^2*D.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention_bench as ab
import torch
from qwen_edit_hopper.fp8.attention import attention
from qwen_edit_hopper.fp8.attention import gluon_int8 as gi
from qwen_edit_hopper.fp8.attention import triton_fp8 as tf

TRITON_BEST = tf.Fp8AttentionConfig(qk_format="int8", pv_format="bf16", block_m=64, block_n=128, num_warps=4)
GLUON_CONFIGS = [gi.GluonAttentionConfig(w, s, n) for w, s, n in ((4, 4, 64), (4, 2, 64), (4, 2, 128), (8, 3, 128))]


def bshd_view(t: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) values in (B, S, H, D) memory, as the DiT's transposes produce them."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def accuracy(device) -> list[dict]:
    rows = []
    for s, b in ((100, 1), (300, 1), (2304, 1), (8492, 1), (300, 2), (8492, 2)):
        q, k, v = ab.make_inputs(b, s, "gauss", 0, device)
        if b == 2:
            q, k, v = bshd_view(q), bshd_view(k), bshd_view(v)
        ref = ab.reference(q, k, v)
        tri = attention(q, k, v, "triton_fp8", config=TRITON_BEST)
        row = {"S": s, "B": b, "cudnn": ab.rel_err(attention(q, k, v, "sdpa_cudnn"), ref),
               "triton_fp8": ab.rel_err(tri, ref)}  # fmt: skip
        for cfg in GLUON_CONFIGS:
            out = attention(q, k, v, "gluon_int8", config=cfg)
            row[cfg.label] = ab.rel_err(out, ref)
            row[cfg.label + " vs triton_fp8"] = ab.rel_err(out, tri.double())
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def calls_for(sets: list, preps: list) -> dict:
    """name -> fn(i) over input set i: the whole backend calls, the quantization alone, the kernels alone."""
    calls = {
        "sdpa_cudnn": lambda i: attention(*sets[i], "sdpa_cudnn"),
        "triton_fp8 " + TRITON_BEST.label: lambda i: attention(*sets[i], "triton_fp8", config=TRITON_BEST),
        "quantize_qkv only": lambda i: tf.quantize_qkv(*sets[i], gi._QUANT_CONFIG),
    }
    for cfg in GLUON_CONFIGS:
        calls[cfg.label] = lambda i, cfg=cfg: attention(*sets[i], "gluon_int8", config=cfg)
        calls[cfg.label + " kernel only"] = lambda i, cfg=cfg: gi.gluon_attention_from_quantized(
            preps[i].q8, preps[i].qs, preps[i].k8, preps[i].ks, sets[i][2], preps[i].s_pad, cfg
        )
    return calls


def timing(device) -> list[dict]:
    rows = []
    for b in (1, 2):
        s = 8492
        sets = [tuple(bshd_view(t) for t in ab.make_inputs(b, s, "gauss", i, device)) for i in range(ab.N_SETS)]
        flops = 4 * b * ab.H * s * s * ab.D
        preps = [tf.quantize_qkv(*x, gi._QUANT_CONFIG) for x in sets]
        for name, fn in calls_for(sets, preps).items():
            try:
                times, how = ab.time_graphed(fn, ab.N_SETS)
                ms = statistics.median(times)
                row = {"S": s, "B": b, "call": name, "ms": round(ms, 4), "timing": how,
                       "tflops": round(flops / ms / 1e9, 1)}  # fmt: skip
            except Exception as exc:  # a variant that fails is reported, the others still run
                row = {"S": s, "B": b, "call": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    device = torch.device("cuda")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "accuracy": accuracy(device),
              "timing": timing(device)}  # fmt: skip
    out = Path(os.environ.get("OUT", "bench/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gluon_attention.json").write_text(json.dumps(result, indent=1))
    print(f"\n{result['gpu']}, torch {result['torch']}")
    print("accuracy (rel. err vs float64):")
    for row in result["accuracy"]:
        print("  " + "  ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    print("time at S=8492 (CUDA graph replay):")
    for b in (1, 2):
        base = next(r["ms"] for r in result["timing"] if r["B"] == b and r["call"] == "sdpa_cudnn")
        for row in (r for r in result["timing"] if r["B"] == b):
            if "error" in row:
                print(f"  B={b} {row['call']:44s} ERROR {row['error']}")
            else:
                print(f"  B={b} {row['call']:44s} {row['ms']:7.3f} ms {row['tflops']:6.0f} TFLOP/s "
                      f"{base / row['ms']:5.2f}x cuDNN")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
