#!/usr/bin/env python3
"""Does cuDNN's FP8 attention lose a partial last wave at the DiT's shape, and would a query split win it back?

At S = 8492 tokens, 24 heads: if each CTA of cuDNN's kernel covers 128 query rows of one head, there are
67 x 24 = 1608 CTAs for 132 SMs, 12.2 waves, so the 13th wave runs 24 CTAs while 108 SMs idle. This times the
kernel (e4m3 in and out, per-tensor scales, padding-mask graph as the pack builds it) against all 8492 keys
for query counts around 8492 (the step pattern says how many query rows one CTA covers and whether the
kernel is persistent), at B = 1 and 2; and, for the 44 rows past 66 x 128, one call with the keys split in
``--splits`` parts as a batch (each part's softmax statistics kept for the combine), as a split would run them.

Run from the repo root on the device machine (cudnn-frontend carried in .whl)::

    source bench/device_env.sh && python3 bench/attention_tail_bench.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import cudnn
import torch

HEADS, DIM, TOKENS = 24, 128, 8492
HANDLE = cudnn.create_handle()
PLAN_NAMES: dict[tuple, str] = {}


def build(batch: int, s_q: int, s_kv: int, stats: bool):
    """(graph, ports) of sdpa_fp8 for q (B, H, s_q, D), k/v (B, H, s_kv, D) in (B, S, H, D) memory."""
    e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=HANDLE)

    def bshd(s):
        return [batch, HEADS, s, DIM], [s * HEADS * DIM, DIM, HEADS * DIM, 1]

    q = graph.tensor(name="q", dim=bshd(s_q)[0], stride=bshd(s_q)[1], data_type=e4m3)
    k = graph.tensor(name="k", dim=bshd(s_kv)[0], stride=bshd(s_kv)[1], data_type=e4m3)
    v = graph.tensor(name="v", dim=bshd(s_kv)[0], stride=bshd(s_kv)[1], data_type=e4m3)
    scalars = [graph.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
               for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")]
    lengths = [graph.tensor(name=n, dim=[batch, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
               for n in ("seq_len_q", "seq_len_kv")]
    o, st, amax_s, amax_o = graph.sdpa_fp8(q, k, v, *scalars, is_inference=not stats, attn_scale=DIM ** -0.5,
                                           use_causal_mask=False, use_padding_mask=True, seq_len_q=lengths[0],
                                           seq_len_kv=lengths[1], name="sdpa_fp8")
    o.set_output(True).set_dim(bshd(s_q)[0]).set_stride(bshd(s_q)[1]).set_data_type(e4m3)
    for amax in (amax_s, amax_o):
        amax.set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    ports = [q, k, v, *scalars, o, *lengths]
    if stats:
        st.set_output(True).set_data_type(f32).set_dim([batch, HEADS, s_q, 1]).set_stride([HEADS * s_q, s_q, 1, 1])
        ports.append(st)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    try:
        name = graph.get_plan_name_at_index(0)
    except Exception as exc:
        name = f"? ({type(exc).__name__})"
    PLAN_NAMES[(batch, s_q, s_kv, stats)] = name
    return graph, ports


def runner(batch: int, s_q: int, s_kv: int, stats: bool = False):
    dev = torch.device("cuda")
    graph, ports = build(batch, s_q, s_kv, stats)
    g = torch.Generator(device=dev).manual_seed(0)

    def seq(s):
        return (torch.randn(batch, s, HEADS, DIM, device=dev, generator=g) * 0.5).to(torch.float8_e4m3fn)

    q8, k8, v8 = seq(s_q), seq(s_kv), seq(s_kv)
    one = torch.ones(1, 1, 1, 1, device=dev)
    scalars = [one * 0.05, one * 0.05, one * 0.01, one / 448, one * 448, one * 100]
    out = torch.empty(batch, s_q, HEADS, DIM, device=dev, dtype=torch.float8_e4m3fn)
    lens = [torch.full((batch, 1, 1, 1), s, dtype=torch.int32, device=dev) for s in (s_q, s_kv)]
    tensors = [q8.transpose(1, 2), k8.transpose(1, 2), v8.transpose(1, 2), *scalars, out.transpose(1, 2), *lens]
    if stats:
        tensors.append(torch.empty(batch, HEADS, s_q, 1, device=dev))
    workspace = torch.empty(max(graph.get_workspace_size(), 1), dtype=torch.uint8, device=dev)
    feed = dict(zip(ports, tensors, strict=True))

    def call():
        graph.execute(feed, workspace, handle=HANDLE)

    return call


def time_us(call, reps: int = 20, rounds: int = 5) -> float:
    """Median over rounds of a CUDA graph of ``reps`` calls, per call (no host launch overhead)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cudnn.set_stream(handle=HANDLE, stream=side.cuda_stream)
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cudnn.set_stream(handle=HANDLE, stream=torch.cuda.current_stream().cuda_stream)
        for _ in range(reps):
            call()
    graph.replay()
    results = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        results.append(start.elapsed_time(end) * 1000 / reps)
    return statistics.median(results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    parser.add_argument("--splits", type=int, nargs="+", default=[4, 11])
    args = parser.parse_args()
    rows = []
    for batch in (1, 2):
        for s_q in (8192, 8320, 8352, 8384, 8416, 8447, 8448, 8492, 8704):
            us = time_us(runner(batch, s_q, TOKENS))
            rows.append({"case": f"B={batch} q={s_q} kv={TOKENS}", "us": round(us, 1),
                         "tflops": round(4 * batch * HEADS * s_q * TOKENS * DIM / us / 1e6, 1),
                         "plan": PLAN_NAMES.get((batch, s_q, TOKENS, False))})
            print(rows[-1], flush=True)
    leftover = TOKENS - 66 * 128
    for splits in args.splits:
        if TOKENS % splits:
            continue
        for stats in (False, True):
            us = time_us(runner(splits, leftover, TOKENS // splits, stats))
            rows.append({"case": f"split keys: B={splits} q={leftover} kv={TOKENS // splits} stats={stats}",
                         "us": round(us, 1), "plan": PLAN_NAMES.get((splits, leftover, TOKENS // splits, stats))})
            print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_tail.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows},
                                                             indent=1))
    print(f"\n{'case':58s} {'us':>8s} {'TFLOP/s':>8s}")
    for r in rows:
        print(f"{r['case']:58s} {r['us']:8.1f} {r.get('tflops', ''):>8} {r['plan']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
