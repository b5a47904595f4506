#!/usr/bin/env python3
"""Is the first kernel after cuDNN's FP8 attention slower than alone?

In the fifteenth session's forward timeline (H200, CUDA graphs) the text stream's output projection (3072 -> 3072
at M = 300, the pack's small-M Triton GEMM), which Inductor schedules right after the attention kernel, took 41 us;
alone it takes about 10 us (fp8/small_m_gemm.py). In the twelfth session, when it ran after the image stream's
output projection, it took 12.6 us. This times, in CUDA graphs of 10 repetitions (median of 5 replays): the
attention alone; the attention then the text projection; the attention then the image projection (M = 8192,
``torch._scaled_mm``); the attention then image then text; and each projection alone. The difference of two
graphs, per repetition, is what the added kernel cost in that position. Run from the repository root on an H100 /
H200 (cudnn-frontend carried in .whl; JSON in ``$OUT/after_attention.json``)::

    source bench/device_env.sh && python3 bench/after_attention_bench.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import harness_core as hc
from pack import load_pack

load_pack()
from qwen_edit_hopper.fp8 import small_m_gemm  # noqa: E402
from qwen_edit_hopper.fp8.attention.cudnn_fp8 import run_kernel  # noqa: E402

H, D, S_IMG, S_TXT = 24, 128, 8192, 300
REPS = 10


def main() -> int:
    device = torch.device("cuda")
    out_dir = Path(os.environ.get("OUT", "bench/out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    s = S_IMG + S_TXT
    q8, k8, v8 = ((torch.randn(1, s, H, D, device=device) * 40).to(torch.float8_e4m3fn).transpose(1, 2)
                  for _ in range(3))
    one = torch.ones(1, 1, 1, 1, device=device)
    descale = one / 448
    w_txt = torch.randn(H * D, H * D, device=device).to(torch.float8_e4m3fn)
    w_img = torch.randn(H * D, H * D, device=device).to(torch.float8_e4m3fn)
    ws = torch.full((H * D, 1), 0.01, device=device)
    x_scale_txt = torch.full((S_TXT, 1), 0.01, device=device)
    x_scale_img = torch.full((S_IMG, 1), 0.01, device=device)
    config = small_m_gemm.CONFIGS[(H * D, H * D)]
    state = {}

    def attention():
        state["o"] = run_kernel(q8, k8, v8, descale, descale, descale).reshape(s, H * D)

    def text():
        x = state["o"][S_IMG:]
        return small_m_gemm.fp8_gemm_small_m(x, x_scale_txt, w_txt, ws, config)

    def image():
        x = state["o"][:S_IMG]
        return torch._scaled_mm(x, w_img.t(), x_scale_img, ws.t(), out_dtype=torch.bfloat16, use_fast_accum=True)

    attention()
    sequences = {"attention": [attention], "attention, text": [attention, text], "attention, image": [attention, image],
                 "attention, image, text": [attention, image, text], "text": [text], "image": [image],
                 "image, text": [image, text]}
    us = {}
    for name, calls in sequences.items():
        def run(_i, calls=calls):
            for _ in range(REPS):
                for c in calls:
                    c()
        us[name] = hc.graph_ms_per_call(run, 1, reps=5) * 1000 / REPS
        print(f"{name:28s} {us[name]:9.2f} us per repetition", flush=True)
    derived = {"text after attention": us["attention, text"] - us["attention"],
               "image after attention": us["attention, image"] - us["attention"],
               "text after attention + image": us["attention, image, text"] - us["attention, image"],
               "text alone": us["text"], "image alone": us["image"],
               "text after image (no attention)": us["image, text"] - us["image"]}
    print()
    for name, value in derived.items():
        print(f"{name:34s} {value:8.2f} us")
    (out_dir / "after_attention.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "us": us,
                                                              "derived": derived}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
