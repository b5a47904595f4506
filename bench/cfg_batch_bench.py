"""Where does a batched true-CFG step (batch 2) spend more than twice one forward? Per-kernel and per-GEMM-shape.

Full-size Qwen-Image-Edit DiT, random weights, 1024x1024 edit with one reference image (8192 image +
300 text tokens), the fastest preset (row-wise fp8 with fast accumulation, "attn+mlp+mod compute",
compiled blocks, ``cudnn_fp8`` attention). Prints, from one process on one GPU:

1. ms of the batch-1 forward and of the batch-2 forward (cond + uncond), timed alternately (power and
   clocks drift over a run), each also captured whole in one CUDA graph (host launch cost removed);
2. a kernel profile of each: device ms per kernel name and per ``aten::_scaled_mm`` input shape, with the
   batch-2 / batch-1 ratio (2.00 = no gain from batching);
3. GEMM micro-benchmarks: one row-wise fp8 GEMM of 2M rows against two of M rows (what batch 2 could
   run instead), and the modulation GEMVs: 120 calls of M = 1 against one call over all 120 weights
   concatenated (they all take the same timestep vector).

Run from the repo root on an H100 / H200 (JSON in ``$OUT/cfg_batch.json``)::

    source bench/device_env.sh && python3 bench/cfg_batch_bench.py [--out DIR] [--skip-model]
"""

# ruff: noqa: B023 - each lambda is timed (called) within its own loop iteration

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import harness_core as hc
import harness_models as hm
from pack import load_pack

IMAGE_GEMMS = (("qkv", 3072, 9216), ("out", 3072, 3072), ("fc1", 3072, 12288), ("fc2", 12288, 3072))


def alternate(fns: dict, rounds: int = 4, reps: int = 5) -> dict:
    """Median ms of each callable, timed in alternating rounds (cancels slow drift of clocks and power)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    device = torch.device("cuda")
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(hc.time_calls(fn, device, warmup=1, reps=reps)["ms"])
    return {name: round(statistics.median(ts), 3) for name, ts in times.items()}


def profile(fn) -> dict:
    """Device ms per kernel name and per ``aten::_scaled_mm`` input shapes for one call of ``fn``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            kernels[e.key[:90]] = (e.device_time_total / 1000.0, e.count)
    gemms = {}
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key == "aten::_scaled_mm" and e.device_time_total > 0:
            shapes = "x".join(str(s) for s in (e.input_shapes[0] + e.input_shapes[1][1:]))
            gemms[shapes] = (e.device_time_total / 1000.0, e.count)
    return {"total_ms": sum(ms for ms, _ in kernels.values()), "kernels": kernels, "gemms": gemms}


def side_by_side(one: dict, two: dict, top: int = 30) -> list[list]:
    rows = []
    for key in sorted(set(one) | set(two), key=lambda k: -max(one.get(k, (0, 0))[0], two.get(k, (0, 0))[0])):
        a, b = one.get(key, (0.0, 0)), two.get(key, (0.0, 0))
        rows.append([key, round(a[0], 3), a[1], round(b[0], 3), b[1], round(b[0] / a[0], 3) if a[0] else None])
    return rows[:top]


def model_part(results: dict) -> None:
    from qwen_edit_hopper.qwen_edit import fast_forward as ff
    from qwen_edit_hopper.qwen_edit.compile import dynamo_settings

    device = torch.device("cuda")
    module, inputs = hm.fastest_fp8_dit_at_full_size(device)
    with dynamo_settings():

        def one():
            return hm.fast_forward(ff, module, inputs, attention="cudnn_fp8")

        def two():
            return hm.fast_forward(ff, module, inputs, batch=2, attention="cudnn_fp8")

        one(), two()
        torch.cuda.synchronize()
        g1, g2 = hc.capture_cuda_graph(one)[0], hc.capture_cuda_graph(two)[0]
        times = alternate({"batch 1": one, "batch 2": two, "batch 1 graph": g1.replay, "batch 2 graph": g2.replay})
        results["times_ms"] = times
        print(times, flush=True)
        del g1, g2
        p1, p2 = profile(one), profile(two)
    results["profile_total_ms"] = [p1["total_ms"], p2["total_ms"]]
    results["kernels"] = side_by_side(p1["kernels"], p2["kernels"])
    results["gemms"] = side_by_side(p1["gemms"], p2["gemms"], top=40)


def gemm_part(results: dict) -> None:
    from qwen_edit_hopper.fp8.linear import scaled_mm

    device = torch.device("cuda")
    rows = []

    def operands(m, k, n):
        x8 = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        w8 = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
        return x8, torch.rand(m, 1, device=device) + 0.5, w8, torch.rand(n, 1, device=device) + 0.5

    for name, k, n in (*IMAGE_GEMMS, *((f"txt-{g}", k, n) for g, k, n in IMAGE_GEMMS)):
        m = 300 if name.startswith("txt") else 8192
        x8, xs, w8, ws = operands(2 * m, k, n)
        halves = [(x8[i * m : (i + 1) * m], xs[i * m : (i + 1) * m]) for i in range(2)]
        calls = 10

        def whole():
            for _ in range(calls):
                scaled_mm(x8, xs, w8, ws, torch.bfloat16, True)

        def split():
            for _ in range(calls):
                for h, hs in halves:
                    scaled_mm(h, hs, w8, ws, torch.bfloat16, True)

        def single():
            for _ in range(calls):
                scaled_mm(halves[0][0], halves[0][1], w8, ws, torch.bfloat16, True)

        t = alternate({"M": single, "2M": whole, "2 x M": split}, rounds=5)
        flop = 2 * m * k * n * calls
        row = {
            "gemm": name,
            "M": m,
            "K": k,
            "N": n,
            **{f"{key} ms": v / calls for key, v in t.items()},
            "M TFLOP/s": round(flop / t["M"] / 1e9),
            "2M TFLOP/s": round(2 * flop / t["2M"] / 1e9),
            "2 x M TFLOP/s": round(2 * flop / t["2 x M"] / 1e9),
        }
        rows.append(row)
        print(row, flush=True)
    results["gemm_split"] = rows

    # Modulation: every block's img_mod / txt_mod linear takes the same silu(timestep embedding), M = 1 (or 2).
    layers, k, n = 120, 3072, 6 * 3072
    w_all = torch.randn(layers * n, k, device=device).to(torch.float8_e4m3fn)
    ws_all = torch.rand(layers * n, 1, device=device) + 0.5
    x8 = torch.randn(1, k, device=device).to(torch.float8_e4m3fn)
    xs = torch.ones(1, 1, device=device)
    pieces = [(w_all[i * n : (i + 1) * n], ws_all[i * n : (i + 1) * n]) for i in range(layers)]
    w_bf16 = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(4)]
    x_bf16 = torch.randn(1, k, device=device, dtype=torch.bfloat16)

    def separate():
        for w, s in pieces:
            scaled_mm(x8, xs, w, s, torch.bfloat16, True)

    def concatenated():
        scaled_mm(x8, xs, w_all, ws_all, torch.bfloat16, True)

    def bf16_gemv():
        for i in range(layers):
            torch.nn.functional.linear(x_bf16, w_bf16[i % 4])

    t = alternate(
        {"120 x M=1 fp8": separate, "1 x concatenated fp8": concatenated, "120 x bf16 F.linear": bf16_gemv}, rounds=5
    )
    results["modulation_ms_per_forward"] = t
    print("modulation, per forward:", t, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    parser.add_argument("--skip-model", action="store_true", help="GEMM micro-benchmarks only")
    args = parser.parse_args()
    load_pack()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        if not args.skip_model:
            model_part(results)
        torch.cuda.empty_cache()
        gemm_part(results)
    finally:
        (args.out / "cfg_batch.json").write_text(json.dumps(results, indent=1))
    if "times_ms" in results:
        t = results["times_ms"]
        print(
            f"\nbatch 2 / batch 1: {t['batch 2'] / t['batch 1']:.3f} (graphs: "
            f"{t['batch 2 graph'] / t['batch 1 graph']:.3f}); kernels {results['profile_total_ms'][0]:.1f} / "
            f"{results['profile_total_ms'][1]:.1f} ms"
        )
        print(f"{'GEMM shape (M x K x N)':34s} {'b1 ms':>8s} {'n':>4s} {'b2 ms':>8s} {'n':>4s} {'ratio':>6s}")
        for key, a, na, b, nb, r in results["gemms"]:
            print(f"{key:34s} {a:8.2f} {na:4d} {b:8.2f} {nb:4d} {r or 0:6.2f}")
        print(f"{'kernel':60s} {'b1 ms':>8s} {'b2 ms':>8s} {'ratio':>6s}")
        for key, a, _, b, _, r in results["kernels"]:
            print(f"{key[:60]:60s} {a:8.2f} {b:8.2f} {r or 0:6.2f}")
    print(f"\n{'gemm':8s} {'M':>5s} {'M TF/s':>7s} {'2M TF/s':>8s} {'2xM TF/s':>9s}")
    for r in results["gemm_split"]:
        print(f"{r['gemm']:8s} {r['M']:5d} {r['M TFLOP/s']:7d} {r['2M TFLOP/s']:8d} {r['2 x M TFLOP/s']:9d}")
    print("modulation per forward (ms):", results["modulation_ms_per_forward"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
