#!/usr/bin/env python3
"""Qwen-Image-Edit on one Hopper GPU: every preset of this pack and the anchors, measured in one run.

Run from the repository root on the device machine (after ``source bench/device_env.sh``)::

    python3 bench/harness.py [--part forward|cfg|resolution|e2e|linear|all] [--only PATTERN] [--out DIR]

Parts (``--part a,b``; default all; they run in this order):

* ``forward``: one DiT forward at 1024x1024 with one reference image (8192 image + 300 text tokens),
  batch 1: ms, whole-forward error and peak memory of every preset and anchor
  (bench/harness_forward.py), plus ``forward.png``.
* ``cfg``: one true-CFG step, DiffSynth's two batch-1 forwards vs the fast path's batch 2.
* ``resolution``: 512x512 and 1328x1328 for bf16 compiled and the fp8 paths.
* ``e2e``: the whole edit through ``run_edit`` (prompt encoding, 40 denoising steps with true CFG 4,
  VAE decode) for the baseline (bf16 eager, DiffSynth's forward, sequential CFG), the pack's default,
  the fastest preset, and Lightning 4-step; memory timeline ``e2e_memory.png`` (bench/harness_e2e.py).
* ``linear``: single linears at the DiT's shapes, every fp8 backend, eager and compiled, forward and
  input gradient, accuracy vs float64 (bench/harness_linear.py), plus ``linear.png``.

``--only`` takes comma-separated patterns over measurement ids such as ``forward/ds/bf16-eager``,
``cfg/fast/fp8-rowwise-compiled``, ``resolution/fast/bf16-compiled@1328x1328``, ``e2e/fastest-cfg4-40``,
``linear/8192x3072x3072/scaled-mm-rowwise-compiled`` (``ds/*`` = every DiffSynth variant in the
selected parts; a pattern without wildcards is a substring). ``python3 bench/harness.py --list``
prints them all.

Device plan (one H200; each call under the 10-minute limit, ``--budget-s`` stops starting measurements
that would not finish; what it leaves out is recorded "not run" and ``--retry-from`` picks it up).
Carry ``.whl`` and ``.comfy_src`` (ComfyUI's source; ``COMFY_DIR`` overrides) with every call, and
``.tew`` with the call that builds Transformer Engine (after the five ``.tecN`` copies of
shared/docs/gpu-device.md)::

    1. source bench/device_env.sh && python3 bench/harness.py --part forward,cfg \
           --only 'ds/*,comfy/*,torchao/*' --budget-s 450
    2. source bench/device_env.sh && python3 bench/harness.py --part forward,cfg,resolution \
           --only 'fast/*' --budget-s 540
    3. (copy call 2's results.json to bench/prior/call2.json here first: --fastest auto picks from it)
       source bench/device_env.sh && python3 bench/harness.py --part e2e,linear --prior bench/prior \
           --budget-s 540
    4. only if the budget left measurements out: ... --retry-from bench/prior (their ids are re-selected)

then here: ``python3 bench/harness.py --merge DIR1 DIR2 DIR3 --out bench/out/merged --record``.

Outputs in ``--out`` (default ``$OUT``, else bench/out): ``results.json`` (rewritten after every
measurement; an existing one is resumed: ok records are kept and not measured again unless
``--redo``), ``section.md`` (the markdown for docs/benchmarks.md), PNG charts. The short table
of ratios is printed last. ``--merge DIR ...`` combines the results of several runs (no GPU needed)
and ``--record`` appends the section to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness_core as core

core.load_pack()

import torch  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--part", default="all", help="comma-separated parts: linear, forward, cfg, resolution, e2e, all")
    p.add_argument("--only", default=None, help="comma-separated id patterns (fnmatch, or substring without wildcards)")
    p.add_argument("--out", default=None, help="output folder (default $OUT, else bench/out)")
    p.add_argument("--tiny", action="store_true", help="tiny models and sizes (CPU tests of the harness itself)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu (only with --tiny)")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="stop starting measurements that would end after this many seconds (0: no limit)")
    p.add_argument("--no-compile", action="store_true", help="record compiled variants as not run")
    p.add_argument("--compile-dynamic", choices=("pack", "true", "false"), default="pack",
                   help="dynamic= of the pack's regional compile (pack: CompileChoice's default)")
    p.add_argument("--compile-estimate-s", type=float, default=150.0,
                   help="budget estimate of one cold compile of a DiT block")
    p.add_argument("--fastest", default="auto", help="e2e fastest preset: a variant id, or auto")
    p.add_argument("--prior", nargs="*", default=[], help="results.json files or folders of earlier runs: their "
                   "figures serve as baselines and for --fastest auto (their records are not copied)")
    p.add_argument("--retry-from", nargs="*", default=[], help="results.json files or folders of earlier runs: "
                   "their measurements that the time budget left 'not run' are added to this run's selection")
    p.add_argument("--merge", nargs="+", default=None, help="merge the results of these folders/files and report "
                   "(no measurement)")
    p.add_argument("--record", action="store_true", help="append the section to docs/benchmarks.md")
    p.add_argument("--redo", action="store_true", help="measure again what --out's results.json has as ok")
    p.add_argument("--reps", type=int, default=None, help="timed forwards per measurement (default 6; tiny 2)")
    p.add_argument("--negative-tokens", type=int, default=None,
                   help="negative prompt tokens in the cfg part (default 287 with a 300-token prompt)")
    p.add_argument("--e2e-steps", type=int, default=None, help="denoising steps of the CFG presets (default 40)")
    p.add_argument("--linear-reps", type=int, default=30, help="timed calls per linear measurement")
    p.add_argument("--list", action="store_true", help="print every measurement id and exit")
    return p.parse_args(argv)


def with_retries(selection: core.Selection, sources: list[str]) -> core.Selection:
    """``selection`` plus every measurement the time budget left not run in ``sources`` (their parts too)."""
    retry = [r.id for r in core.load_results(sources).records.values()
             if r.status == core.NOT_RUN and r.error.startswith("time budget")]
    if not retry:
        return selection
    only = selection.only or tuple(f"{part}/*" for part in selection.parts)
    parts = tuple(p for p in core.PARTS if p in selection.parts or any(r.startswith(p + "/") for r in retry))
    core.log(f"retrying {len(retry)} measurements the time budget left out: {', '.join(retry)}")
    return core.Selection(parts, (*only, *retry))


def out_dir(args: argparse.Namespace) -> Path:
    if args.out:
        return Path(args.out)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    return core.ROOT / "bench" / "out"


def all_ids(args: argparse.Namespace) -> list[str]:
    import harness_e2e
    import harness_forward
    import harness_linear

    size = "tiny" if args.tiny else "full"
    sizes = harness_forward.Sizes.tiny() if args.tiny else harness_forward.Sizes()
    ctx = harness_forward.ForwardContext(torch.device("cpu"), torch.bfloat16, size, sizes, runner=None,
                                         compile_choice=None)
    steps = args.e2e_steps or (2 if args.tiny else 40)
    e2e = [p.id for p in harness_e2e.presets("<fastest>", steps, 2 if args.tiny else 4)]
    shapes = harness_linear.TINY_SHAPES if args.tiny else harness_linear.FULL_SHAPES
    return harness_linear.all_measurement_ids(shapes) + harness_forward.all_measurement_ids(ctx) + e2e


def report(store: core.ResultStore, out: Path, record: bool) -> None:
    import harness_e2e
    import harness_linear
    import harness_report

    env = store.runs[-1] if store.runs else {}
    title = f"{env.get('gpu', '?')}, torch {env.get('torch', '?')}, {env.get('started', '')[:16]}"
    charts = {}
    for name, draw in (("forward.png", lambda p: harness_report.draw_forward_chart(store, p, title)),
                       ("linear.png", lambda p: harness_linear.draw_linear_chart(store.records.values(), p, title)),
                       ("e2e_memory.png", lambda p: harness_e2e.draw_memory_chart(store.records.values(), p, title))):
        try:
            if draw(out / name):
                charts[name] = name
        except Exception as exc:  # a chart failing must not hide the table
            core.log(f"chart {name} failed: {core.error_text(exc)}")
    section = harness_report.markdown_section(store, charts)
    (out / "section.md").write_text(section)
    if record:
        path = harness_report.record_run(store, out, charts)
        core.log(f"appended the section to {path}")
    core.log("")
    core.log(harness_report.short_table(store))


def merge(args: argparse.Namespace, out: Path) -> int:
    store = core.load_results(args.merge)
    store.path = out / "results.json"
    store.save()
    report(store, out, args.record)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("qwen_edit_hopper").setLevel(logging.INFO)
    if args.list:
        print("\n".join(all_ids(args)))
        return 0
    out = out_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        return merge(args, out)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not args.tiny:
        raise SystemExit("full-size models need a CUDA GPU; on CPU use --tiny (tests of the harness itself)")
    import harness_report

    given = argv if argv is not None else sys.argv[1:]
    command = "python3 bench/harness.py " + " ".join(shlex.quote(a) for a in given)
    store = core.ResultStore(out, harness_report.env_info(device, command, vars(args)))
    if args.prior:
        store.fallback = core.load_results(args.prior)
    selection = core.Selection.parse(args.part, args.only)
    if args.retry_from:
        selection = with_retries(selection, args.retry_from)
    runner = core.Runner(store, selection, core.Budget(args.budget_s), redo=args.redo)
    core.log(f"harness: parts {','.join(selection.parts)}, only {list(selection.only) or 'all'}, device {device}, "
             f"out {out}, budget {args.budget_s:.0f} s")
    started = time.monotonic()
    try:
        run(args, device, runner)
    finally:
        core.log(f"harness: measurements took {time.monotonic() - started:.0f} s")
        report(store, out, args.record)
    return 0


def run(args: argparse.Namespace, device: torch.device, runner: core.Runner) -> None:
    import harness_forward
    from qwen_edit_hopper.qwen_edit.plan import CompileChoice

    tiny = args.tiny
    size = "tiny" if tiny else "full"
    sizes = harness_forward.Sizes.tiny() if tiny else harness_forward.Sizes()
    if args.reps:
        sizes = dataclasses.replace(sizes, reps=args.reps)
    if args.compile_dynamic == "pack":
        choice = CompileChoice()
    else:
        choice = CompileChoice(dynamic=args.compile_dynamic == "true")
    ctx = harness_forward.ForwardContext(device, torch.bfloat16, size, sizes, runner, choice,
                                         no_compile=args.no_compile, negative_tokens=args.negative_tokens,
                                         compile_estimate_s=args.compile_estimate_s)
    parts = runner.selection.parts
    if any(p in parts for p in ("forward", "cfg", "resolution")):
        harness_forward.run_families(ctx)
    if "e2e" in parts:
        import harness_e2e

        e2e = harness_e2e.E2EContext(device, torch.bfloat16, size, runner, ctx,
                                     resolution=64 if tiny else 1024,
                                     steps=args.e2e_steps or (2 if tiny else 40),
                                     lightning_steps=2 if tiny else 4, warmup_steps=2,
                                     fastest=args.fastest, no_compile=args.no_compile, compile_choice=choice)
        harness_e2e.run_e2e(e2e)
    ctx.release()
    if "linear" in parts:
        import harness_linear

        shapes = harness_linear.TINY_SHAPES if tiny else harness_linear.FULL_SHAPES
        harness_linear.run_linear(runner, device, shapes, warmup=1 if tiny else 3,
                                  reps=2 if tiny else args.linear_reps, no_compile=args.no_compile)


if __name__ == "__main__":
    sys.exit(main())
