"""Where the time of the pack's fastest DiT forward goes (kernel profile), and what the fused MLP kernel saves.

Full-size Qwen-Image-Edit DiT, random weights, 1024x1024 edit with one reference image (8192 image +
300 text tokens), batch 1, the pack's fast forward with regional compile, the fastest preset (row-wise
scaled-mm, "attn+mlp+mod compute", fast accumulation). First the MLP hidden state alone (8192 x 12288):
Inductor's compiled bias + GELU + row-wise quantize against ``fp8.gelu_quant``'s kernel, and a stream
input (8192 x 3072) through LayerNorm + modulate + quantize against ``fp8.norm_quant``'s. Then per
variant (quantization by Inductor's kernels, or by the fused kernels): ms per forward (CUDA events,
median of 7 after warm-up), whole-forward relative error vs bf16 eager, and a kernel-time profile
grouped into attention / fp8 GEMM / bf16 GEMM / fused elementwise (Triton) / other, with the top
kernels (of the last variant). Run from the repo root on an H100/H200:

    source bench/device_env.sh && python3 bench/profile_forward.py [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import gelu_quant_bench
import harness_core as hc
import harness_models as hm
import kernel_timeline
from pack import load_pack

CATEGORIES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn", "_attn")),
    ("fp8 GEMM", ("e4m3", "f8f8", "fp8", "scaled_mm", "sm90_xmma_gemm_f8")),
    ("bf16 GEMM", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
    ("Triton fused elementwise", ("triton_",)),
)


def category(name: str) -> str:
    lower = name.lower()
    for label, keys in CATEGORIES:
        if any(k in lower for k in keys):
            return label
    return "other"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def profile(fn, with_timeline: bool = False) -> dict:
    """Kernel time per name and per category of one call of ``fn``; with ``with_timeline``, also the device
    timeline's idle time and one block's kernel sequence (:mod:`kernel_timeline`)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    extra = {"timeline": kernel_timeline.timeline(prof)} if with_timeline else {}
    rows = [(e.key, e.device_time_total / 1000.0, e.count) for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    totals: dict[str, float] = {}
    for name, ms, _ in rows:
        totals[category(name)] = totals.get(category(name), 0.0) + ms
    return {"total_ms": sum(r[1] for r in rows), "by_category": totals,
            "top": [[name[:140], round(ms, 2), count] for name, ms, count in rows[:25]], **extra}


def graphed(call, reference: torch.Tensor, device: torch.device) -> dict:
    """``call`` captured in one CUDA graph (after warm-up on a side stream) and replayed: ms and error, or why not."""
    try:
        graph, out = hc.capture_cuda_graph(call)
        ms = hc.time_calls(graph.replay, device, warmup=3, reps=7)["ms"]
        graph.replay()
        error = rel_err(out, reference)
        del graph
        return {"ms": round(ms, 2), "rel_err": error}
    except Exception as exc:  # reported in the table, not hidden
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    parser.add_argument("--attention", nargs="+", metavar="BACKEND",
                        help="instead of the kernel variants: the shipped preset with each attention backend "
                             "(the first one again at the end), no micro-benchmarks; suffixes: -inductor-qk (no "
                             "fused QK norm + RoPE + quantize kernel), -inductor-v (no fused v quantize kernels), "
                             "-unsplit (GELU / LayerNorm kernels without the three-chunk rows), -permod (modulation "
                             "linears called per block, not in two shared-input launches), -graphs (the pack's "
                             "whole-forward CUDA graphs, fast.graphs), -small-m-text-out (the text stream's output "
                             "projection through the small-M Triton GEMM, not cuBLASLt)")  # fmt: skip
    parser.add_argument("--timeline", action="store_true",
                        help="also each variant's device timeline under the profiler: idle time between kernels, "
                             "tiny kernels, one block's kernel sequence")  # fmt: skip
    parser.add_argument("--cuda-graph", action="store_true",
                        help="also time each variant's forward captured whole in one CUDA graph and replayed (no host "
                             "launch overhead: what the host side costs per forward)")  # fmt: skip
    args = parser.parse_args()
    load_pack()
    from qwen_edit_hopper.fp8 import Fp8Config
    from qwen_edit_hopper.qwen_edit import fast_forward as ff
    from qwen_edit_hopper.qwen_edit.compile import dynamo_settings
    from qwen_edit_hopper.qwen_edit.fp8_dit import build_fp8_dit

    device = torch.device("cuda")
    base = hm.build_dit(hm.FULL, device)
    inputs = hm.ForwardInputs.make(1024, 1024, 300, 3584, device)
    reference = hm.fast_forward(ff, base, inputs)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "variants": {}}
    fast_accum = Fp8Config(backend="scaled_mm_rowwise", preset="attn+mlp+mod compute", fast_accum=True,
                           gemm_kernel="cublaslt")
    # (label, fp8 config, fused GELU + quantize kernel in the MLP, fused LayerNorm + modulate + quantize kernel,
    # attention backend)
    if args.attention:
        backends = [*args.attention, args.attention[0]]
        variants = [(f"shipped kernels, attention {b}" + (" (again)" if i == len(backends) - 1 else ""),
                     fast_accum, True, True, b) for i, b in enumerate(backends)]  # fmt: skip
    else:
        results["gelu_quant_kernel"] = gelu_quant_bench.measure(device)
        gelu_quant_bench.print_table(results["gelu_quant_kernel"])
        results["modulate_quant_kernel"] = gelu_quant_bench.measure_modulate(device)
        gelu_quant_bench.print_table(results["modulate_quant_kernel"], "LN+modulate+quantize 8192x3072")
        variants = [
            ("fastest preset, Inductor quantization", fast_accum, False, False, "sdpa"),
            ("fastest preset, fused GELU+quantize kernel", fast_accum, True, False, "sdpa"),
            ("fastest preset, fused GELU+quantize and residual+LN+modulate+quantize kernels (shipped)", fast_accum,
             True, True, "sdpa"),
            ("fastest preset, Inductor quantization (again: clock drift over the run)", fast_accum, False, False,
             "sdpa"),
        ]
    from qwen_edit_hopper.fp8 import gelu_quant, small_m_gemm
    from qwen_edit_hopper.qwen_edit.fast import fp8_attention, graphs, modulation, prequant
    from qwen_edit_hopper.qwen_edit.fast import mlp as fast_mlp

    with dynamo_settings():
        for label, config, fused_gelu, fused_norm, backend in variants:
            torch._dynamo.reset()
            fast_mlp.FUSED_GELU_QUANT, prequant.FUSED_NORM_QUANT = fused_gelu, fused_norm
            # suffixes: "-inductor-qk" (QK norm + RoPE + e4m3 cast left to Inductor), "-inductor-v" (v's bias +
            # concatenation + max + cast left to Inductor), "-unsplit" (GELU / LayerNorm kernels: one masked block
            # per row instead of three chunks), "-small-m-text-out" (the text stream's output projection through
            # the small-M Triton GEMM instead of cuBLASLt)
            fp8_attention.FUSED_QK_QUANT = "-inductor-qk" not in backend
            fp8_attention.FUSED_V_QUANT = "-inductor-v" not in backend
            gelu_quant.SPLIT_ROWS = "-unsplit" not in backend
            if "-small-m-text-out" in backend:
                small_m_gemm.CONFIGS[(3072, 3072)] = small_m_gemm.OUTPUT_PROJECTION_CONFIG
            else:
                small_m_gemm.CONFIGS.pop((3072, 3072), None)
            modulation.FUSED_MODULATION = "-permod" not in backend
            with_graphs = "-graphs" in backend
            backend = backend.split("-")[0]
            module = build_fp8_dit(base, config)
            ff.compile_blocks(module)
            if with_graphs:
                graphs.enable_cuda_graphs(module)

            def call(module=module, backend=backend):
                return hm.fast_forward(ff, module, inputs, attention=backend)
            started = time.perf_counter()
            call()
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - started
            ms = hc.time_calls(call, device, warmup=3, reps=7)["ms"]
            error = rel_err(call(), reference)
            results["variants"][label] = {"ms": round(ms, 2), "rel_err": error, "first_call_s": round(compile_s, 1)}
            print(f"{label:88s} {ms:8.1f} ms  err {error:.2e}  first call {compile_s:.0f} s", flush=True)
            if args.cuda_graph:
                graph = results["variants"][label]["cuda_graph"] = graphed(call, reference, device)
                print(f"{'  ... captured in one CUDA graph':88s} {graph}", flush=True)
            results.setdefault("profiles", {})[label] = profile(call, args.timeline)
            if "shipped" in label and "profile" not in results:
                results["profile"] = {"variant": label, **results["profiles"][label]}
            del module, call
            gc.collect()
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile_forward.json").write_text(json.dumps(results, indent=1))
    prof = results["profile"]
    for label, variant in results["variants"].items():
        graph = variant.get("cuda_graph", {})
        print(f"{label:88s} {variant['ms']:8.1f} ms  err {variant['rel_err']:.2e}"
              + (f"  | one CUDA graph {graph['ms']:8.1f} ms err {graph['rel_err']:.2e}" if "ms" in graph else
                 f"  | CUDA graph: {graph['error'][:80]}" if graph else ""))
    for label, p in results.get("profiles", {}).items():
        cats = ", ".join(f"{name} {ms:.1f}" for name, ms in sorted(p["by_category"].items(), key=lambda kv: -kv[1]))
        print(f"kernels of {label[:60]}: {p['total_ms']:.1f} ms ({cats})")
    for label, p in results.get("profiles", {}).items():
        if "timeline" in p:
            kernel_timeline.print_summary(label, p["timeline"])
    print(f"\nPROFILE of {prof['variant']}: {prof['total_ms']:.1f} ms of kernels")
    for name, ms in sorted(prof["by_category"].items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {ms:7.1f} ms  {100 * ms / prof['total_ms']:5.1f}%")
    print("top kernels:")
    for name, ms, count in prof["top"][:15]:
        print(f"  {ms:7.1f} ms {count:5d}x  {name[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
