"""A/B of the fast forward's options on one fp8 model: the shipped kernels against their alternatives.

Full-size Qwen-Image-Edit DiT, random weights, 1024x1024 edit with one reference image (8192 image +
300 text tokens), the fastest preset (row-wise fp8, fast accumulation, "attn+mlp+mod compute", the workspace-free
cuBLASLt call, compiled blocks, ``cudnn_fp8`` attention). One fp8 model serves every variant; a variant is a
``ForwardOptions`` value (``dataclasses.replace(SHIPPED, field=...)``) and whether the forward runs as whole-forward
CUDA graphs. Each variant's batch-1 forward and batch-2 forward (true CFG: cond + uncond) are timed in alternating
rounds (CUDA events, median), so clock and power drift hit all variants alike. Sets of variants (``--set``):

* ``main`` (default): shipped, shipped without CUDA graphs, and every fused kernel off (``UNFUSED``), with and
  without graphs;
* ``leave-one-out``: shipped, and shipped with each option turned off alone (what each kernel buys);
* ``fields``: shipped, and shipped with the options named by ``--fields`` off (e.g.
  ``--set fields --fields joint_v_gemm,gelu_gemm``).

Each variant's kernel plan (which kernels ran, which were left out and why) is printed and stored, with the
whole-forward relative error against bf16 eager. Run from the repo root on an H100 / H200 (JSON in
``$OUT/forward_ab.json``)::

    source bench/prepare_device.sh --device && python3 bench/forward_ab_bench.py [--set main] [--out DIR] [--rounds N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness_core as hc
import harness_models as hm

SETS = ("main", "leave-one-out", "fields")


def _off(options, field: str):
    """``options`` with ``field`` turned off (False, or no streams / sites)."""
    value = getattr(options, field)
    return dataclasses.replace(options, **{field: () if isinstance(value, tuple) else False})


def variants(name: str, fields: tuple[str, ...]) -> list[tuple[str, object, bool]]:
    """(label, ForwardOptions, CUDA graphs) for the set ``name``."""
    from qwen_edit_hopper.qwen_edit.fast.options import SHIPPED, UNFUSED

    shipped = [("shipped + CUDA graphs", SHIPPED, True)]
    if name == "main":
        return [*shipped, ("shipped", SHIPPED, False), ("unfused + CUDA graphs", UNFUSED, True),
                ("unfused", UNFUSED, False)]
    if name == "leave-one-out":
        fields = tuple(f.name for f in dataclasses.fields(SHIPPED))
    unknown = [f for f in fields if not hasattr(SHIPPED, f)]
    if unknown or not fields:
        allowed = ", ".join(f.name for f in dataclasses.fields(SHIPPED))
        raise SystemExit(f"--fields: {', '.join(unknown) or 'none given'}; allowed: {allowed}")
    return shipped + [(f"shipped without {field} + CUDA graphs", _off(SHIPPED, field), True) for field in fields]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    parser.add_argument("--set", choices=SETS, default="main", dest="variant_set")
    parser.add_argument("--fields", default="", help="with --set fields: options to turn off, comma-separated")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--zero-cond-t", action="store_true",
                        help="every forward with Qwen-Image-Edit-2511's zero_cond_t (reference tokens at timestep 0)")
    parser.add_argument("--only", metavar="I,J", help="run only these variants (0-based indices of the set)")
    args = parser.parse_args()
    hc.load_pack()
    from qwen_edit_hopper.qwen_edit import fast_forward as ff
    from qwen_edit_hopper.qwen_edit.compile import dynamo_settings

    chosen = variants(args.variant_set, tuple(f for f in args.fields.split(",") if f))
    if args.only:
        chosen = [chosen[int(i)] for i in args.only.split(",")]

    device = torch.device("cuda")
    base = hm.build_dit(hm.FULL, device)
    inputs = hm.ForwardInputs.make(1024, 1024, 300, 3584, device)
    reference = hm.fast_forward(ff, base, inputs, zero_cond_t=args.zero_cond_t).float()
    prepared = hm.fastest_fp8_dit(base)
    del base
    hc.free_memory()
    current = [None]

    def runner(options, graphed: bool, batch: int):
        def call():
            if current[0] != (options, graphed):  # graphs of another variant are dropped, then captured again
                prepared.disable_cuda_graphs()
                if graphed:
                    prepared.enable_cuda_graphs()
                current[0] = (options, graphed)
            return hm.fast_forward(ff, prepared, inputs, batch=batch, attention="cudnn_fp8",
                                   zero_cond_t=args.zero_cond_t, options=options)

        return call

    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "zero_cond_t": args.zero_cond_t,
               "set": args.variant_set, "variants": {}}
    times: dict[tuple[str, int], list[float]] = {}
    with dynamo_settings():
        for label, options, graphed in chosen:
            entry = results["variants"][label] = {"options": options.describe(), "cuda_graphs": graphed}
            for batch in (1, 2):
                out = runner(options, graphed, batch)()
                entry[f"kernels_batch{batch}"] = prepared.last_plan.describe()
                if batch == 1:
                    entry["rel_err"] = rel_err(out, reference)
                times[(label, batch)] = []
        for _ in range(args.rounds):
            for label, options, graphed in chosen:
                for batch in (1, 2):
                    call = runner(options, graphed, batch)
                    call()
                    times[(label, batch)].append(hc.time_calls(call, device, warmup=1, reps=args.reps)["ms"])
    for label, *_ in chosen:
        one, two = (statistics.median(times[(label, b)]) for b in (1, 2))
        results["variants"][label].update({"batch1_ms": round(one, 2), "batch2_ms": round(two, 2),
                                           "ratio": round(two / one, 3),
                                           "rounds_batch1": [round(t, 2) for t in times[(label, 1)]]})  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "forward_ab.json").write_text(json.dumps(results, indent=1))
    for label, v in results["variants"].items():
        print(f"\n{label}:\n{v['kernels_batch1']}")
    print(f"\n{'variant':48s} {'batch 1 ms':>10s} {'batch 2 ms':>10s} {'b2 / b1':>8s} {'rel. error':>10s}")
    for label, v in results["variants"].items():
        print(f"{label:48s} {v['batch1_ms']:10.2f} {v['batch2_ms']:10.2f} {v['ratio']:8.3f} {v['rel_err']:10.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
