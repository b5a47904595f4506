#!/usr/bin/env python3
"""Beyond cuDNN's heuristics: every knob setting of its FP8 attention engines, timed at the DiT's shape.

``cudnn_fp8_plans_bench.py`` found cuDNN's first heuristic plan the fastest of the plans the heuristics offer.
This bench asks cuDNN for the engines that take the pack's padding-mask ``sdpa_fp8`` graph
(``cudnn_fp8.operation_graph``: e4m3 q / k / v in (B, S, H, D) memory, e4m3 output), lists each engine's
knobs (kernel config, tile M / N, stream-K, CGA, warp specialization) and builds one plan per knob setting
(``create_execution_plan(engine, knobs)``): first every value of one knob with the others at the heuristic
plan's values, then the Cartesian product when it is small. Each plan that builds is timed (20 calls between
two CUDA events, median of 7) and its output compared with the heuristic plan's. (Its first run, on
2026-11-21, also timed the graph with the amax of P and O left virtual, as the pack's graph now has them:
1.031 vs 1.028 ms at B = 1, 2.019 vs 2.030 ms at B = 2, same output.)

Run from the repository root on an H100 / H200 (JSON in ``$OUT/cudnn_fp8_knobs.json``, table last)::

    source bench/device_env.sh && python3 bench/cudnn_fp8_knobs_bench.py --budget-s 240
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import harness_core as hc
from pack import load_pack

HEADS, HEAD_DIM = 24, 128
MAX_PRODUCT = 96
# cuDNN's backend knob numbering (cudnnBackendKnobType_t), which plan names such as eng2_k24=32 use.
BACKEND_KNOBS = {0: "SPLIT_K", 1: "SWIZZLE", 2: "TILE_SIZE", 14: "STAGES", 24: "KERNEL_CFG", 26: "TILE_CGA",
                 27: "TILE_CGA_M", 28: "TILE_CGA_N", 30: "OCCUPANCY", 37: "CTA_COUNT", 38: "STREAM_K",
                 40: "TILE_M", 41: "TILE_N", 42: "WARP_SPEC_CFG"}  # fmt: skip


def knob_values(knob) -> tuple[str, list[int], object]:
    """(knob type name, its allowed values, the frontend's enum member) from a cudnn-frontend ``Knob``."""
    kind = knob.knob_type if hasattr(knob, "knob_type") else knob.type
    lo, hi = int(knob.min_value), int(knob.max_value)
    step = max(int(getattr(knob, "stride", 1) or 1), 1)
    return str(kind).split(".")[-1], list(range(lo, hi + 1, step)), kind


def plan_knobs(name: str) -> dict[str, int]:
    """{knob name: value} from a plan name such as ``eng2_k24=32_k40=3``."""
    return {BACKEND_KNOBS.get(int(k), f"k{k}"): int(v) for k, v in re.findall(r"_k(\d+)=(-?\d+)", name)}


class Bench:
    """One batch size: the pack's tensors, and timing of built plans against the heuristic plan's output."""

    def __init__(self, cudnn, cudnn_fp8, batch: int, tokens: int):
        self.cudnn, self.batch, self.tokens = cudnn, batch, tokens
        self.device = torch.device("cuda")
        self.index = self.device.index or 0
        self.shape = (batch, HEADS, tokens, HEAD_DIM)
        mem = [torch.randn(batch, tokens, HEADS, HEAD_DIM, device=self.device).to(torch.float8_e4m3fn)
               for _ in range(3)]  # fmt: skip
        q, k, v = (t.transpose(1, 2) for t in mem)
        self.stride = tuple(q.stride())
        one = torch.ones(1, 1, 1, 1, device=self.device)
        self.out = torch.empty(batch, tokens, HEADS, HEAD_DIM, device=self.device, dtype=torch.float8_e4m3fn)
        lengths = torch.full((batch, 1, 1, 1), tokens, dtype=torch.int32, device=self.device)
        self.tensors = [q, k, v, one * 0.05, one * 0.05, one, torch.full_like(one, 1 / 448.0),
                        torch.full_like(one, 448.0), one, self.out.transpose(1, 2), lengths, lengths]  # fmt: skip
        self.handle = cudnn_fp8._handle(self.index)
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream(self.device).cuda_stream)
        self.first = None

    def time_plan(self, graph, ports, tensors=None, index: int = 0) -> dict:
        """Run plan ``index`` once (output kept), then time it; {ms, tflops, max_diff_vs_heuristic}."""
        pack = dict(zip(ports, tensors or self.tensors, strict=True))
        ws = torch.empty(max(graph.get_workspace_size_plan_at_index(index), 1), dtype=torch.uint8,
                         device=self.device)  # fmt: skip
        graph.execute_plan_at_index(pack, ws, index, handle=self.handle)
        torch.cuda.synchronize()
        result = self.out.float().clone()
        if self.first is None:
            self.first = result

        def calls():
            for _ in range(20):
                graph.execute_plan_at_index(pack, ws, index, handle=self.handle)

        ms = hc.time_calls(calls, self.device, warmup=2, reps=7)["ms"] / 20
        flop = 4 * self.batch * HEADS * self.tokens**2 * HEAD_DIM
        return {"ms": ms, "tflops": flop / ms / 1e9, "max_diff_vs_heuristic": (result - self.first).abs().max().item()}


def sweep(bench: Bench, cudnn_fp8, deadline: float) -> tuple[list[dict], dict]:
    """Rows for the heuristic plan and every knob setting tried; the engine listing."""
    cudnn, batch, rows, listing, members = bench.cudnn, bench.batch, [], {}, {}
    graph, ports = cudnn_fp8.operation_graph(bench.index, bench.shape, bench.stride, bench.stride, bench.stride,
                                             True)  # fmt: skip
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plan_at_index(0)
    heur_name = graph.get_plan_name_at_index(0)
    base = plan_knobs(heur_name)
    rows.append({"batch": batch, "label": f"heuristic {heur_name}", "engine": int(re.match(r"eng(\d+)",
                 heur_name).group(1)), "knobs": base, **bench.time_plan(graph, ports)})  # fmt: skip
    hc.log(f"B={batch} heuristic {heur_name}: {rows[-1]['ms']:.4f} ms")
    engines = {}
    for engine in range(graph.get_engine_count()):
        try:
            described = [knob_values(kn) for kn in graph.get_knobs_for_engine(engine)]
        except Exception as exc:  # engines that do not take this graph say so
            listing[engine] = hc.error_text(exc, 120)
            continue
        members.update({name: member for name, _, member in described})
        engines[engine] = listing[engine] = {name: values for name, values, _ in described}
        hc.log(f"B={batch} engine {engine}: {engines[engine]}")
    candidates = []
    for engine, knobs in engines.items():
        center = {name: base.get(name, values[0]) for name, values in knobs.items()}
        candidates += [(engine, {**center, name: value}) for name, values in knobs.items() for value in values]
        product = list(itertools.product(*knobs.values()))
        if 1 < len(product) <= MAX_PRODUCT:
            candidates += [(engine, dict(zip(knobs, combo, strict=True))) for combo in product]
    seen = set()
    for engine, knobs in candidates:
        key = (engine, tuple(sorted(knobs.items())))
        if key in seen:
            continue
        if time.monotonic() > deadline:
            hc.log(f"B={batch}: budget reached after {len(seen)} settings")
            break
        seen.add(key)
        row = {"batch": batch, "label": "knobs", "engine": engine, "knobs": knobs}
        try:
            g, p = cudnn_fp8.operation_graph(bench.index, bench.shape, bench.stride, bench.stride, bench.stride, True)
            g.create_execution_plan(engine, {members[n]: val for n, val in knobs.items()})
            g.check_support()
            g.build_plans()
            row.update(bench.time_plan(g, p))
            hc.log(f"B={batch} engine {engine} {knobs}: {row['ms']:.4f} ms")
        except Exception as exc:  # a setting the engine refuses is listed, not fatal
            row["error"] = hc.error_text(exc, 160)
        rows.append(row)
    return rows, listing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    parser.add_argument("--tokens", type=int, default=8492)
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop building new plans after this long")
    args = parser.parse_args()
    load_pack()
    from qwen_edit_hopper.fp8.attention import cudnn_fp8

    cudnn = importlib.import_module("cudnn")
    start = time.monotonic()
    rows, listing = [], {}
    for batch in (1, 2):
        bench = Bench(cudnn, cudnn_fp8, batch, args.tokens)
        batch_rows, listing[batch] = sweep(bench, cudnn_fp8, start + args.budget_s * batch / 2)
        rows += batch_rows
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cudnn_fp8_knobs.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "cudnn": torch.backends.cudnn.version(),
         "engines": {str(b): {str(e): v for e, v in d.items()} for b, d in listing.items()}, "rows": rows},
        indent=1))  # fmt: skip
    print("\n| B | plan | engine | knobs | ms | TFLOP/s | max diff vs heuristic |")
    print("|---|---|---|---|---|---|---|")
    ok = sorted((r for r in rows if "ms" in r), key=lambda r: (r["batch"], r["ms"]))
    for batch in (1, 2):
        shown = [r for r in ok if r["batch"] == batch][:8]
        shown += [r for r in ok if r["batch"] == batch and r["label"] != "knobs" and r not in shown]
        for r in shown:
            print(
                f"| {r['batch']} | {r['label']} | {r['engine']} | {r['knobs']} | {r['ms']:.4f} | {r['tflops']:.0f} | "
                f"{r['max_diff_vs_heuristic']:.3g} |"
            )
    errors = [r for r in rows if "error" in r]
    print(f"\n{len(ok)} plans timed, {len(errors)} refused; first refusals:")
    for r in errors[:6]:
        print(f"  B={r['batch']} {r['label']} engine={r['engine']} {r['knobs']}: {r['error'][:120]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
