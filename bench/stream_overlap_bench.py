"""Can the text stream's and the modulation's fp8 GEMMs hide behind the image stream's?

Per Qwen-Image block, each image-stream GEMM (M = 8192 tokens, compute-bound) has a text-stream twin with the
same weight shape (M = 300 tokens: it reads as many weight bytes for 27x fewer FLOPs, so it is
memory-bound), and the two modulation GEMMs (M = 1, 3072 -> 18432) are pure weight reads. This times, for
each GEMM shape, at batch 1 and 2 (CFG): the image GEMM alone, the text GEMM alone, both in one stream, both
with the text GEMM on a side stream, and ``torch._scaled_grouped_mm`` over [text; image] where it runs; then
the modulation GEMM alone and beside an image MLP GEMM. All row-wise fp8 (``torch._scaled_mm``, fast
accumulation), CUDA-event medians. Run from the repo root on an H100 / H200:

    python3 bench/stream_overlap_bench.py [--out DIR]
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
MOD = ("mod", 3072, 18432)


def operand(m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    return x, torch.rand(m, 1, device=device) + 0.5


def weight(n: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
    return w, torch.rand(n, 1, device=device) + 0.5


def mm(a, w):
    return torch._scaled_mm(a[0], w[0].t(), scale_a=a[1], scale_b=w[1].t(), out_dtype=torch.bfloat16,
                            use_fast_accum=True)


def time_ms(fn, reps: int = 30) -> float:
    """Median ms of one call (CUDA events around each call, synchronized: small calls include launch gaps)."""
    return hc.time_calls(fn, torch.device("cuda"), warmup=5, reps=reps)["ms"]


def side_by_side(main_fn, side_fn, side: torch.cuda.Stream):
    """side_fn on ``side`` (forked from and joined to the current stream), main_fn on the current one."""
    def run():
        current = torch.cuda.current_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            side_fn()
        main_fn()
        current.wait_stream(side)
    return run


def grouped(x_txt, x_img, w_txt, w_img):
    """One ``torch._scaled_grouped_mm`` over [text rows padded to 16; image rows], or None where it cannot run."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return None
    pad = (-x_txt[0].shape[0]) % 16
    a = torch.cat([torch.nn.functional.pad(x_txt[0].view(torch.uint8), (0, 0, 0, pad)).view(torch.float8_e4m3fn),
                   x_img[0]])
    sa = torch.cat([torch.nn.functional.pad(x_txt[1], (0, 0, 0, pad), value=1.0), x_img[1]]).flatten()
    b = torch.stack([w_txt[0], w_img[0]]).transpose(1, 2)  # (2, K, N), column-major per group
    sb = torch.stack([w_txt[1].flatten(), w_img[1].flatten()])
    offs = torch.tensor([x_txt[0].shape[0] + pad, a.shape[0]], device=a.device, dtype=torch.int32)

    def run():
        return torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True)
    try:
        run()
        torch.cuda.synchronize()
    except Exception as exc:  # reported, not hidden
        print(f"  _scaled_grouped_mm: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}")
        return None
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    args = parser.parse_args()
    device = torch.device("cuda")
    side = torch.cuda.Stream()
    rows = []
    for batch in (1, 2):
        for name, k, n in SHAPES:
            x_img, x_txt = operand(8192 * batch, k, device), operand(300 * batch, k, device)
            w_img, w_txt = weight(n, k, device), weight(n, k, device)
            row = {"gemm": name, "batch": batch,
                   "image": time_ms(lambda: mm(x_img, w_img)),
                   "text": time_ms(lambda: mm(x_txt, w_txt)),
                   "sequential": time_ms(lambda: (mm(x_txt, w_txt), mm(x_img, w_img))),
                   "text on side stream": time_ms(side_by_side(lambda: mm(x_img, w_img), lambda: mm(x_txt, w_txt),
                                                               side))}  # fmt: skip
            run = grouped(x_txt, x_img, w_txt, w_img)
            row["grouped"] = time_ms(run) if run else None
            rows.append(row)
            print(row, flush=True)
        x_mod, w_mod = operand(batch, MOD[1], device), weight(MOD[2], MOD[1], device)
        x_fc1, w_fc1 = operand(8192 * batch, 3072, device), weight(12288, 3072, device)
        w_mod16 = torch.randn(MOD[2], MOD[1], device=device, dtype=torch.bfloat16)
        x_mod16 = torch.randn(batch, MOD[1], device=device, dtype=torch.bfloat16)
        row = {"gemm": "mod (M = batch) beside image fc1", "batch": batch,
               "image": time_ms(lambda: mm(x_fc1, w_fc1)),
               "text": time_ms(lambda: mm(x_mod, w_mod)),
               "mod bf16": time_ms(lambda: x_mod16 @ w_mod16.t()),
               "sequential": time_ms(lambda: (mm(x_mod, w_mod), mm(x_fc1, w_fc1))),
               "text on side stream": time_ms(side_by_side(lambda: mm(x_fc1, w_fc1), lambda: mm(x_mod, w_mod), side))}
        rows.append(row)
        print(row, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stream_overlap.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                                              "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"\n{'gemm':34s} B  {'image':>7s} {'text':>7s} {'seq':>7s} {'side':>7s} {'grouped':>7s}  saved/block-gemm")
    for r in rows:
        g = f"{r['grouped']:7.3f}" if r.get("grouped") else "      -"
        print(f"{r['gemm']:34s} {r['batch']}  {r['image']:7.3f} {r['text']:7.3f} {r['sequential']:7.3f} "
              f"{r['text on side stream']:7.3f} {g}  {r['sequential'] - r['text on side stream']:+.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
