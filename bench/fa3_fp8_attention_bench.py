#!/usr/bin/env python3
"""FlashAttention-3's FP8 forward against cuDNN's FP8 attention at the DiT's shape: time and accuracy.

FlashAttention-3 (Hopper, warp-specialized, ping-pong softmax) has an e4m3 forward for head dim 128; this bench
loads a built FA3 torch extension and calls its ``fwd`` op directly. The only FA3 build for torch 2.11 + CUDA 13
that installs without compiling is vLLM 0.26.0's ``vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so`` (op namespace
``_vllm_fa3_C``); nothing else of vLLM is imported. Point ``FA3_LIB`` at that file.

At S = 8492 (8192 image + 300 text tokens), 24 heads x 128, e4m3 q / k / v in the DiT's (B, S, H, D) memory,
per-tensor descales, B = 1 and 2, it times (20 calls between two CUDA events, median of 7, one process):

* FA3 FP8 (bf16 output) with ``num_splits`` 1 and FA3's own choice (0);
* the pack's cuDNN FP8 kernel (``cudnn_fp8.run_kernel``, e4m3 output, padding-mask graph);
* SDPA's cuDNN bf16 kernel on the bf16 q / k / v;

and the relative error of each output against float64 attention on the unquantized inputs (4 heads).
Run from the repository root on an H100 / H200 (JSON in ``$OUT/fa3_fp8_attention.json``, table last)::

    source bench/device_env.sh && FA3_LIB=/tmp/vfa/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so \\
        python3 bench/fa3_fp8_attention_bench.py
"""

# ruff: noqa: B023 - each case is run and timed within its own loop iteration

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import harness_core as hc
from pack import load_pack

HEADS, HEAD_DIM, E4M3_MAX = 24, 128, 448.0
REF_HEADS = 4


def fa3_forward(q8, k8, v8, dq, dk, dv, num_splits: int = 1, seqused_k=None) -> torch.Tensor:
    """FA3's fwd op on e4m3 (B, S, H, D) q8 / k8 / v8 with (B, H) float32 descales -> bf16 (B, S, H, D).
    ``seqused_k`` (B,) int32, default all keys: vLLM's build runs only its varlen path, which this takes."""
    if seqused_k is None:
        seqused_k = torch.full((q8.shape[0],), k8.shape[1], dtype=torch.int32, device=q8.device)
    out = torch.ops._vllm_fa3_C.fwd(
        q8, k8, v8, None, None, None, None, None, None, None, None, seqused_k, None, None, None, None, None,
        None, None, None, dq, dk, dv, HEAD_DIM**-0.5, False, -1, -1, 0.0, True, None, num_splits, None, 0,
        None, 1, 0, None,
    )  # fmt: skip
    return out[0]


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor e4m3 of x (B, S, H, D) and its float32 descale (1, 1, 1, 1)."""
    amax = x.abs().amax().float().clamp_min(1e-12)
    return (x.float() * (E4M3_MAX / amax)).to(torch.float8_e4m3fn), (amax / E4M3_MAX).reshape(1, 1, 1, 1)


def reference(q, k, v, heads: int) -> torch.Tensor:
    """float64 attention of sample 0, the first ``heads`` heads: (S, heads, D)."""
    outs = []
    for h in range(heads):
        qh, kh, vh = (t[0, :, h].double() for t in (q, k, v))
        p = torch.softmax((qh @ kh.T) * HEAD_DIM**-0.5, dim=-1)
        outs.append(p @ vh)
    return torch.stack(outs, dim=1)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    got = out[0, :, : ref.shape[1]].double()
    return ((got - ref).norm() / ref.norm()).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    parser.add_argument("--tokens", type=int, default=8492)
    args = parser.parse_args()
    lib = os.environ.get("FA3_LIB")
    if not lib or not Path(lib).is_file():
        raise SystemExit("set FA3_LIB to a FlashAttention-3 extension (.so), e.g. vLLM 0.26.0's _vllm_fa3_C.abi3.so")
    torch.ops.load_library(lib)
    load_pack()
    from qwen_edit_hopper.fp8.attention import cudnn_fp8

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    s, rows = args.tokens, []
    for batch in (1, 2):
        q, k, v = (torch.randn(batch, s, HEADS, HEAD_DIM, device=device, generator=gen, dtype=torch.bfloat16)
                   for _ in range(3))  # fmt: skip
        (q8, dq), (k8, dk), (v8, dv) = quantize(q), quantize(k), quantize(v)
        bh = lambda d: d.reshape(1, 1).expand(batch, HEADS)  # noqa: E731
        flop = 4 * batch * HEADS * s * s * HEAD_DIM
        ref = reference(q, k, v, REF_HEADS) if batch == 1 else None
        qt, kt, vt = (t.transpose(1, 2) for t in (q8, k8, v8))
        cases = {
            "fa3 fp8, num_splits 1": lambda: fa3_forward(q8, k8, v8, bh(dq), bh(dk), bh(dv), 1),
            "fa3 fp8, num_splits auto": lambda: fa3_forward(q8, k8, v8, bh(dq), bh(dk), bh(dv), 0),
            "cudnn fp8 (pack)": lambda: cudnn_fp8.run_kernel(qt, kt, vt, dq, dk, dv),
            "sdpa cudnn bf16": lambda: sdpa_bf16(q, k, v),
        }
        for name, fn in cases.items():
            row = {"batch": batch, "case": name}
            try:
                out = fn()
                torch.cuda.synchronize()
                if ref is not None:
                    full = out.float() * (dv.reshape(()) if out.dtype == torch.float8_e4m3fn else 1.0)
                    row["rel_err"] = rel_err(full, ref)
                ms = hc.time_calls(lambda fn=fn: [fn() for _ in range(20)], device, warmup=2, reps=7)["ms"] / 20
                row.update(ms=ms, tflops=flop / ms / 1e9)
                hc.log(f"B={batch} {name}: {ms:.4f} ms, err {row.get('rel_err')}")
            except Exception as exc:  # a case that cannot run is reported, not fatal
                row["error"] = hc.error_text(exc, 300)
                hc.log(f"B={batch} {name}: {row['error']}")
            rows.append(row)
        if batch == 2:  # padded keys of the uncond sample: FA3's seqused_k against cuDNN's seq_len_kv
            used = torch.tensor([s, s - 150], dtype=torch.int32, device=device)
            try:
                a = fa3_forward(q8, k8, v8, bh(dq), bh(dk), bh(dv), 1, seqused_k=used).float()
                b = cudnn_fp8.run_kernel(qt, kt, vt, dq, dk, dv, seq_len_kv=used).float() * dv.reshape(())
                diff = ((a - b).norm() / b.norm()).item()
                rows.append({"batch": 2, "case": "padded keys: fa3 vs cudnn, relative difference", "rel_diff": diff})
            except Exception as exc:
                rows.append({"batch": 2, "case": "padded keys", "error": hc.error_text(exc, 300)})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fa3_fp8_attention.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "fa3_lib": lib, "rows": rows},
        indent=1))  # fmt: skip
    print("\n| B | case | ms | TFLOP/s | rel. error vs float64 (4 heads) |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "ms" in r:
            print(f"| {r['batch']} | {r['case']} | {r['ms']:.4f} | {r['tflops']:.0f} | {r.get('rel_err', '')} |")
        else:
            print(f"| {r['batch']} | {r['case']} | {r.get('rel_diff', '')} {r.get('error', '')[:150]} | | |")
    return 0


def sdpa_bf16(q, k, v) -> torch.Tensor:
    """SDPA's cuDNN kernel on (B, S, H, D) bf16 -> (B, S, H, D)."""
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


if __name__ == "__main__":
    sys.exit(main())
