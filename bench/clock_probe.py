#!/usr/bin/env python3
"""SM clock and power while the fastest forward runs, against the QK kernel alone: is the forward power-bound?

The QK norm + RoPE + e4m3 kernel takes 45.7 us per call inside the forward on an H200 (profile) but 32.9 us
alone on an H100 (``bench/qk_quant_bench.py``). One explanation is the 700 W limit: the GPU lowers its clocks
during the forward's GEMMs and attention, and memory-bound kernels between them run at those clocks too. This
script samples ``nvidia-smi`` (SM and memory clock, power, temperature) every 10 ms through four phases of a
few seconds each, marked by wall-clock time:

1. idle;
2. the QK kernel alone, back to back at the full-size shape (batch 1);
3. the fastest preset's forward (row-wise fp8, fast accumulation, fused kernels, compiled blocks,
   ``cudnn_fp8`` attention), batch 1, back to back;
4. the same forward with a 50 ms sleep after each (the GPU cools between forwards, as in a slow pipeline);
5. the batch-2 forward of a true-CFG step (cond + uncond), back to back (eighteenth session: are batch 2's kernels
   slower than twice batch 1's because the clocks are lower?).

Per phase: samples, median and minimum SM clock, median memory clock, median and maximum power. Also
the forward's time per call in phases 3 and 4 (CUDA events). Not yet run (written in the seventh session,
which had no device time left). Run from the repository root on an H100 / H200 (JSON in
``$OUT/clock_probe.json``, table last)::

    source bench/device_env.sh && python3 bench/clock_probe.py [--seconds 4]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness_core as hc
import harness_models as hm
import qk_quant_bench

QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu"


def parse_samples(text: str) -> list[tuple[float, float, float, float, float]]:
    """``nvidia-smi --format=csv,noheader,nounits`` lines -> (epoch s, SM MHz, memory MHz, W, deg C)."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        try:
            stamp = dt.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((stamp, *(float(p) for p in parts[1:])))
        except ValueError:
            continue
    return rows


def summarize(samples, start: float, end: float) -> dict:
    inside = [s for s in samples if start <= s[0] <= end]
    if not inside:
        return {"samples": 0}
    sm, mem, power = ([s[i] for s in inside] for i in (1, 2, 3))
    return {"samples": len(inside), "sm_mhz_median": statistics.median(sm), "sm_mhz_min": min(sm),
            "mem_mhz_median": statistics.median(mem), "power_w_median": statistics.median(power),
            "power_w_max": max(power)}  # fmt: skip


def run_for(seconds: float, fn, device: torch.device, pause_s: float = 0.0) -> list[float]:
    """Call ``fn`` until ``seconds`` have passed; ms per call (``harness_core.time_calls``, one call each)."""
    times = []
    until = time.time() + seconds
    while time.time() < until:
        times.append(hc.time_calls(fn, device, warmup=0, reps=1)["ms"])
        if pause_s:
            time.sleep(pause_s)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    from qwen_edit_hopper.qwen_edit import fast_forward as ff
    from qwen_edit_hopper.qwen_edit.compile import dynamo_settings

    device = torch.device("cuda")
    module, inputs = hm.fastest_fp8_dit_at_full_size(device)
    qk_args = qk_quant_bench.inputs(1, device)

    def forward():
        return hm.fast_forward(ff, module, inputs, attention="cudnn_fp8")

    def cfg_forward():
        return hm.fast_forward(ff, module, inputs, batch=2, attention="cudnn_fp8")

    def qk_kernel():
        return qk_quant_bench.qq.qk_norm_rope_quantize(*qk_args)

    with dynamo_settings():
        for _ in range(3):
            forward()
            cfg_forward()
        qk_kernel()
        torch.cuda.synchronize()
        log = args.out / "nvidia_smi.csv"
        args.out.mkdir(parents=True, exist_ok=True)
        with log.open("w") as sink:
            sampler = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                        "-lms", "10"], stdout=sink, stderr=subprocess.DEVNULL)  # fmt: skip
            try:
                marks = {}
                t0 = time.time()
                time.sleep(args.seconds)
                marks["idle"] = (t0, time.time())
                t0 = time.time()
                qk_ms = run_for(args.seconds, qk_kernel, device)
                marks["QK kernel alone"] = (t0, time.time())
                t0 = time.time()
                forward_ms = run_for(args.seconds, forward, device)
                marks["forward, back to back"] = (t0, time.time())
                t0 = time.time()
                paused_ms = run_for(args.seconds, forward, device, pause_s=0.05)
                marks["forward, 50 ms pause after each"] = (t0, time.time())
                t0 = time.time()
                cfg_ms = run_for(args.seconds, cfg_forward, device)
                marks["batch-2 forward, back to back"] = (t0, time.time())
            finally:
                sampler.terminate()
                sampler.wait(timeout=10)
    samples = parse_samples(log.read_text())
    # the first and last 10% of each phase are dropped (clocks settle; the sampler's timestamps are coarse)
    phases = {name: summarize(samples, a + 0.1 * (b - a), b - 0.1 * (b - a)) for name, (a, b) in marks.items()}
    phases["QK kernel alone"]["ms_per_call_median"] = statistics.median(qk_ms)
    phases["forward, back to back"]["ms_per_call_median"] = statistics.median(forward_ms)
    phases["forward, 50 ms pause after each"]["ms_per_call_median"] = statistics.median(paused_ms)
    phases["batch-2 forward, back to back"]["ms_per_call_median"] = statistics.median(cfg_ms)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "phases": phases}
    (args.out / "clock_probe.json").write_text(json.dumps(result, indent=1))
    print(f"\n{'phase':34s} {'n':>5s} {'SM MHz':>7s} {'SM min':>7s} {'mem MHz':>8s} {'W med':>6s} {'W max':>6s} "
          f"{'ms/call':>8s}")  # fmt: skip
    for name, p in phases.items():
        if not p.get("samples"):
            print(f"{name:34s} no samples")
            continue
        print(f"{name:34s} {p['samples']:5d} {p['sm_mhz_median']:7.0f} {p['sm_mhz_min']:7.0f} "
              f"{p['mem_mhz_median']:8.0f} {p['power_w_median']:6.0f} {p['power_w_max']:6.0f} "
              f"{p.get('ms_per_call_median', float('nan')):8.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
