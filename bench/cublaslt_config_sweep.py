#!/usr/bin/env python3
"""Is there a faster workspace-free cuBLASLt configuration than the heuristic's for the forward's large GEMMs?

For each row-wise fp8 GEMM shape of the image stream (M = 8192 / 16384 tokens; K -> N: 3072 -> 3072,
3072 -> 12288, 12288 -> 3072), the heuristic's own workspace-free algorithm is copied and its tile (a
shortlist of Hopper tiles), custom option, CTA swizzle and cluster shape changed; everything else in the
opaque algorithm struct is kept (an algorithm rebuilt from AlgoInit with the same public configuration is
not the same kernel: the first sweep found only workspace-needing ones that way, and the diagnosis in the
JSON compares the two). Variants ``cublasLtMatmulAlgoCheck`` accepts with at most :data:`WORKSPACE_BYTES` of
workspace (it reports 4 bytes for the heuristic's own pick) are timed once on the real operands (10 calls, one
weight), and the 6 fastest, with the heuristic's pick, again as a CUDA
graph of 24 calls over weight copies larger than the L2 cache (weights from HBM, as in the model). Uses the
pack's binding (``fp8/cublaslt_gemm.py``). Run from the repository root on an H100 / H200 (JSON in
``$OUT/cublaslt_sweep.json``, table last)::

    python3 bench/cublaslt_config_sweep.py [--max-configs 2000] [--check-budget-s 15] [--shapes 5]
"""


from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import harness_core as hc
from cublaslt_gemm_bench import load_binding

SHAPES = ((8192, 3072, 3072), (8192, 3072, 12288), (8192, 12288, 3072), (16384, 3072, 12288),
          (16384, 12288, 3072))
STATS: dict = {}
"""What the last :func:`configurations` saw: algorithm ids, their capabilities, AlgoCheck statuses."""
CFG_CUSTOM = 5


def declare(lt, lib) -> None:
    c = ctypes
    fns = {
        "cublasLtMatmulAlgoGetIds": [c.c_void_p, c.c_int, c.c_int, c.c_int, c.c_int, c.c_int, c.c_int, c.c_int,
                                     c.POINTER(c.c_int), c.POINTER(c.c_int)],
        "cublasLtMatmulAlgoInit": [c.c_void_p, c.c_int, c.c_int, c.c_int, c.c_int, c.c_int, c.c_int, c.c_int,
                                   c.POINTER(lt._Algo)],
        "cublasLtMatmulAlgoCapGetAttribute": [c.POINTER(lt._Algo), c.c_int, c.c_void_p, c.c_size_t,
                                              c.POINTER(c.c_size_t)],
        "cublasLtMatmulAlgoConfigSetAttribute": [c.POINTER(lt._Algo), c.c_int, c.c_void_p, c.c_size_t],
        "cublasLtMatmulAlgoCheck": [c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p,
                                    c.POINTER(lt._Algo), c.POINTER(lt._HeuristicResult)],
    }
    for name, args in fns.items():
        getattr(lib.lib, name).argtypes = args
        getattr(lib.lib, name).restype = c.c_int


TILE_SHORTLIST = (20, 23, 24, 17, 18, 19, 21, 28, 29, 30, 31, 32, 33, 116, 176, 177, 208, 209, 210, 232)
"""Tile ids worth a Hopper fp8 GEMM of these sizes (cublasLtMatmulTile_t): 128x128, 128x256, 256x128, 64x128,
128x64, 64x256, 256x64, 96x128, 128x160, 160x128, 192x128, 128x192, 128x96, 64x192, 128x320, 128x384, 192x64,
192x192, 192x256, 256x192 (column-major: the first number runs along N of ``out[M, N]``)."""
SEED_CLUSTERS = (0, 2, 3, 4, 5, 6, 7, 8, 9)
WORKSPACE_BYTES = 64 << 10
"""Variants may ask for up to this much workspace (AlgoCheck says the heuristic's own pick wants 4 bytes, yet
the heuristic offers it with a zero-byte preference and it runs without); the sweep hands every launch a
buffer of this size, and records each variant's figure."""
WORKSPACE: list = []


def launch(lt, lib, plan, algo, x8, x_scale, w8, w_scale, out) -> None:
    """``lt._launch`` with a workspace buffer of :data:`WORKSPACE_BYTES`."""
    if not WORKSPACE:
        WORKSPACE.append(torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=out.device))
    lt._set_scales(lib, plan, x_scale, w_scale)
    a, b, d = plan.layouts
    stream = torch.cuda.current_stream(out.device).cuda_stream
    lib.check(lib.lib.cublasLtMatmul(lib.handle, plan.desc, ctypes.byref(lt._ONE), ctypes.c_void_p(w8.data_ptr()), a,
                                     ctypes.c_void_p(x8.data_ptr()), b, ctypes.byref(lt._ZERO),
                                     ctypes.c_void_p(out.data_ptr()), d, ctypes.c_void_p(out.data_ptr()), d,
                                     ctypes.byref(algo), ctypes.c_void_p(WORKSPACE[0].data_ptr()), WORKSPACE_BYTES,
                                     ctypes.c_void_p(stream)), "cublasLtMatmul")


def raw_words(algo) -> list[str]:
    return [f"{w:016x}" for w in algo.data]


def check(lt, lib, plan, algo) -> tuple[int, int]:
    a, b, d = plan.layouts
    result = lt._HeuristicResult()
    status = lib.lib.cublasLtMatmulAlgoCheck(lib.handle, plan.desc, a, b, d, d, ctypes.byref(algo),
                                             ctypes.byref(result))
    return status, int(result.workspace_size)


def configure(lt, lib, base, values: dict):
    algo = lt._Algo()
    ctypes.memmove(ctypes.byref(algo), ctypes.byref(base), ctypes.sizeof(algo))
    for name, value in values.items():
        attr, ctype = (CFG_CUSTOM, ctypes.c_uint32) if name == "custom" else lt._ALGO_CONFIG[name]
        lib.lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr, ctypes.byref(ctype(value)),
                                                     ctypes.sizeof(ctype))
    return algo


def custom_of(lib, algo) -> int:
    value, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
    lib.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), CFG_CUSTOM, ctypes.byref(value), 4,
                                                 ctypes.byref(written))
    return value.value


def diagnose(lt, lib, plan, heuristic, types) -> dict:
    """Is the heuristic's algorithm more than its public configuration? Re-create it with AlgoInit and the same
    configuration values and compare the raw words and what AlgoCheck says of each; list what the heuristic
    offers when 64 MiB of workspace are allowed."""
    config = dict(lt.algo_config(heuristic), custom=custom_of(lib, heuristic))
    out = {"heuristic": config, "heuristic_words": raw_words(heuristic),
           "heuristic_check": check(lt, lib, plan, heuristic)}
    base = lt._Algo()
    if lib.lib.cublasLtMatmulAlgoInit(lib.handle, *types, config["id"], ctypes.byref(base)) == 0:
        rebuilt = configure(lt, lib, base, {k: v for k, v in config.items() if k != "id" and v is not None})
        out["rebuilt_words"] = raw_words(rebuilt)
        out["rebuilt_check"] = check(lt, lib, plan, rebuilt)
    pref = ctypes.c_void_p()
    lib.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref))
    lt._set(lib, lib.lib.cublasLtMatmulPreferenceSetAttribute, pref, lt._PREF_MAX_WORKSPACE_BYTES,
            ctypes.c_uint64(64 << 20), "MAX_WORKSPACE_BYTES")
    results, returned = (lt._HeuristicResult * 16)(), ctypes.c_int(0)
    a, b, d = plan.layouts
    lib.lib.cublasLtMatmulAlgoGetHeuristic(lib.handle, plan.desc, a, b, d, d, pref, 16, results, ctypes.byref(returned))
    lib.lib.cublasLtMatmulPreferenceDestroy(pref)
    out["with_workspace"] = [dict(lt.algo_config(results[i].algo), custom=custom_of(lib, results[i].algo),
                                  ws=int(results[i].workspace_size), waves=round(results[i].waves_count, 3))
                             for i in range(returned.value)]
    return out


def configurations(lt, lib, plan, heuristic, max_configs: int, budget_s: float):
    """Variants of the heuristic's own algorithm that cublasLtMatmulAlgoCheck accepts (small workspace): its tile,
    custom option, CTA swizzle and cluster shape changed, everything else (including what the public
    attributes do not show) kept. Up to ``max_configs``, or what ``budget_s`` seconds of checking find."""
    deadline = time.monotonic() + budget_s
    config = lt.algo_config(heuristic)
    found, seen = [], set()
    tally = STATS.setdefault("check_status", {})
    for tile, custom, swizzle, cluster in itertools.product(TILE_SHORTLIST, range(8), (0, 1), SEED_CLUSTERS):
        values = {"tile": tile, "custom": custom, "swizzle": swizzle, "cluster": cluster}
        algo = configure(lt, lib, heuristic, values)
        status, ws = check(lt, lib, plan, algo)
        key = f"{status}/{'ws' if status == 0 and ws else '-'}"
        tally[key] = tally.get(key, 0) + 1
        if status == 0 and ws <= WORKSPACE_BYTES:
            signature = tuple(algo.data)
            STATS.setdefault("workspace_bytes", {}).setdefault(str(ws), 0)
            STATS["workspace_bytes"][str(ws)] += 1
            if signature not in seen and (tile, cluster, swizzle, custom) != (config["tile"], config["cluster"],
                                                                             config["swizzle"], 0):
                seen.add(signature)
                found.append(algo)
        if len(found) >= max_configs or time.monotonic() > deadline:
            break
    return found


def measure(lt, lib, device, l2, m, k, n, max_configs, budget_s) -> dict:
    copies = max(2, -(-3 * l2 // (n * k)))
    ring = [torch.randn(n, k, device=device).to(torch.float8_e4m3fn) for _ in range(copies)]
    ws = (torch.rand(n, 1, device=device) + 0.5) / 16
    x8 = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    xs = (torch.rand(m, 1, device=device) + 0.5) / 16
    out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    lt.CANDIDATES = 1
    lt._PLANS.clear()
    plan = lt.plan_for(x8, xs, ring[0], ws, True, out)
    heuristic = plan.algo
    types = (lt._CUBLAS_COMPUTE_32F, lt._CUDA_R_32F, lt._CUDA_R_8F_E4M3, lt._CUDA_R_8F_E4M3, lt._CUDA_R_16BF,
             lt._CUDA_R_16BF)
    STATS.clear()
    STATS["diagnosis"] = diagnose(lt, lib, plan, heuristic, types)
    algos = configurations(lt, lib, plan, heuristic, max_configs, budget_s)

    def quick_us(algo) -> float | None:
        try:
            launch(lt, lib, plan, algo, x8, xs, ring[0], ws, out)
        except Exception:  # a configuration that fails at launch is skipped
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            launch(lt, lib, plan, algo, x8, xs, ring[0], ws, out)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 100.0

    quick = sorted(((us, algo) for algo in algos if (us := quick_us(algo)) is not None), key=lambda t: t[0])
    ref = torch._scaled_mm(x8, ring[0].t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16, use_fast_accum=True)

    def graphed(algo) -> tuple[float, float]:
        def step(i):
            o = torch.empty(m, n, device=device, dtype=torch.bfloat16)
            launch(lt, lib, plan, algo, x8, xs, ring[i % copies], ws, o)
            return o

        ms = hc.graph_ms_per_call(step, 24, reps=9)
        check = torch.empty(m, n, device=device, dtype=torch.bfloat16)
        launch(lt, lib, plan, algo, x8, xs, ring[0], ws, check)
        err = ((check.float() - ref.float()).norm() / ref.float().norm()).item()
        return ms * 1e3, err

    row = {"M": m, "K": k, "N": n, "configs": len(algos), "timed": len(quick), "search": dict(STATS)}
    row["heuristic"] = {"config": lt.algo_config(heuristic), "quick_us": round(quick_us(heuristic), 2)}
    row["heuristic"]["graph_us"], row["heuristic"]["err"] = graphed(heuristic)
    row["best"] = []
    for us, algo in quick[:6]:
        g_us, err = graphed(algo)
        config = dict(lt.algo_config(algo), custom=custom_of(lib, algo))
        row["best"].append({"config": config, "quick_us": round(us, 2), "graph_us": round(g_us, 2),
                            "err": err})
    fastest = min(row["best"], key=lambda b: b["graph_us"], default=None)
    if fastest is not None and fastest["graph_us"] < 0.99 * row["heuristic"]["graph_us"]:
        # does the fastest variant also run without any workspace, as the heuristic's pick does? (last, because
        # a kernel that needed the buffer could fault and end the process; the JSON rows are printed already)
        algo = quick[row["best"].index(fastest)][1]
        print(json.dumps({"probing_null_workspace_after": row}), flush=True)
        check = torch.empty(m, n, device=device, dtype=torch.bfloat16)
        lt._launch(lib, plan, algo, x8, xs, ring[0], ws, check)
        torch.cuda.synchronize()
        fastest["null_workspace_err"] = ((check.float() - ref.float()).norm() / ref.float().norm()).item()
    ring.clear()
    hc.free_memory()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-configs", type=int, default=2000)
    parser.add_argument("--check-budget-s", type=float, default=15.0, help="seconds of AlgoCheck per shape")
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="only the first N shapes")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    args = parser.parse_args()
    lt = load_binding()
    if lt is None:
        return 2
    lib = lt._library()
    declare(lt, lib)
    device = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    rows = []
    for m, k, n in SHAPES[:args.shapes]:
        rows.append(measure(lt, lib, device, l2, m, k, n, args.max_configs, args.check_budget_s))
        print(json.dumps(rows[-1]), flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cublaslt": lib.version, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cublaslt_sweep.json").write_text(json.dumps(result, indent=1))
    print(f"{'M':>6s} {'K':>6s} {'N':>6s} {'cfgs':>5s} {'heur us':>8s} {'best us':>8s} {'best/heur':>9s}  best config")
    for r in rows:
        best = min(r["best"], key=lambda b: b["graph_us"]) if r["best"] else None
        h = r["heuristic"]["graph_us"]
        print(f"{r['M']:6d} {r['K']:6d} {r['N']:6d} {r['configs']:5d} {h:8.1f} "
              + (f"{best['graph_us']:8.1f} {best['graph_us'] / h:9.3f}  {best['config']}" if best else "   -"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
