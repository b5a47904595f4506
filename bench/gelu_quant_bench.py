"""Micro-benchmarks of the fused quantization kernels against Inductor's code for the same math.

* the MLP hidden state's bias + GELU + row-wise fp8 quantize (8192 x 12288 bf16, ``fp8.gelu_quant``);
* a stream input's LayerNorm + modulate + row-wise fp8 quantize (8192 x 3072 bf16, ``fp8.norm_quant``), by the
  one-row and the multi-row kernel;
* the same with the gated residual update first (``residual_modulate_quantize_rowwise``), and Inductor's gated
  residual add alone.

Each at several launch shapes (warps, rows per program); codes compared with the module's reference function.
Timing: 30 calls in one CUDA graph, cycling through 3 input copies (no L2 reuse between calls), median of 7
replays. Eager timing measured the host's custom-op launch (about 0.1 ms), not these kernels. Run on the device:

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

COPIES = 3
"""Input copies the timed calls cycle through, so that one call's input is not in L2 from the call before."""

GRAPH_CALLS = 30


def graph_ms(fn, calls: int = GRAPH_CALLS) -> float:
    """ms per call of ``fn(i)`` (i = 0 .. calls - 1) in one CUDA graph: kernel time without the host's launch
    cost (an eager custom-op launch costs more than these kernels run)."""
    return hc.graph_ms_per_call(fn, calls)


def _time_candidates(candidates: dict, device: torch.device, bytes_moved: int, ref8: torch.Tensor) -> dict:
    """Time each ``label -> fn`` (``fn(i)`` runs on input copy ``i % COPIES`` and returns (e4m3 codes, scales)
    or (new stream, codes, scales)) in a CUDA graph; compare copy 0's codes with ``ref8``."""
    out = {}
    for label, fn in candidates.items():
        ms = graph_ms(fn)
        codes = fn(0)[-2]
        out[label] = {"ms": round(ms, 4), "GB/s": round(bytes_moved / ms / 1e6, 1),
                      "same_codes": float((codes.float() == ref8.float()).float().mean())}
    return out


def measure(device: torch.device, rows: int = 8192, cols: int = 12288, warps: tuple[int, ...] = ()) -> dict:
    """{label: {"ms", "GB/s", "same_codes"}} for Inductor and the kernel (default warps, or each of ``warps``)."""
    from qwen_edit_hopper.fp8 import gelu_quant as gq
    from qwen_edit_hopper.fp8.quant import quantize_rowwise

    ys = [torch.randn(rows, cols, device=device, dtype=torch.bfloat16) * 2 for _ in range(COPIES)]
    bias = torch.randn(cols, device=device, dtype=torch.bfloat16)
    bytes_moved = rows * cols * 3 + rows * 4  # bf16 in, e4m3 out, scales
    ref8, _ = gq.reference_gelu_quantize(ys[0], bias)

    def plain(y, bias):  # what the unfused path computes: bias add, DiffSynth's GELU, quantize_rowwise
        h = y + bias
        return quantize_rowwise(h * torch.sigmoid(1.702 * h))

    compiled = torch.compile(plain)
    candidates = {"inductor": lambda i: compiled(ys[i % COPIES], bias)}
    for w in warps or (gq.DEFAULT_WARPS,):
        for split in (True, False):
            candidates[f"kernel, {w} warps, {'3 chunks' if split else '1 block'}"] = (
                lambda i, w=w, split=split: gq._gelu_quantize_op(ys[i % COPIES], bias, w, split))
    return _time_candidates(candidates, device, bytes_moved, ref8)


MODULATE_CONFIGS = ((0, 4), (0, 2), (1, 2), (1, 4), (2, 4), (2, 8), (4, 8), (4, 16), (8, 16))
"""(rows per program, warps) for the LayerNorm kernels: rows 0 is the one-row kernel, 1+ the multi-row kernel."""


def measure_modulate(device: torch.device, rows: int = 8192, cols: int = 3072,
                     configs: tuple[tuple[int, int], ...] = ()) -> dict:
    """{label: {"ms", "GB/s", "same_codes"}} for Inductor and the LayerNorm + modulate + quantize kernel
    (``fp8.norm_quant.DEFAULT_ROWS`` / ``DEFAULT_WARPS``, or each (rows per program, warps) of ``configs``)."""
    from qwen_edit_hopper.fp8 import norm_quant as nq
    from qwen_edit_hopper.fp8.quant import quantize_rowwise

    xs = [(torch.randn(1, rows, cols, device=device) * 3 + 1).bfloat16() for _ in range(COPIES)]
    mod = torch.randn(1, 6 * cols, device=device, dtype=torch.bfloat16)
    bytes_moved = rows * cols * 3 + rows * 4  # bf16 in, e4m3 out, scales
    ref8, _ = nq.reference_modulate_quantize(xs[0], 1e-6, mod, 6, 0, 1)

    def plain(x, mod):  # what the unfused path computes: the block's addcmul modulation, quantize_rowwise
        p = mod.unflatten(-1, (6, cols)).unsqueeze(1)
        modulated = torch.addcmul(p[:, :, 0], torch.nn.functional.layer_norm(x, (cols,), eps=1e-6), 1 + p[:, :, 1])
        return quantize_rowwise(modulated.reshape(-1, cols))

    compiled = torch.compile(plain)
    candidates = {"inductor": lambda i: compiled(xs[i % COPIES], mod)}
    for per_program, w in configs or ((nq.DEFAULT_ROWS, nq.DEFAULT_WARPS),):
        candidates[f"kernel, {per_program} rows/program, {w} warps"] = (
            lambda i, w=w, r=per_program: nq._modulate_quantize_op(xs[i % COPIES].reshape(-1, cols), rows, 1e-6, mod,
                                                                   6, 0, 1, None, w, True, r))
    return _time_candidates(candidates, device, bytes_moved, ref8)


def measure_residual(device: torch.device, rows: int = 8192, cols: int = 3072,
                     configs: tuple[tuple[int, int], ...] = ()) -> dict:
    """The same for the residual kernel (``x + gate * (y + bias)``, then LayerNorm + modulate + quantize):
    each (rows per program, warps) of ``configs``, and Inductor's gated residual add alone."""
    from qwen_edit_hopper.fp8 import norm_quant as nq

    xs = [(torch.randn(1, rows, cols, device=device) * 3 + 1).bfloat16() for _ in range(COPIES)]
    ys = [torch.randn(rows, cols, device=device, dtype=torch.bfloat16) for _ in range(COPIES)]
    mod = torch.randn(1, 6 * cols, device=device, dtype=torch.bfloat16)
    bytes_moved = rows * cols * 7 + rows * 4  # x and y in, new stream out (bf16), e4m3 out, scales
    _, ref8, _ = nq.reference_residual_modulate_quantize(xs[0], ys[0], None, 1e-6, mod, 6, 5, 0, 1, None)

    def plain(x, y, mod):  # Inductor: the gated residual add alone (what a block's last residual update costs)
        return torch.addcmul(x, mod.unflatten(-1, (6, cols))[:, 5], y.reshape(x.shape))

    compiled = torch.compile(plain)
    candidates = {}
    for per_program, w in configs or ((nq.DEFAULT_ROWS, nq.DEFAULT_WARPS),):
        candidates[f"residual, {per_program} rows/program, {w} warps"] = (
            lambda i, w=w, r=per_program: nq._residual_modulate_quantize_op(
                xs[i % COPIES].reshape(-1, cols), ys[i % COPIES], None, rows, 1e-6, mod, 6, 5, 0, 1, None, w, True, r))
    results = _time_candidates(candidates, device, bytes_moved, ref8)
    ms = graph_ms(lambda i: compiled(xs[i % COPIES], ys[i % COPIES], mod))
    results["inductor: the gated residual add alone"] = {"ms": round(ms, 4),
                                                         "GB/s": round(rows * cols * 6 / ms / 1e6, 1),
                                                         "same_codes": float("nan")}
    return results


def print_table(results: dict, title: str = "GELU+quantize 8192x12288") -> None:
    print(f"{title:32s} {'ms':>7s} {'GB/s':>7s} same-codes")
    for label, row in results.items():
        print(f"{label:32s} {row['ms']:7.4f} {row['GB/s']:7.0f} {row['same_codes']:.6f}", flush=True)


def main() -> int:
    load_pack()
    print_table(measure(torch.device("cuda"), warps=(4, 8, 16, 32)))
    print_table(measure_modulate(torch.device("cuda"), configs=MODULATE_CONFIGS), "LN+modulate+quantize 8192x3072")
    print_table(measure_residual(torch.device("cuda"), configs=MODULATE_CONFIGS), "residual+LN+mod+quant 8192x3072")
    return 0


if __name__ == "__main__":
    sys.exit(main())
