"""The 120 modulation linears of a Qwen-Image DiT forward: per-layer ``_scaled_mm`` against one shared launch.

Each block's ``img_mod.1`` / ``txt_mod.1`` (3072 -> 18432, row-wise fp8) on the same one or two rows. Times,
per forward (120 layers, CUDA events, median of alternating rounds, each call sequence captured in a CUDA
graph so host launch cost is out): 120 ``ScaledMMLinear`` calls; one
:class:`qwen_edit_hopper.fp8.shared_input_gemv.SharedInputLinears` launch at several tile configurations,
with the bandwidth it reaches (6.8 GB of e4m3 weights). Also checks each configuration against the
layers' own outputs. Run from the repo root on an H100 / H200::

    source bench/device_env.sh && python3 bench/modulation_bench.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness_core as hc

CONFIGS = (
    (64, 128, 4, 4),
    (32, 128, 4, 4),
    (32, 256, 4, 4),
    (16, 128, 4, 4),
    (64, 128, 4, 6),
    (16, 256, 4, 1, "fma"),
    (16, 512, 4, 1, "fma"),
    (32, 256, 4, 1, "fma"),
    (8, 512, 2, 1, "fma"),
    (16, 512, 8, 1, "fma"),
    (32, 512, 8, 2, "fma"),
)
"""(BN, BK, num_warps, num_stages[, "fma": the kernel without tensor cores])."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    hc.load_pack()
    from qwen_edit_hopper.fp8.linear import ScaledMMLinear
    from qwen_edit_hopper.fp8.shared_input_gemv import SharedInputLinears

    device = torch.device("cuda")
    layers = []
    for _ in range(120):
        linear = torch.nn.Linear(3072, 18432, device=device, dtype=torch.bfloat16)
        torch.nn.init.normal_(linear.weight, std=0.02)
        layers.append(ScaledMMLinear.from_linear(linear, "rowwise", fast_accum=True))
        del linear
    weight_bytes = sum(layer.weight.numel() for layer in layers)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
    for rows in args.rows:
        x = torch.randn(rows, 3072, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            want = torch.stack([layer(x) for layer in layers]).float()
        fns = {"120 x ScaledMMLinear": lambda x=x: [layer(x) for layer in layers]}
        errors = {}
        for config in CONFIGS:
            group = SharedInputLinears(layers)
            group.config = config
            try:
                got = group(x).float()
            except Exception as exc:  # a configuration Triton cannot compile is reported, not fatal
                errors[str(config)] = f"{type(exc).__name__}: {str(exc)[:200]}"
                continue
            errors[str(config)] = ((got - want).norm() / want.norm()).item()
            name = f"shared-input BN {config[0]} BK {config[1]} w{config[2]} s{config[3]} {''.join(config[4:])}"
            fns[name] = lambda g=group, x=x: g(x)
        replays = {name: hc.capture_cuda_graph(fn, warmups=1)[0].replay for name, fn in fns.items()}
        times: dict[str, list[float]] = {name: [] for name in replays}
        for _ in range(5):
            for name, replay in replays.items():
                times[name].append(hc.time_calls(replay, device, warmup=1, reps=5)["ms"])
        table = {
            name: {"ms": round(statistics.median(ts), 3), "TB/s": round(weight_bytes / statistics.median(ts) / 1e9, 2)}
            for name, ts in times.items()
        }
        results["rows"][rows] = {"times": table, "rel_err_vs_layers": errors}
        print(f"\nrows {rows}: relative error vs the layers {errors}")
        for name, row in table.items():
            print(f"  {name:44s} {row['ms']:7.3f} ms  {row['TB/s']:5.2f} TB/s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "modulation.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
