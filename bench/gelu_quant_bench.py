"""Micro-benchmark of the MLP hidden state's bias + GELU + row-wise fp8 quantize (8192 x 12288 bf16).

Inductor's compiled plain-torch version against ``fp8.gelu_quant``'s Triton kernel in its variants
(warps per row). CUDA events, median of 50. Run on the device:

    source bench/device_env.sh && python3 bench/gelu_quant_bench.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from pack import load_pack


def time_ms(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    load_pack()
    from qwen_edit_hopper.fp8 import gelu_quant as gq
    from qwen_edit_hopper.fp8.quant import quantize_rowwise

    rows, cols = 8192, 12288
    y = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 2
    bias = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
    bytes_moved = rows * cols * 3 + rows * 4
    ref8, _ = gq.reference_gelu_quantize(y, bias)

    def plain(y, bias):
        h = y + bias
        return quantize_rowwise(h * torch.sigmoid(1.702 * h))

    compiled = torch.compile(plain)
    candidates = {"inductor": lambda: compiled(y, bias)}
    for warps in (4, 8, 16, 32):
        candidates[f"kernel warps={warps}"] = lambda warps=warps: gq._gelu_quantize_op(y, bias, warps)
    print(f"{'variant':32s} {'ms':>7s} {'GB/s':>7s} same-codes")
    for label, fn in candidates.items():
        ms = time_ms(fn)
        h8, _ = fn()
        same = float((h8.float() == ref8.float()).float().mean())
        print(f"{label:32s} {ms:7.4f} {bytes_moved / ms / 1e6:7.0f} {same:.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
