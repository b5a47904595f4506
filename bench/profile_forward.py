"""Where the time of the pack's fastest DiT forward goes (kernel profile), per options value and attention backend.

Full-size Qwen-Image-Edit DiT, random weights, 1024x1024 edit with one reference image (8192 image +
300 text tokens), batch 1, the pack's fast forward with regional compile, the fastest preset (row-wise
scaled-mm, "attn+mlp+mod compute", fast accumulation, the workspace-free cuBLASLt call). A variant is a
``ForwardOptions`` value and an attention backend; per variant: ms per forward (CUDA events, median of 7 after
warm-up), the first call (compile), the whole-forward relative error against bf16 eager, the kernel plan (which
fused kernels ran, which were left out and why), and a kernel-time profile grouped into attention / fp8 GEMM / bf16
GEMM / fused elementwise (Triton) / other, with the top kernels of the shipped variant.

Variants (``--options``, each ``shipped``, ``unfused`` or ``shipped-without:FIELD[+FIELD...]``; default: unfused,
shipped, unfused again for the clock drift over the run) with ``--attention`` (default ``cudnn_fp8``; several
backends: the shipped options with each). Run from the repo root on an H100/H200::

    source bench/prepare_device.sh --device
    python3 bench/profile_forward.py [--options shipped shipped-without:joint_v_gemm]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness_core as hc
import harness_models as hm

CATEGORIES = (
    # first: Inductor names a Triton kernel after the ops fused into it ("..._cudnn_fp8_attention_...",
    # "..._cublaslt_rowwise_mm_..."), which are not the kernels those ops launch themselves
    ("Triton fused elementwise", ("triton_",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn", "_attn")),
    # cuBLAS's nvjet kernels name fp8 operands "qq" (nvjet_sm90_qqtst_...), bf16 ones not (nvjet_sm90_tst_...)
    ("fp8 GEMM", ("e4m3", "f8f8", "fp8", "scaled_mm", "sm90_xmma_gemm_f8", "nvjet_sm90_qq")),
    ("bf16 GEMM", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
)
"""Kernel categories by name fragments, the first match wins."""


def category(name: str) -> str:
    lower = name.lower()
    for label, keys in CATEGORIES:
        if any(k in lower for k in keys):
            return label
    return "other"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def options_named(spec: str):
    """``shipped``, ``unfused``, ``shipped-without:FIELD[+FIELD...]`` or ``shipped-with:FIELD[+FIELD...]`` (a
    True/False field turned on) as a ``ForwardOptions``."""
    from qwen_edit_hopper.qwen_edit.fast.options import SHIPPED, UNFUSED

    if spec == "shipped":
        return SHIPPED
    if spec == "unfused":
        return UNFUSED
    without, with_ = "shipped-without:", "shipped-with:"
    if not spec.startswith((without, with_)):
        raise SystemExit(f"--options {spec!r}: use shipped, unfused, {without}FIELD[+FIELD...] or {with_}FIELD[+...]")
    turn_on = spec.startswith(with_)
    options = SHIPPED
    for field in spec.split(":", 1)[1].split("+"):
        if not hasattr(options, field):
            allowed = ", ".join(f.name for f in dataclasses.fields(options))
            raise SystemExit(f"--options {spec!r}: no option {field!r}; options: {allowed}")
        value = getattr(options, field)
        if turn_on and not isinstance(value, bool):
            raise SystemExit(f"--options {spec!r}: {field} is not a True/False option")
        options = dataclasses.replace(options, **{field: turn_on if isinstance(value, bool) else ()})
    return options


def profile(fn) -> dict:
    """Kernel time per name and per category of one call of ``fn``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 1000.0, e.count) for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    totals: dict[str, float] = {}
    for name, ms, _ in rows:
        totals[category(name)] = totals.get(category(name), 0.0) + ms
    return {"total_ms": sum(r[1] for r in rows), "by_category": totals,
            "top": [[name[:140], round(ms, 2), count] for name, ms, count in rows[:25]]}


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
    parser.add_argument("--options", nargs="+", metavar="SPEC", default=["unfused", "shipped", "unfused"],
                        help="options values to profile (shipped, unfused, shipped-without:FIELD[+FIELD...])")
    parser.add_argument("--attention", nargs="+", metavar="BACKEND", default=["cudnn_fp8"],
                        help="attention backends; with several, the first --options value with each backend")
    parser.add_argument("--graphs", action="store_true",
                        help="run each variant through the pack's whole-forward CUDA graphs (fast.graphs)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="also time each variant's forward captured whole in one CUDA graph and replayed (no host "
                             "launch overhead: what the host side costs per forward)")  # fmt: skip
    args = parser.parse_args()
    hc.load_pack()
    from qwen_edit_hopper.qwen_edit import fast_forward as ff
    from qwen_edit_hopper.qwen_edit.compile import dynamo_settings

    if len(args.attention) > 1:
        variants = [(args.options[0], backend) for backend in args.attention]
    else:
        variants = [(spec, args.attention[0]) for spec in args.options]

    device = torch.device("cuda")
    base = hm.build_dit(hm.FULL, device)
    inputs = hm.ForwardInputs.make(1024, 1024, 300, 3584, device)
    reference = hm.fast_forward(ff, base, inputs)
    module = hm.fastest_fp8_dit(base).module
    del base
    hc.free_memory()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "variants": {}, "profiles": {}}
    with dynamo_settings():
        for index, (spec, backend) in enumerate(variants):
            torch._dynamo.reset()
            label = f"{index}: options {spec}, attention {backend}" + (", CUDA graphs" if args.graphs else "")
            options = options_named(spec)
            prepared = ff.PreparedDit(module)
            prepared.compile_blocks()
            if args.graphs:
                prepared.enable_cuda_graphs()

            def call(prepared=prepared, options=options, backend=backend):
                return hm.fast_forward(ff, prepared, inputs, attention=backend, options=options)

            started = time.perf_counter()
            call()
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - started
            ms = hc.time_calls(call, device, warmup=3, reps=7)["ms"]
            error = rel_err(call(), reference)
            entry = results["variants"][label] = {"ms": round(ms, 2), "rel_err": error,
                                                  "first_call_s": round(compile_s, 1),
                                                  "kernels": prepared.last_plan.describe()}
            print(f"{label:72s} {ms:8.1f} ms  err {error:.2e}  first call {compile_s:.0f} s", flush=True)
            print(entry["kernels"], flush=True)
            if args.cuda_graph:
                entry["cuda_graph"] = graphed(call, reference, device)
                print(f"{'  ... captured in one CUDA graph':72s} {entry['cuda_graph']}", flush=True)
            results["profiles"][label] = profile(call)
            if spec == "shipped" and "profile" not in results:
                results["profile"] = {"variant": label, **results["profiles"][label]}
            del prepared, call
            gc.collect()
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile_forward.json").write_text(json.dumps(results, indent=1))
    for label, variant in results["variants"].items():
        graph = variant.get("cuda_graph", {})
        print(f"{label:72s} {variant['ms']:8.1f} ms  err {variant['rel_err']:.2e}"
              + (f"  | one CUDA graph {graph['ms']:8.1f} ms err {graph['rel_err']:.2e}" if "ms" in graph else
                 f"  | CUDA graph: {graph['error'][:80]}" if graph else ""))
    for label, p in results["profiles"].items():
        cats = ", ".join(f"{name} {ms:.1f}" for name, ms in sorted(p["by_category"].items(), key=lambda kv: -kv[1]))
        print(f"kernels of {label[:60]}: {p['total_ms']:.1f} ms ({cats})")
    prof = results.get("profile")
    if prof is not None:
        print(f"\nPROFILE of {prof['variant']}: {prof['total_ms']:.1f} ms of kernels")
        for name, ms in sorted(prof["by_category"].items(), key=lambda kv: -kv[1]):
            print(f"  {name:28s} {ms:7.1f} ms  {100 * ms / prof['total_ms']:5.1f}%")
        print("top kernels:")
        for name, ms, count in prof["top"][:15]:
            print(f"  {ms:7.1f} ms {count:5d}x  {name[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
