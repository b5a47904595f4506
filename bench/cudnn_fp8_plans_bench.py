#!/usr/bin/env python3
"""Is cuDNN's first heuristic plan the fastest for the DiT's FP8 attention? Every plan cuDNN offers, timed.

``fp8.attention.cudnn_fp8`` builds the padding-mask ``sdpa_fp8`` graph with the plans of heuristic modes A
and FALLBACK and runs cuDNN's first choice. This bench builds the same operation graph
(``cudnn_fp8.operation_graph``: e4m3 q / k / v in the DiT's (B, S, H, D) memory, e4m3 output) with the plans
of modes A, B and FALLBACK, builds all of them, and times each (``execute_plan_at_index``, 20 calls between
two CUDA events, median of 7) at the full-size shape: S = 8492 (8192 image + 300 text tokens), 24 heads of
128, B = 1 and 2. Each plan's output is compared with plan 0's (largest difference in e4m3 codes' values).
Run from the repository root on an H100 / H200 (JSON in ``$OUT/cudnn_fp8_plans.json``, table last)::

    source bench/device_env.sh && python3 bench/cudnn_fp8_plans_bench.py
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import harness_core as hc
from pack import load_pack

HEADS, HEAD_DIM = 24, 128


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    parser.add_argument("--tokens", type=int, default=8492)
    args = parser.parse_args()
    load_pack()
    from qwen_edit_hopper.fp8.attention import cudnn_fp8

    cudnn = importlib.import_module("cudnn")
    device = torch.device("cuda")
    rows = []
    for batch in (1, 2):
        s = args.tokens
        shape = (batch, HEADS, s, HEAD_DIM)
        mem = [torch.randn(batch, s, HEADS, HEAD_DIM, device=device).to(torch.float8_e4m3fn) for _ in range(3)]
        q, k, v = (t.transpose(1, 2) for t in mem)
        stride = tuple(q.stride())
        graph, ports = cudnn_fp8.operation_graph(device.index or 0, shape, stride, stride, stride, True)
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans(cudnn.build_plan_policy.ALL)
        count = graph.get_execution_plan_count()
        one = torch.ones(1, 1, 1, 1, device=device)
        out = torch.empty(batch, s, HEADS, HEAD_DIM, device=device, dtype=torch.float8_e4m3fn)
        lengths = torch.full((batch, 1, 1, 1), s, dtype=torch.int32, device=device)
        scale_s, descale_s = torch.full_like(one, 448.0), torch.full_like(one, 1 / 448.0)
        tensors = [q, k, v, one * 0.05, one * 0.05, one, descale_s, scale_s, one, out.transpose(1, 2), lengths,
                   lengths]  # fmt: skip
        pack = dict(zip(ports, tensors, strict=True))
        handle = cudnn_fp8._handle(device.index or 0)
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
        first = None
        for index in range(count):
            name = graph.get_plan_name_at_index(index)
            try:
                ws = torch.empty(max(graph.get_workspace_size_plan_at_index(index), 1), dtype=torch.uint8,
                                 device=device)
                graph.execute_plan_at_index(pack, ws, index, handle=handle)
                torch.cuda.synchronize()
                result = out.float().clone()
                calls = lambda g=graph, p=pack, ws=ws, i=index, h=handle: [  # noqa: E731
                    g.execute_plan_at_index(p, ws, i, handle=h) for _ in range(20)]
                ms = hc.time_calls(calls, device, warmup=2, reps=7)["ms"] / 20
            except Exception as exc:  # a plan that cannot run is reported, not fatal
                rows.append({"batch": batch, "index": index, "plan": name, "error": hc.error_text(exc, 200)})
                continue
            if first is None:
                first = result
            diff = (result - first).abs().max().item()
            flop = 4 * batch * HEADS * s * s * HEAD_DIM
            rows.append({"batch": batch, "index": index, "plan": name, "ms": ms, "tflops": flop / ms / 1e9,
                         "max_diff_vs_plan0": diff})
            hc.log(f"B={batch} plan {index} {name}: {ms:.3f} ms")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cudnn_fp8_plans.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(device), "cudnn": torch.backends.cudnn.version(), "rows": rows},
        indent=1))
    print("\n| B | plan | name | ms | TFLOP/s | max diff vs plan 0 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['batch']} | {r['index']} | {r['plan']} | error: {r['error'][:60]} | | |")
        else:
            print(f"| {r['batch']} | {r['index']} | {r['plan']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                  f"{r['max_diff_vs_plan0']:.3g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
