#!/usr/bin/env python3
"""cuDNN's FP8 fused attention (cudnn-frontend ``sdpa_fp8``) at the DiT's shape: accuracy and time.

Run from the repository root on the device machine, with the cudnn-frontend wheel carried in
``.whl`` (``source bench/device_env.sh`` installs it)::

    python3 bench/cudnn_fp8_attention_bench.py     # $OUT/cudnn_fp8_attention.json, table last
    python3 bench/cudnn_fp8_attention_bench.py --plans   # every engine config of the pack's graph, timed
    python3 bench/cudnn_fp8_attention_bench.py --layouts # the pack's kernel call, q/k/v token- or head-major

What it measures, at S = 8492, H = 24, D = 128, B = 1 and 2, q/k/v in the DiT's (B, S, H, D) memory:

* the cuDNN FP8 kernel alone on prequantized e4m3 q/k/v (per-tensor scales), e4m3 output;
* the whole call (per-tensor amax, scale and cast of q/k/v, the kernel, the bf16 dequantization);
* SDPA's cuDNN bf16 kernel in the same process (the ratio that counts);
* accuracy against float64 attention, with and without K smoothing (K minus its token mean, which
  softmax ignores), and with O as bf16 where cuDNN supports it (it says whether it does).

Nothing here is used by the pack; it decides whether a ``cudnn_fp8`` backend is worth building.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention_bench as ab
import cudnn
import torch
import torch.nn.functional as F  # noqa: N812
from torch.nn.attention import SDPBackend, sdpa_kernel

E4M3_MAX = 448.0
HANDLE = cudnn.create_handle()


def bshd_view(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def build(shape, stride, out_bf16: bool):
    """A cuDNN graph for e4m3 q/k/v of ``shape`` (B, H, S, D) / ``stride``; output e4m3 or bf16, same layout."""
    e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=HANDLE)
    q, k, v = (g.tensor(name=n, dim=list(shape), stride=list(stride), data_type=e4m3) for n in "qkv")
    scalars = [g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
               for n in ("dq", "dk", "dv", "ds", "ss", "so")]  # fmt: skip
    o, _, amax_s, amax_o = g.sdpa_fp8(q, k, v, *scalars, is_inference=True, attn_scale=shape[-1] ** -0.5,
                                      use_causal_mask=False, name="sdpa")  # fmt: skip
    o.set_output(True).set_dim(list(shape)).set_stride(list(stride))
    o.set_data_type(cudnn.data_type.BFLOAT16 if out_bf16 else e4m3)
    for a in (amax_s, amax_o):
        a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    ws = torch.empty(g.get_workspace_size(), device="cuda", dtype=torch.uint8)
    return g, (q, k, v, *scalars, o, amax_s, amax_o), ws


class Fp8Sdpa:
    """Per-tensor e4m3 quantization + cuDNN fp8 SDPA for one shape; ``__call__`` -> (B, S, H*D) bf16."""

    def __init__(self, shape, stride, out_bf16=False, smooth_k=False):
        self.graph, self.ports, self.ws = build(shape, stride, out_bf16)
        self.out_bf16, self.smooth_k = out_bf16, smooth_k
        dev = "cuda"
        self.one = torch.ones(1, 1, 1, 1, device=dev)
        self.s_scale = torch.full((1, 1, 1, 1), E4M3_MAX, device=dev)
        self.s_descale = torch.full((1, 1, 1, 1), 1 / E4M3_MAX, device=dev)
        self.amax = torch.empty(2, 1, 1, 1, 1, device=dev)

    @staticmethod
    def quant(x: torch.Tensor):
        amax = x.abs().amax().float().clamp_min(1e-12)
        scale = E4M3_MAX / amax
        x8 = torch.empty_strided(x.shape, x.stride(), dtype=torch.float8_e4m3fn, device=x.device)
        x8.copy_(x.float() * scale)
        return x8, (1 / scale).reshape(1, 1, 1, 1)

    def quantize(self, q, k, v):
        if self.smooth_k:
            k = k - k.mean(dim=2, keepdim=True)
        (q8, dq), (k8, dk), (v8, dv) = self.quant(q), self.quant(k), self.quant(v)
        so = dv.reciprocal()  # |O| <= max|v| = 448 * dv, so O * (1 / dv) stays within e4m3's 448
        return q8, k8, v8, dq, dk, dv, so

    def kernel(self, q8, k8, v8, dq, dk, dv, so):
        b, h, s, d = q8.shape
        dtype = torch.bfloat16 if self.out_bf16 else torch.float8_e4m3fn
        out = torch.empty(b, s, h, d, dtype=dtype, device=q8.device).transpose(1, 2)
        p = self.ports
        pack = {p[0]: q8, p[1]: k8, p[2]: v8, p[3]: dq, p[4]: dk, p[5]: dv, p[6]: self.s_descale,
                p[7]: self.s_scale, p[8]: so, p[9]: out, p[10]: self.amax[0], p[11]: self.amax[1]}  # fmt: skip
        cudnn.set_stream(handle=HANDLE, stream=torch.cuda.current_stream().cuda_stream)
        self.graph.execute(pack, self.ws, handle=HANDLE)
        return out

    def __call__(self, q, k, v):
        parts = self.quantize(q, k, v)
        out = self.kernel(*parts)
        b, h, s, d = q.shape
        if not self.out_bf16:
            out = (out.float() / parts[6]).bfloat16()
        return out.transpose(1, 2).reshape(b, s, h * d)


def sdpa_cudnn(q, k, v):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o = F.scaled_dot_product_attention(q, k, v)
    b, h, s, d = q.shape
    return o.transpose(1, 2).reshape(b, s, h * d)


def timing_rows(b: int, device) -> list[dict]:
    """CUDA-graph replay times at S = 8492, batch ``b``: bf16 SDPA cuDNN and the fp8 path's parts."""
    s, rows = 8492, []
    sets = [tuple(bshd_view(t) for t in ab.make_inputs(b, s, "gauss", i, device)) for i in range(ab.N_SETS)]
    flops = 4 * b * ab.H * s * s * ab.D
    runner = Fp8Sdpa(sets[0][0].shape, sets[0][0].stride())
    preps = [runner.quantize(*x) for x in sets]
    calls = {"sdpa_cudnn bf16": lambda i: sdpa_cudnn(*sets[i]),
             "fp8 whole call": lambda i: runner(*sets[i]),
             "fp8 quantize only": lambda i: runner.quantize(*sets[i]),
             "fp8 kernel only": lambda i: runner.kernel(*preps[i])}  # fmt: skip
    for name, fn in calls.items():
        try:
            times, how = ab.time_graphed(fn, ab.N_SETS)
            ms = statistics.median(times)
            row = {"B": b, "call": name, "ms": round(ms, 4), "timing": how, "tflops": round(flops / ms / 1e9, 1)}
        except Exception as exc:
            row = {"B": b, "call": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def plan_sweep(b: int, padded: bool, device) -> list[dict]:
    """Every engine configuration cuDNN offers for the pack's graph (heuristics A, B and fallback), timed,
    and each one's output against bf16 SDPA (padded: every sample's lengths are the full S, so the output
    must equal the unpadded graph's).

    Uses the pack's own graph builder (``fp8.attention.cudnn_fp8.operation_graph``), so the plans are the
    ones the shipped path chooses from; it runs the first one heuristic A gives.
    """
    from qwen_edit_hopper.fp8.attention import cudnn_fp8 as cf

    s = 8492
    q, k, v = (bshd_view(t) for t in ab.make_inputs(b, s, "gauss", 0, device))
    (q8, dq), (k8, dk), (v8, dv) = cf.quantize_per_tensor(q), cf.quantize_per_tensor(k), cf.quantize_per_tensor(v)
    index = torch.cuda.current_device()
    graph, ports = cf.operation_graph(index, tuple(q8.shape), tuple(q8.stride()), tuple(k8.stride()),
                                      tuple(v8.stride()), padded)  # fmt: skip
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    graph.build_plans(cudnn.build_plan_policy.ALL)
    out = torch.empty(b, s, ab.H, ab.D, dtype=torch.float8_e4m3fn, device=device)
    scale_s, descale_s = cf._p_scales(index)
    tensors = [q8, k8, v8, dq, dk, dv, descale_s, scale_s, dv.reciprocal(), out.transpose(1, 2)]
    if padded:
        tensors += [torch.full((b, 1, 1, 1), s, dtype=torch.int32, device=device),
                    torch.full((b, 1, 1, 1), s, dtype=torch.int32, device=device)]  # fmt: skip
    pack = dict(zip(ports, tensors, strict=True))
    handle = cf._handle(index)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    flops = 4 * b * ab.H * s * s * ab.D
    reference_bf16 = sdpa_cudnn(q, k, v)
    rows = []
    for i in range(graph.get_execution_plan_count()):
        try:
            ws = torch.empty(max(graph.get_workspace_size_plan_at_index(i), 1), dtype=torch.uint8, device=device)
            times = ab.time_fn(lambda _j, i=i, ws=ws: graph.execute_plan_at_index(pack, ws, i, handle=handle), 1)
            ms = statistics.median(times)
            diff = ab.rel_err((out.float() * dv).reshape(b, s, -1), reference_bf16.double())
            row = {"B": b, "padded": padded, "plan": i, "name": graph.get_plan_name_at_index(i), "ms": round(ms, 4),
                   "tflops": round(flops / ms / 1e9, 1), "rel_diff_vs_sdpa": diff}  # fmt: skip
        except Exception as exc:
            row = {"B": b, "padded": padded, "plan": i, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def layout_rows(device) -> list[dict]:
    """``cudnn_fp8.run_kernel`` (the pack's padded graph, e4m3 (B, S, H, D) output) with q/k/v in the DiT's
    token-major (B, S, H, D) memory against head-major (B, H, S, D) memory, same values; B = 1 and 2."""
    from qwen_edit_hopper.fp8.attention import cudnn_fp8 as cf

    s, rows = 8492, []
    for b in (1, 2):
        q, k, v = (bshd_view(t) for t in ab.make_inputs(b, s, "gauss", 0, device))
        (q8, dq), (k8, dk), (v8, dv) = cf.quantize_per_tensor(q), cf.quantize_per_tensor(k), cf.quantize_per_tensor(v)
        flops = 4 * b * ab.H * s * s * ab.D
        lengths = torch.full((b,), s, dtype=torch.int32, device=device)
        outs = {}
        for layout, (a, bb, c) in (("token-major", (q8, k8, v8)),
                                   ("head-major", (q8.contiguous(), k8.contiguous(), v8.contiguous()))):
            scales = (dq, dk, dv, lengths)
            times = ab.time_fn(lambda _j, a=a, bb=bb, c=c, sc=scales: cf.run_kernel(a, bb, c, *sc), 1)
            outs[layout] = cf.run_kernel(a, bb, c, *scales).float()
            ms = statistics.median(times)
            row = {"B": b, "layout": layout, "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1),
                   "same_output": bool(torch.equal(outs[layout], outs["token-major"]))}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    device = torch.device("cuda")
    if "--layouts" in sys.argv:
        rows = layout_rows(device)
        out = Path(os.environ.get("OUT", "bench/out"))
        out.mkdir(parents=True, exist_ok=True)
        (out / "cudnn_fp8_layouts.json").write_text(json.dumps(rows, indent=1))
        for r in rows:
            print(f"  B={r['B']} {r['layout']:12s} {r['ms']:7.3f} ms {r['tflops']:6.0f} TFLOP/s "
                  f"same output {r['same_output']}")
        return 0
    if "--plans" in sys.argv:
        cases = ((1, False), (1, True), (2, False), (2, True))
        rows = [r for b, padded in cases for r in plan_sweep(b, padded, device)]
        out = Path(os.environ.get("OUT", "bench/out"))
        out.mkdir(parents=True, exist_ok=True)
        (out / "cudnn_fp8_plans.json").write_text(json.dumps(rows, indent=1))
        for r in rows:
            print(f"  B={r['B']} padded={r['padded']!s:5} plan {r['plan']:2d} "
                  + (f"{r['ms']:7.3f} ms {r['tflops']:6.0f} TFLOP/s {r['name']} "
                     f"diff vs bf16 {r['rel_diff_vs_sdpa']:.2e}" if "ms" in r else r["error"]))
        return 0
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": cudnn.backend_version(),
           "accuracy": [], "timing": []}  # fmt: skip
    for s, b in ((300, 1), (2304, 1), (8492, 1), (8492, 2)):
        for kind in ("gauss", "outlier"):
            if s != 8492 and kind == "outlier":
                continue
            q, k, v = (bshd_view(t) for t in ab.make_inputs(b, s, kind, 0, device))
            ref = ab.reference(q, k, v)
            row = {"S": s, "B": b, "kind": kind, "sdpa_cudnn bf16": ab.rel_err(sdpa_cudnn(q, k, v), ref)}
            for name, kw in (("fp8 O e4m3", {}), ("fp8 O e4m3 smooth K", {"smooth_k": True}),
                             ("fp8 O bf16", {"out_bf16": True})):  # fmt: skip
                try:
                    row[name] = ab.rel_err(Fp8Sdpa(q.shape, q.stride(), **kw)(q, k, v), ref)
                except Exception as exc:  # cuDNN refuses a variant on this GPU: report why
                    row[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            res["accuracy"].append(row)
            print(json.dumps(row), flush=True)
    for b in (1, 2):
        res["timing"] += timing_rows(b, device)
    out = Path(os.environ.get("OUT", "bench/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "cudnn_fp8_attention.json").write_text(json.dumps(res, indent=1))
    print(f"\n{res['gpu']}, torch {res['torch']}, cuDNN {res['cudnn']}")
    for row in res["accuracy"]:
        print("  " + "  ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    for b in (1, 2):
        base = next((r.get("ms") for r in res["timing"] if r["B"] == b and r["call"] == "sdpa_cudnn bf16"), None)
        for r in (r for r in res["timing"] if r["B"] == b):
            if "error" in r:
                print(f"  B={b} {r['call']:20s} ERROR {r['error']}")
            else:
                print(f"  B={b} {r['call']:20s} {r['ms']:7.3f} ms {r['tflops']:6.0f} TFLOP/s "
                      f"{(base or 0) / r['ms']:5.2f}x bf16 ({r['timing']})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
