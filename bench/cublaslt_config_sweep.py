#!/usr/bin/env python3
"""Is there a faster workspace-free cuBLASLt configuration than the heuristic's for the forward's large GEMMs?

For each row-wise fp8 GEMM shape of the image stream (M = 8192 / 16384 tokens; K -> N: 3072 -> 3072,
3072 -> 12288, 12288 -> 3072), every algorithm id cuBLASLt lists for e4m3 x e4m3 -> bf16 is initialized
and configured over its tile ids, stage ids, custom options, CTA swizzle and cluster shapes (auto, 1x1, 2x1,
1x2, 2x2); configurations that ``cublasLtMatmulAlgoCheck`` accepts without workspace are timed once on the
real operands (10 calls, one weight), and the 6 fastest, with the heuristic's pick, again as a CUDA graph of
24 calls over weight copies larger than the L2 cache (weights from HBM, as in the model). Uses the pack's
binding (``fp8/cublaslt_gemm.py``). Run from the repository root on an H100 / H200 (JSON in
``$OUT/cublaslt_sweep.json``, table last)::

    python3 bench/cublaslt_config_sweep.py [--max-configs 400] [--check-budget-s 15] [--shapes 5]
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
CLUSTERS = (0, 2, 3, 5, 6)
STATS: dict = {}
"""What the last :func:`configurations` saw: algorithm ids, their capabilities, AlgoCheck statuses."""
CAP_TILE_IDS, CAP_STAGES_IDS, CAP_CUSTOM_MAX, CAP_SWIZZLE = 6, 13, 7, 2
CFG_TILE, CFG_CUSTOM, CFG_SWIZZLE, CFG_STAGES, CFG_CLUSTER = 1, 5, 4, 6, 8


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


def cap_array(lib, algo, attr) -> list[int]:
    written = ctypes.c_size_t(0)
    lib.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(written))
    count = written.value // 4
    if count == 0:
        return [0]
    buf = (ctypes.c_uint32 * count)()
    lib.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, buf, ctypes.sizeof(buf),
                                              ctypes.byref(written))
    return list(buf)


def cap_int(lib, algo, attr) -> int:
    value, written = ctypes.c_int32(0), ctypes.c_size_t(0)
    lib.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value), 4, ctypes.byref(written))
    return value.value


def configurations(lt, lib, plan, max_configs: int, budget_s: float):
    """Every workspace-free configuration cublasLtMatmulAlgoCheck accepts (up to ``max_configs``, or what
    ``budget_s`` seconds of checking find)."""
    deadline = time.monotonic() + budget_s
    types = (lt._CUBLAS_COMPUTE_32F, lt._CUDA_R_32F, lt._CUDA_R_8F_E4M3, lt._CUDA_R_8F_E4M3, lt._CUDA_R_16BF,
             lt._CUDA_R_16BF)
    ids, count = (ctypes.c_int * 256)(), ctypes.c_int(0)
    lib.check(lib.lib.cublasLtMatmulAlgoGetIds(lib.handle, *types, 256, ids, ctypes.byref(count)), "AlgoGetIds")
    a, b, d = plan.layouts
    found = []
    STATS.clear()
    STATS["algo_ids"] = list(ids)[:count.value]
    for algo_id in list(ids)[:count.value]:
        base = lt._Algo()
        if lib.lib.cublasLtMatmulAlgoInit(lib.handle, *types, algo_id, ctypes.byref(base)) != 0:
            STATS.setdefault("init_failed", []).append(algo_id)
            continue
        tiles, stages = cap_array(lib, base, CAP_TILE_IDS), cap_array(lib, base, CAP_STAGES_IDS)
        customs = range(cap_int(lib, base, CAP_CUSTOM_MAX) + 1)
        swizzles = (0, 1) if cap_int(lib, base, CAP_SWIZZLE) else (0,)
        STATS.setdefault("caps", {})[algo_id] = {"tiles": tiles, "stages": stages, "customs": len(customs),
                                                 "swizzles": len(swizzles)}
        for tile, stage, custom, swizzle, cluster in itertools.product(tiles, stages, customs, swizzles, CLUSTERS):
            algo = lt._Algo()
            ctypes.memmove(ctypes.byref(algo), ctypes.byref(base), ctypes.sizeof(algo))
            for attr, value in ((CFG_TILE, ctypes.c_uint32(tile)), (CFG_STAGES, ctypes.c_uint32(stage)),
                                (CFG_CUSTOM, ctypes.c_uint32(custom)), (CFG_SWIZZLE, ctypes.c_uint32(swizzle)),
                                (CFG_CLUSTER, ctypes.c_uint16(cluster))):
                lib.lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr, ctypes.byref(value),
                                                             ctypes.sizeof(value))
            result = lt._HeuristicResult()
            status = lib.lib.cublasLtMatmulAlgoCheck(lib.handle, plan.desc, a, b, d, d, ctypes.byref(algo),
                                                     ctypes.byref(result))
            tally = STATS.setdefault("check_status", {})
            key = f"{status}/{'ws' if status == 0 and result.workspace_size else '-'}"
            tally[key] = tally.get(key, 0) + 1
            if status == 0 and result.workspace_size == 0:
                found.append(algo)
            if len(found) >= max_configs or time.monotonic() > deadline:
                return found
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
    algos = configurations(lt, lib, plan, max_configs, budget_s)
    quick = []
    for algo in algos:
        try:
            lt._launch(lib, plan, algo, x8, xs, ring[0], ws, out)
        except Exception:  # a configuration that fails at launch is skipped
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            lt._launch(lib, plan, algo, x8, xs, ring[0], ws, out)
        end.record()
        end.synchronize()
        quick.append((start.elapsed_time(end) * 100.0, algo))
    quick.sort(key=lambda t: t[0])
    ref = torch._scaled_mm(x8, ring[0].t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16, use_fast_accum=True)

    def graphed(algo) -> tuple[float, float]:
        def step(i):
            o = torch.empty(m, n, device=device, dtype=torch.bfloat16)
            lt._launch(lib, plan, algo, x8, xs, ring[i % copies], ws, o)
            return o

        ms = hc.graph_ms_per_call(step, 24, reps=9)
        check = torch.empty(m, n, device=device, dtype=torch.bfloat16)
        lt._launch(lib, plan, algo, x8, xs, ring[0], ws, check)
        err = ((check.float() - ref.float()).norm() / ref.float().norm()).item()
        return ms * 1e3, err

    row = {"M": m, "K": k, "N": n, "configs": len(algos), "timed": len(quick), "search": dict(STATS)}
    row["heuristic"] = {"config": lt.algo_config(heuristic), "quick_us": None}
    row["heuristic"]["graph_us"], row["heuristic"]["err"] = graphed(heuristic)
    row["best"] = []
    for us, algo in quick[:6]:
        g_us, err = graphed(algo)
        row["best"].append({"config": lt.algo_config(algo), "quick_us": round(us, 2), "graph_us": round(g_us, 2),
                            "err": err})
    ring.clear()
    hc.free_memory()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-configs", type=int, default=400)
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
