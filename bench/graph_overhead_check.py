"""Where a graphed fast forward's time goes: the whole call, the replay alone, the host-side checks.

Full-size DiT, random weights, the fastest preset compiled (``cudnn_fp8``), 1024x1024 edit, batch 1. Times in
alternating rounds: the forward kernel by kernel; through ``fast.graphs`` (one and two warm-up forwards
before the capture); the captured graph's ``replay`` alone; and on the host clock the weight-address check
that every graphed call makes. Run from the repo root on an H100 / H200::

    source bench/device_env.sh && python3 bench/graph_overhead_check.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness_core as hc
import harness_models as hm


def main() -> int:
    hc.load_pack()
    from qwen_edit_hopper.qwen_edit import fast_forward as ff
    from qwen_edit_hopper.qwen_edit.compile import dynamo_settings
    from qwen_edit_hopper.qwen_edit.fast import graphs

    device = torch.device("cuda")
    module, inputs = hm.fastest_fp8_dit_at_full_size(device)

    def call():
        return hm.fast_forward(ff, module, inputs, attention="cudnn_fp8")

    with dynamo_settings():
        call()
        for warmups in (1, 2):
            graphs.disable_cuda_graphs(module)
            state = graphs.enable_cuda_graphs(module)
            state.warmups = warmups
            call()
            replay = next(iter(state._graphs.values())).graph.replay

            def eager():
                graphs._REGISTRY.pop(module, None)
                return call()

            def graphed(state=state):
                graphs._REGISTRY[module] = state
                return call()

            fns = {"kernel by kernel": eager, f"fast.graphs call ({warmups} warm-up)": graphed,
                   f"its replay alone ({warmups} warm-up)": replay}  # fmt: skip
            generation = graphs._GENERATION[0]
            times = {name: [] for name in fns}
            for _ in range(4):
                for name, fn in fns.items():
                    times[name].append(hc.time_calls(fn, device, warmup=1, reps=5)["ms"])
            started = time.perf_counter()
            for _ in range(100):
                state._weights_moved(module)
            check_ms = (time.perf_counter() - started) * 10
            print(
                f"\nregistration events during the timed calls: {graphs._GENERATION[0] - generation}; weight-address "
                f"check {check_ms:.3f} ms on the host ({len(state._tensors)} tensors); captures {state.captures}"
            )
            for name, ts in times.items():
                print(f"{name:40s} {statistics.median(ts):8.2f} ms  {[round(t, 1) for t in ts]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
