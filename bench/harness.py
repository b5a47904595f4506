#!/usr/bin/env python3
"""Qwen-Image-Edit on one Hopper GPU: every preset of this pack and the anchors, measured in one run.

Run from the repository root on the device machine (after ``source bench/prepare_device.sh --device``)::

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
``.tew`` with the call that builds Transformer Engine (after the Transformer Engine wheel parts
are on the machine, /root/tec)::

    1. source bench/prepare_device.sh --device && python3 bench/harness.py --part forward,cfg \
           --only 'ds/*,comfy/*,torchao/*' --budget-s 450
    2. source bench/prepare_device.sh --device && python3 bench/harness.py --part forward,cfg,resolution \
           --only 'fast/*' --budget-s 540
    3. (copy call 2's results.json to bench/prior/call2.json here first: --fastest auto picks from it)
       source bench/prepare_device.sh --device && python3 bench/harness.py --part e2e,linear --prior bench/prior \
           --budget-s 540
    4. only if the budget left measurements out: ... --retry-from bench/prior (their ids are re-selected)

then here: ``python3 bench/harness.py --merge DIR1 DIR2 DIR3 --out bench/out/merged --record``.

Outputs in ``--out`` (default ``$OUT``, else bench/out): ``results.json`` (rewritten after every
measurement; an existing one is resumed: ok records are kept and not measured again unless
``--redo``), ``section.md`` (the record's markdown), PNG charts. The short table
of ratios is printed last. ``--merge DIR ...`` combines the results of several runs (no GPU needed)
and ``--record`` rewrites docs/performance/<card>.md with it.

Tables, record and charts (the second half of this file): ratios are ``baseline ms / variant ms`` (above 1 =
faster than the baseline). Baselines, all at
1024x1024 with one reference image, batch 1, measured in the same store (this run, or merged runs):
DiffSynth bf16 eager (``forward/ds/bf16-eager``), ComfyUI core bf16 compiled
(``forward/comfy/bf16-compiled``) and torchao float8 row-wise compiled
(``forward/torchao/fp8-rowwise-compiled``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import logging
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness_core as core

core.load_pack()

import torch  # noqa: E402
from harness_core import ERROR, NOT_RUN, OK, ROOT, UNAVAILABLE, Record, ResultStore, card_name, load_pack  # noqa: E402


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
    p.add_argument("--record", action="store_true", help="rewrite docs/performance/<card>.md with this run's section")
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
    return harness_linear.linear_measurement_ids(shapes) + harness_forward.all_measurement_ids(ctx) + e2e


def report(store: core.ResultStore, out: Path, record: bool) -> None:
    import harness_e2e
    import harness_linear

    env = store.runs[-1] if store.runs else {}
    title = f"{env.get('gpu', '?')}, torch {env.get('torch', '?')}, {env.get('started', '')[:16]}"
    charts = {}
    for name, draw in (("forward.png", lambda p: draw_forward_chart(store, p, title)),
                       ("linear.png", lambda p: harness_linear.draw_linear_chart(store.records.values(), p, title)),
                       ("e2e_memory.png", lambda p: harness_e2e.draw_memory_chart(store.records.values(), p, title))):
        try:
            if draw(out / name):
                charts[name] = name
        except Exception as exc:  # a chart failing must not hide the table
            core.log(f"chart {name} failed: {core.error_text(exc)}")
    section = markdown_section(store, charts)
    (out / "section.md").write_text(section)
    if record:
        path = record_run(store, out, charts)
        core.log(f"wrote the record {path}")
    core.log("")
    core.log(short_table(store))


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

    given = argv if argv is not None else sys.argv[1:]
    command = "python3 bench/harness.py " + " ".join(shlex.quote(a) for a in given)
    store = core.ResultStore(out, env_info(device, command, vars(args)))
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


# ============================================================================= tables, record, charts

PERFORMANCE_DIR = ROOT / "docs" / "performance"
"""Where the record step writes: one ``<card>.md`` per GPU kind (``H100.md``, ``H200.md``), charts in ``<card>/``."""
BASELINES = {
    "DiffSynth bf16 eager": "forward/ds/bf16-eager",
    "ComfyUI bf16 compiled": "forward/comfy/bf16-compiled",
    "torchao fp8 compiled": "forward/torchao/fp8-rowwise-compiled",
}

RECORD_HEADER = """# Performance on {card}

Written by `bench/harness.py --record` from the results of one GPU run (or several runs merged with `--merge`);
a new record replaces this file. Each figure was measured by the command named below, on the GPU, date and commit
named below; what each figure is compared with is listed under the tables.

## Method

- **Model**: the real Qwen-Image-Edit architecture at full size with random weights (DiT 20.4 B
  parameters: 60 blocks, dim 3072, 24 heads x 128; Qwen2.5-VL 7B text encoder with its vision tower;
  the Qwen-Image VAE), built on `meta` and materialized on the GPU in seconds: fan-in scaled
  Gaussian weights, norms 1, biases 0, modulation and `norm_out` x0.1. Timings are valid; image
  quality is not measurable this way.
- **Work unit**: a 1024x1024 edit with one reference image: 4096 target + 4096 reference image
  tokens + 300 text tokens through 60 blocks, batch 1 (true CFG: batch 2 or two batch-1 forwards).
- **Time**: CUDA events around each call, median of >= 5 calls after warm-up (the first warm-up call
  includes compilation; it is reported as `first call s`). End to end: host clock with device
  synchronization per stage (`qwen_edit.edit.run_edit`'s `Timings`), one timed run after a 2-step
  warm-up run.
- **Error**: `||out - ref|| / ||ref||` of the whole 60-block forward, computed in float64, against
  reference A (DiffSynth bf16 eager, same weights and inputs) or, for ComfyUI's own model, reference
  B (ComfyUI bf16 eager; ComfyUI's MLP uses tanh-GELU where DiffSynth uses x*sigmoid(1.702x)).
  Single linears: against float64 on the unquantized weights, overall and per row.
- **Memory**: `peak GiB` is the process peak while the variant ran (the bf16 base DiT stays resident
  while fp8 variants are measured); `standalone GiB` = the variant's own weights + its activation
  peak, what it needs alone.
- **Paths** (variant ids `family/variant`): `ds/...` is DiffSynth's `model_fn_qwen_image` (the
  baseline; compiled = `torch.compile` of each block's call); `fast/...` is the pack's own forward
  (`qwen_edit.fast_forward`, what its sampler runs: batched true CFG, the pack's regional compile);
  `comfy/...` is ComfyUI 0.3.75's core `QwenImageTransformer2DModel` on the same tensors;
  `torchao/...` is torchao float8 dynamic row-wise.
- **Ratios**: baseline time / variant time within this record: DiffSynth bf16 eager, ComfyUI 0.3.75
  core bf16 compiled, torchao float8 row-wise compiled. GPUs of one kind differ by several percent
  between machines: compare ratios within one record, not absolute times across records.
  `ds/bf16-eager-repeat` times the baseline again at the end of its run: the difference is that run's
  noise.

## How to update

On the GPU machine run `python3 bench/harness.py ...` (parts and ids: its docstring, `--list`), then,
with the fetched output folders:

    python3 bench/harness.py --merge OUT_DIR_1 OUT_DIR_2 ... --out bench/out/merged --record

which merges the results, prints the table, copies the charts to `docs/performance/<card>/` and
rewrites `docs/performance/<card>.md`.
"""


# ----------------------------------------------------------------------------- environment


def _version(module: str) -> str | None:
    try:
        from importlib import metadata

        return metadata.version(module)
    except Exception:  # any failure just means "unknown"
        return None


def _commit() -> str | None:
    """The checkout's commit (``git rev-parse --short HEAD``), ``+dirty`` with uncommitted changes; None without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def env_info(device: torch.device, command: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    """GPU, versions (torch, CUDA, cuDNN, TE, Triton, diffsynth, torchao, transformers), date and command."""
    load_pack()
    from qwen_edit_hopper.fp8.te_backend import te_version

    info: dict[str, Any] = {
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "args": args or {},
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "transformer_engine": te_version(),
        "triton": None,
        "diffsynth": _version("diffsynth"),
        "torchao": _version("torchao"),
        "transformers": _version("transformers"),
        "device": str(device),
        "gpu": "CPU",
        "commit": _commit(),
    }
    with contextlib.suppress(Exception):  # no Triton: stays None
        info["triton"] = importlib.import_module("triton").__version__
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update({"gpu": torch.cuda.get_device_name(device), "gpu_memory_gib": props.total_memory / 2**30,
                     "compute_capability": f"{props.major}.{props.minor}", "sm_count": props.multi_processor_count})
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
            info["nvidia_smi"] = out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["nvidia_smi"] = None
    return info


# ----------------------------------------------------------------------------- helpers


def _fmt(value: Any, spec: str = ".3g") -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, (int, float)):
        return format(value, spec)
    return str(value)


def _ratio(base: Any, value: Any) -> str:
    if isinstance(base, (int, float)) and isinstance(value, (int, float)) and value > 0:
        return f"{base / value:.2f}"
    return "-"


def _records(store: ResultStore, part: str) -> list[Record]:
    return [r for r in store.records.values() if r.part == part]


def _status_text(record: Record, width: int = 110) -> str:
    text = record.error or "; ".join(n for n in record.notes if n)
    text = text.replace("|", "/").replace("\n", " ")
    return f"{record.status}: {text[:width]}"


def _variant(record: Record) -> str:
    return record.id.split("/", 1)[1]


def _not_ok(record: Record, head: list[str]) -> list[str]:
    """A row for a record that is not ok: dashes, and its status and reason in the last column."""
    return [_variant(record), *["-"] * (len(head) - 2), _status_text(record)]


# ----------------------------------------------------------------------------- tables


def forward_rows(store: ResultStore) -> list[list[str]]:
    base = {name: store.figure(rid, "ms") for name, rid in BASELINES.items()}
    rows = []
    for r in _records(store, "forward"):
        f = r.figures
        if r.status == OK:
            err = f.get("rel_err")
            ref = "B" if r.id.startswith("forward/comfy/") else "A"
            rows.append([_variant(r), _fmt(f.get("ms"), ".1f"), *(_ratio(b, f.get("ms")) for b in base.values()),
                         f"{_fmt(err, '.2e')} vs {ref}", _fmt(f.get("peak_gib"), ".1f"),
                         _fmt(f.get("standalone_peak_gib"), ".1f"), _fmt(f.get("first_call_s"), ".0f"), ""])
        else:
            rows.append(_not_ok(r, FORWARD_HEAD))
    return rows


FORWARD_HEAD = ["variant (1024x1024 edit, batch 1)", "ms", "x vs DS bf16 eager", "x vs Comfy bf16 compiled",
                "x vs torchao compiled", "rel. error", "peak GiB", "standalone GiB", "first call s", "status"]


def cfg_rows(store: ResultStore) -> list[list[str]]:
    rows = []
    for r in _records(store, "cfg"):
        f = r.figures
        if r.status == OK:
            rows.append([_variant(r), _fmt(f.get("step_ms"), ".1f"), _fmt(f.get("forward_ms"), ".1f"),
                         _fmt(f.get("step_per_forward"), ".2f"), _fmt(f.get("speedup_vs_diffsynth_sequential"), ".2f"),
                         _fmt(f.get("rel_err"), ".2e"), _fmt(f.get("batch2_vs_batch1_rel_err"), ".1e"), ""])
        else:
            rows.append(_not_ok(r, CFG_HEAD))
    return rows


CFG_HEAD = ["variant (true CFG step, cfg 4)", "step ms", "1 forward ms", "step / forward", "x vs DS 2 forwards",
            "rel. error vs DS eager CFG", "batch-2 vs batch-1", "status"]


def resolution_rows(store: ResultStore) -> tuple[list[list[str]], list[str]]:
    by_variant: dict[str, dict[str, Record]] = {}
    for r in _records(store, "resolution"):
        variant, _, size = _variant(r).partition("@")
        by_variant.setdefault(variant, {})[size] = r
    sizes = sorted({s for d in by_variant.values() for s in d}, key=lambda s: int(s.split("x")[0]))
    rows = []
    for variant, per in by_variant.items():
        cells = [variant]
        for size in sizes:
            r = per.get(size)
            if r is None:
                cells.append("-")
            elif r.status == OK:
                cells.append(f"{r.figures.get('ms', 0):.1f} ({r.figures.get('tokens', '?')} tok, err "
                             f"{_fmt(r.figures.get('rel_err'), '.1e')})")
            else:
                cells.append(_status_text(r, 60))
        f1024 = store.figure(f"forward/{variant}", "ms")
        cells.append(_fmt(f1024, ".1f"))
        rows.append(cells)
    return rows, sizes


def e2e_rows(store: ResultStore) -> list[list[str]]:
    rows = []
    for r in _records(store, "e2e"):
        f = r.figures
        if r.status == OK:
            rows.append([_variant(r), str(f.get("preset_variant", "")), _fmt(f.get("total_s"), ".2f"),
                         _fmt(f.get("encode_s"), ".2f"), _fmt(f.get("text_encode_s"), ".2f"),
                         _fmt(f.get("denoise_s"), ".2f"), _fmt(f.get("decode_s"), ".2f"),
                         _fmt(f.get("step_median_s"), ".3f"), _fmt(f.get("peak_gib"), ".1f"),
                         _fmt(f.get("speedup_vs_baseline"), ".2f"), _fmt(f.get("first_run_s"), ".0f"), ""])
        else:
            rows.append(_not_ok(r, E2E_HEAD))
    return rows


E2E_HEAD = ["preset", "DiT variant", "total s", "encode s", "of which text encoder s", "denoise s", "VAE decode s",
            "s/step", "peak GiB", "x vs bf16 baseline", "warm-up run s", "status"]


def linear_rows(store: ResultStore) -> list[list[str]]:
    rows = []
    for r in _records(store, "linear"):
        f = r.figures
        if r.status == OK:
            backward = f.get("backward", "")
            bwd = _fmt(f.get("backward_tflops"), ".1f") if backward.startswith("bf16") else backward[:60]
            rows.append([_variant(r), _fmt(f.get("forward_ms"), ".3f"), _fmt(f.get("forward_tflops"), ".1f"),
                         bwd, f"{_fmt(f.get('forward_rel_err'), '.2e')} / "
                              f"{_fmt(f.get('forward_rel_err_row_max'), '.2e')}",
                         _fmt(f.get("forward_mse"), ".2e"),
                         f"{_fmt(f.get('grad_rel_err'), '.2e')}" if "grad_rel_err" in f else "-",
                         _fmt(f.get("weight_mib"), ".1f"), _fmt(f.get("forward_activation_peak_mib"), ".0f"), ""])
        else:
            rows.append(_not_ok(r, LINEAR_HEAD))
    return rows


LINEAR_HEAD = ["shape (MxKxN) / backend-mode", "fwd ms", "fwd TFLOP/s", "bwd (dX) TFLOP/s", "fwd rel. err / worst row",
               "fwd MSE", "dX rel. err", "weight MiB", "fwd act. MiB", "status"]


def linear_summary(store: ResultStore) -> list[list[str]]:
    """Per shape: bf16 eager forward TFLOP/s and the fastest fp8 forward (backend, TFLOP/s, ratio, error)."""
    by_shape: dict[str, list[Record]] = {}
    for r in _records(store, "linear"):
        if r.status == OK:
            by_shape.setdefault(r.id.split("/")[1], []).append(r)
    rows = []
    for shape, recs in by_shape.items():
        bf16 = next((r for r in recs if r.id.endswith("/bf16-eager")), None)
        fp8 = [r for r in recs if not r.id.split("/")[2].startswith("bf16")]
        best = min(fp8, key=lambda r: r.figures.get("forward_ms", float("inf")), default=None)
        b = bf16.figures.get("forward_tflops") if bf16 else None
        rows.append([shape, _fmt(b, ".0f"), best.id.split("/")[2] if best else "-",
                     _fmt(best.figures.get("forward_tflops"), ".0f") if best else "-",
                     _ratio(bf16.figures.get("forward_ms") if bf16 else None,
                            best.figures.get("forward_ms") if best else None),
                     _fmt(best.figures.get("forward_rel_err"), ".1e") if best else "-"])
    return rows


LINEAR_SUMMARY_HEAD = ["shape", "bf16 TFLOP/s", "fastest fp8", "its TFLOP/s", "x vs bf16", "its rel. err"]


def text_table(head: list[str], rows: Iterable[list[str]]) -> str:
    rows = [head, *rows]
    widths = [max(len(str(r[i])) if i < len(r) else 0 for r in rows) for i in range(len(head))]
    widths = [min(w, 60) for w in widths]
    lines = []
    for n, row in enumerate(rows):
        cells = [str(c)[: widths[i]].ljust(widths[i]) for i, c in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(head: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def short_table(store: ResultStore) -> str:
    """The table printed last: ratios per forward, CFG, resolution, e2e and the linear summary."""
    parts = []
    rows = forward_rows(store)
    if rows:
        parts.append("PER DIT FORWARD (ratios = baseline ms / variant ms)\n" + text_table(FORWARD_HEAD, rows))
    rows = cfg_rows(store)
    if rows:
        parts.append("PER TRUE-CFG STEP\n" + text_table(CFG_HEAD, rows))
    rows, sizes = resolution_rows(store)
    if rows:
        head = ["variant", *sizes, "forward part (1024x1024)"]
        parts.append("RESOLUTION (ms per forward)\n" + text_table(head, rows))
    rows = e2e_rows(store)
    if rows:
        parts.append("END TO END (1024x1024 edit, one reference image)\n" + text_table(E2E_HEAD, rows))
    rows = linear_summary(store)
    if rows:
        parts.append("LINEAR LAYERS (forward, eager or compiled, fastest fp8 per shape)\n"
                     + text_table(LINEAR_SUMMARY_HEAD, rows))
    problems = [r for r in store.records.values() if r.status in (ERROR, NOT_RUN, UNAVAILABLE)]
    if problems:
        parts.append("NOT OK (same reason grouped)\n" + "\n".join(not_ok_lines(problems)))
    return "\n\n".join(parts)


def not_ok_lines(records: list[Record], width: int = 170) -> list[str]:
    """One line per (status, reason): the reason, then the ids (the first few when many)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for r in records:
        reason = re.sub(r"\b\d+x\d+x\d+\b", "<shape>", r.error or "")
        groups.setdefault((r.status, reason[:width]), []).append(r.id)
    lines = []
    for (status, reason), ids in groups.items():
        shown = ", ".join(ids[:4]) + (f" and {len(ids) - 4} more" if len(ids) > 4 else "")
        lines.append(f"  {status}: {reason}\n      {shown}")
    return lines


# ----------------------------------------------------------------------------- markdown record


def markdown_section(store: ResultStore, charts: dict[str, str] | None = None, title: str | None = None) -> str:
    """The record's section (docs/performance/<card>.md): environment, commit, command(s), every figure with what
    it is compared with."""
    runs = store.runs
    env = runs[-1] if runs else {}
    when = env.get("started", datetime.now(timezone.utc).isoformat(timespec="seconds"))
    lines = [f"## {title or (str(env.get('gpu', '?')) + ', ' + when[:10])}", ""]
    lines.append(f"- Commit: {env.get('commit') or 'unknown'}")
    lines.append(f"- GPU: {env.get('gpu', '?')} ({_fmt(env.get('gpu_memory_gib'), '.0f')} GiB, compute capability "
                 f"{env.get('compute_capability', '?')}, {env.get('sm_count', '?')} SMs; nvidia-smi "
                 f"{env.get('nvidia_smi') or '-'})")
    lines.append(f"- Software: torch {env.get('torch')}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, Transformer "
                 f"Engine {env.get('transformer_engine') or 'not installed'}, Triton {env.get('triton')}, diffsynth "
                 f"{env.get('diffsynth')}, torchao {env.get('torchao') or 'not installed'}, transformers "
                 f"{env.get('transformers')}, Python {env.get('python')}")
    for run in runs:
        lines.append(f"- Run {run.get('started', '?')}: `{run.get('command', '?')}`")
    lines.append("")
    rows = forward_rows(store)
    if rows:
        lines += ["### Per DiT forward", "",
                  "1024x1024 edit, one reference image (8192 image + 300 text tokens), batch 1. Ratios: baseline ms / "
                  "variant ms. Error: whole-forward relative error vs reference A (DiffSynth bf16 eager) or B "
                  "(ComfyUI bf16 eager).", "", markdown_table(FORWARD_HEAD, rows), ""]
        comfy = store.figure("forward/comfy/bf16-eager", "rel_err_vs_reference_A")
        if comfy is not None:
            lines += [f"Reference B vs reference A (same weights; ComfyUI's tanh-GELU vs DiffSynth's sigmoid GELU): "
                      f"{comfy:.2e}.", ""]
        spread = store.figure("forward/ds/bf16-eager-repeat", "spread_vs_first")
        if spread is not None:
            lines += [f"Noise: DiffSynth bf16 eager timed again at the end of its run differed by {spread:+.1%}.", ""]
    rows = cfg_rows(store)
    if rows:
        lines += ["### Per true-CFG step", "",
                  "One denoising step with true CFG 4: DiffSynth (and the pack's default sampler) runs two batch-1 "
                  "forwards; the fast path runs cond and uncond as one batch-2 forward. step / forward: the step's "
                  "time over one batch-1 forward of the same path (target <= 1.9 for batch 2).", "",
                  markdown_table(CFG_HEAD, rows), ""]
    rows, sizes = resolution_rows(store)
    if rows:
        lines += ["### Resolution", "", "ms per forward (tokens incl. 300 text; error vs DiffSynth bf16 eager at the "
                  "same size).", "", markdown_table(["variant", *sizes, "forward part (1024x1024)"], rows), ""]
    rows = e2e_rows(store)
    if rows:
        lines += ["### End to end", "",
                  "`qwen_edit.edit.run_edit` with a `PlanRuntime` holding the full-size random-weight DiT, text "
                  "encoder and VAE: 1024x1024 edit, one reference image, EDIT_2509 prompt template. Baseline: bf16 "
                  "eager, 40 steps, true CFG 4. Encode = prompt (text encoder with vision tower, cond + uncond) + VAE "
                  "encode of the reference. Peak GiB is the process's, not the preset's: the harness keeps the bf16 "
                  "base DiT (about 38.5 GiB at full size) resident beside an fp8 variant, to build variants from it; "
                  "the DiT's own memory per preset is in the forward table's standalone column.", "",
                  markdown_table(E2E_HEAD, rows), ""]
    rows = linear_rows(store)
    if rows:
        lines += ["### Linear layers", "",
                  "Single linears at Qwen-Image-Edit shapes, forward and input gradient (bf16 gradients through the "
                  "fp8 forward where the backend has autograd). Accuracy vs float64 on the unquantized weights.", "",
                  markdown_table(LINEAR_SUMMARY_HEAD, linear_summary(store)), "", markdown_table(LINEAR_HEAD, rows), ""]
    for name, path in (charts or {}).items():
        lines += [f"![{name}]({path})", ""]
    seen, unique = set(), []
    for r in store.records.values():
        key = (r.part, r.compared_with)
        if r.status == OK and r.compared_with and key not in seen:
            seen.add(key)
            unique.append(f"- {r.part}: {r.compared_with}")
    if unique:
        lines += ["What each figure is compared with:", "", *unique, ""]
    return "\n".join(lines).rstrip() + "\n"


def write_record(section: str, card: str, folder: Path = PERFORMANCE_DIR) -> Path:
    """Write ``<folder>/<card>.md``: the method header and ``section`` (the current record replaces the last)."""
    path = Path(folder) / f"{card}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(RECORD_HEADER.format(card=card) + "\n" + section)
    return path


def record_run(store: ResultStore, out: Path, charts: dict[str, str], folder: Path = PERFORMANCE_DIR) -> Path:
    """Copy the charts to ``<folder>/<card>/`` and rewrite ``<folder>/<card>.md`` with this run's section."""
    import shutil

    env = store.runs[-1] if store.runs else {}
    card = card_name(str(env.get("gpu", "CPU")))
    linked = {}
    for name, file in charts.items():
        (Path(folder) / card).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(out) / file, Path(folder) / card / name)
        linked[name] = f"{card}/{name}"
    return write_record(markdown_section(store, linked), card, folder)


# ----------------------------------------------------------------------------- forward chart


def draw_forward_chart(store: ResultStore, path: Path, title: str = "") -> bool:
    """PNG: ms per forward of every ok forward variant, with x vs DiffSynth bf16 eager."""
    records = [r for r in _records(store, "forward") if r.status == OK and "ms" in r.figures]
    if not records:
        return False
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    base = store.figure(BASELINES["DiffSynth bf16 eager"], "ms")
    figure = Figure(figsize=(11, 0.38 * len(records) + 1.5), dpi=100)
    ax = figure.subplots()
    labels = [_variant(r) for r in records]
    values = [r.figures["ms"] for r in records]
    colors = ["#999999" if r.id.split("/")[1] in ("comfy", "torchao") else "#4c72b0" for r in records]
    bars = ax.barh(range(len(records)), values, color=colors)
    ax.set_yticks(range(len(records)), labels=labels, fontsize=8)
    ax.invert_yaxis()
    for bar, value in zip(bars, values, strict=True):
        text = f" {value:.0f} ms" + (f"  {base / value:.2f}x" if base else "")
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, text, va="center", fontsize=8)
    ax.set_xlim(0, max(values) * 1.3)
    ax.set_xlabel("ms per DiT forward, 1024x1024 edit (lower is better; grey: anchors)")
    ax.set_title(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path)
    return True


if __name__ == "__main__":
    sys.exit(main())
