#!/usr/bin/env python3
"""Does the small-M GEMM lose its vectorized loads under torch.compile when its input is a row slice?

In the forward's timeline (fifteenth session) the text stream's output projection (M = 300, K = N = 3072) takes
41 us through ``fp8.small_m_gemm`` and 15 us through cuBLASLt; alone the Triton kernel takes about 10 us. Its input
is the text rows of the attention output, a slice at row 8192. This times the kernel on such a slice eagerly and
compiled (``torch.compile``, the pack's Inductor settings), and prints the divisibility hints Inductor gave the
kernel's pointer arguments. Run from the repository root on an H100 / H200::

    python3 bench/small_m_alignment_check.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import harness_core as hc
from pack import load_pack

load_pack()
from qwen_edit_hopper.fp8 import small_m_gemm  # noqa: E402


def main() -> int:
    device = torch.device("cuda")
    s_img, s_txt, d = 8192, 300, 3072
    out8 = torch.randn(s_img + s_txt, d, device=device).to(torch.float8_e4m3fn)
    xs = torch.full((s_txt, 1), 0.01, device=device)
    w8 = torch.randn(d, d, device=device).to(torch.float8_e4m3fn)
    ws = torch.full((d, 1), 0.01, device=device)
    config = small_m_gemm.OUTPUT_PROJECTION_CONFIG

    image = torch.empty(1, s_img, 1, device=device)  # the slice offset from a shape, as in the block

    def text_projection(o, image):
        return small_m_gemm.fp8_gemm_small_m(o[image.shape[1]:], xs, w8, ws, config)

    from torch._inductor.utils import run_and_get_code

    whole = small_m_gemm.fp8_gemm_small_m(out8[s_img:].clone(), xs, w8, ws, config)
    eager_us = hc.graph_ms_per_call(lambda i: text_projection(out8, image), 20, reps=5) * 1000
    print(f"eager on the slice: {eager_us:.2f} us")
    for dynamic in (False, True):  # True: the image length marked dynamic, as the pack's compile marks it
        torch._dynamo.reset()
        if dynamic:
            torch._dynamo.mark_dynamic(image, 1)
        compiled = torch.compile(text_projection, dynamic=False if not dynamic else None)
        _, code = run_and_get_code(compiled, out8, image)
        for line in "\n".join(code).splitlines():
            if "tt.divisibility" in line or ("_fp8_gemm_small_m_kernel" in line and ".run(" in line):
                print("   ", line.strip()[:240])
        compiled_us = hc.graph_ms_per_call(lambda i, c=compiled: c(out8, image), 20, reps=5) * 1000
        print(f"compiled (dynamic={dynamic}) on the slice: {compiled_us:.2f} us; same output: "
              f"{bool(torch.equal(whole, compiled(out8, image)))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
