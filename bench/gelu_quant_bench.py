"""Micro-benchmarks of the fused quantization kernels against Inductor's code for the same math.

* the MLP hidden state's bias + GELU + row-wise fp8 quantize (8192 x 12288 bf16, ``fp8.gelu_quant``);
* a stream input's LayerNorm + modulate + row-wise fp8 quantize (8192 x 3072 bf16, ``fp8.norm_quant``).

Each at several warps per row; codes compared with the module's reference function. CUDA events,
median of 50. Run on the device:

    source bench/device_env.sh && python3 bench/gelu_quant_bench.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import harness_core as hc
from pack import load_pack


def _time_candidates(candidates: dict, device: torch.device, bytes_moved: int, ref8: torch.Tensor) -> dict:
    """Time each ``label -> fn`` (fn returns (e4m3 codes, scales)) and compare its codes with ``ref8``."""
    out = {}
    for label, fn in candidates.items():
        ms = hc.time_calls(fn, device, warmup=5, reps=50)["ms"]
        codes, _ = fn()
        out[label] = {"ms": round(ms, 4), "GB/s": round(bytes_moved / ms / 1e6, 1),
                      "same_codes": float((codes.float() == ref8.float()).float().mean())}
    return out


def measure(device: torch.device, rows: int = 8192, cols: int = 12288, warps: tuple[int, ...] = ()) -> dict:
    """{label: {"ms", "GB/s", "same_codes"}} for Inductor and the kernel (default warps, or each of ``warps``)."""
    from qwen_edit_hopper.fp8 import gelu_quant as gq
    from qwen_edit_hopper.fp8.quant import quantize_rowwise

    y = torch.randn(rows, cols, device=device, dtype=torch.bfloat16) * 2
    bias = torch.randn(cols, device=device, dtype=torch.bfloat16)
    bytes_moved = rows * cols * 3 + rows * 4  # bf16 in, e4m3 out, scales
    ref8, _ = gq.reference_gelu_quantize(y, bias)

    def plain(y, bias):  # what the unfused path computes: bias add, DiffSynth's GELU, quantize_rowwise
        h = y + bias
        return quantize_rowwise(h * torch.sigmoid(1.702 * h))

    compiled = torch.compile(plain)
    candidates = {"inductor": lambda: compiled(y, bias)}
    for w in warps or (gq.DEFAULT_WARPS,):
        for split in (True, False):
            candidates[f"kernel, {w} warps, {'3 chunks' if split else '1 block'}"] = (
                lambda w=w, split=split: gq._gelu_quantize_op(y, bias, w, split))
    return _time_candidates(candidates, device, bytes_moved, ref8)


def measure_modulate(device: torch.device, rows: int = 8192, cols: int = 3072, warps: tuple[int, ...] = ()) -> dict:
    """{label: {"ms", "GB/s", "same_codes"}} for Inductor and the LayerNorm + modulate + quantize kernel."""
    from qwen_edit_hopper.fp8 import norm_quant as nq
    from qwen_edit_hopper.fp8.quant import quantize_rowwise

    x = (torch.randn(1, rows, cols, device=device) * 3 + 1).bfloat16()
    mod = torch.randn(1, 6 * cols, device=device, dtype=torch.bfloat16)
    bytes_moved = rows * cols * 3 + rows * 4  # bf16 in, e4m3 out, scales
    ref8, _ = nq.reference_modulate_quantize(x, 1e-6, mod, 6, 0, 1)

    def plain(x, mod):  # what the unfused path computes: the block's addcmul modulation, quantize_rowwise
        p = mod.unflatten(-1, (6, cols)).unsqueeze(1)
        modulated = torch.addcmul(p[:, :, 0], torch.nn.functional.layer_norm(x, (cols,), eps=1e-6), 1 + p[:, :, 1])
        return quantize_rowwise(modulated.reshape(-1, cols))

    compiled = torch.compile(plain)
    candidates = {"inductor": lambda: compiled(x, mod)}
    for w in warps or (nq.DEFAULT_WARPS,):
        for split in (True, False):
            candidates[f"kernel, {w} warps, {'3 chunks' if split else '1 block'}"] = (
                lambda w=w, split=split: nq._modulate_quantize_op(x.reshape(-1, cols), rows, 1e-6, mod, 6, 0, 1, None,
                                                                  w, split))
    return _time_candidates(candidates, device, bytes_moved, ref8)


def print_table(results: dict, title: str = "GELU+quantize 8192x12288") -> None:
    print(f"{title:32s} {'ms':>7s} {'GB/s':>7s} same-codes")
    for label, row in results.items():
        print(f"{label:32s} {row['ms']:7.4f} {row['GB/s']:7.0f} {row['same_codes']:.6f}", flush=True)


def main() -> int:
    load_pack()
    print_table(measure(torch.device("cuda"), warps=(4, 8, 16, 32)))
    print_table(measure_modulate(torch.device("cuda"), warps=(2, 4, 8, 16)), "LN+modulate+quantize 8192x3072")
    return 0


if __name__ == "__main__":
    sys.exit(main())
