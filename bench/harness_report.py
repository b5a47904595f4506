"""Tables, the markdown record (docs/benchmarks.md), charts and the environment of a benchmark run.

Ratios are ``baseline ms / variant ms`` (above 1 = faster than the baseline). Baselines, all at
1024x1024 with one reference image, batch 1, measured in the same store (this run, or merged runs):
DiffSynth bf16 eager (``forward/ds/bf16-eager``), ComfyUI core bf16 compiled
(``forward/comfy/bf16-compiled``) and torchao float8 row-wise compiled
(``forward/torchao/fp8-rowwise-compiled``).
"""

from __future__ import annotations

import contextlib
import importlib
import platform
import re
import subprocess
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from harness_core import ERROR, NOT_RUN, OK, ROOT, UNAVAILABLE, Record, ResultStore, load_pack

RECORD_PATH = ROOT / "docs" / "benchmarks.md"
BASELINES = {
    "DiffSynth bf16 eager": "forward/ds/bf16-eager",
    "ComfyUI bf16 compiled": "forward/comfy/bf16-compiled",
    "torchao fp8 compiled": "forward/torchao/fp8-rowwise-compiled",
}

RECORD_HEADER = """# Benchmark record

Every section below was appended by `bench/harness.py` (one GPU run, or several runs merged with
`--merge`). Nothing here is cited: each figure was measured by the command its section names.

## Method

- **Model**: the real Qwen-Image-Edit architecture at full size with random weights (DiT 20.4 B
  parameters: 60 blocks, dim 3072, 24 heads x 128; Qwen2.5-VL 7B text encoder with its vision tower;
  the Qwen-Image VAE), built on `meta` and materialized on the GPU in seconds: fan-in scaled
  Gaussian weights, norms 1, biases 0, modulation and `norm_out` x0.1. Timings are valid; image
  quality is not measurable this way.
- **Work unit**: a 1024x1024 edit with one reference image: 4096 target + 4096 reference image
  tokens + 300 text tokens through 60 blocks, batch 1 (true CFG: batch 2 or two batch-1 forwards).
- **Time**: CUDA events around each call, median of >= 5 calls after warm-up (the first warm-up call
  includes compilation; it is reported as `first_call_s`). End to end: host clock with device
  synchronization per stage (`qwen_edit.edit.run_edit`'s `Timings`), one timed run after a 2-step
  warm-up run.
- **Error**: `||out - ref|| / ||ref||` of the whole 60-block forward, computed in float64, against
  reference A (DiffSynth bf16 eager, same weights and inputs) or, for ComfyUI's own model, reference
  B (ComfyUI bf16 eager; ComfyUI's MLP uses tanh-GELU where DiffSynth uses x*sigmoid(1.702x), so A
  and B differ slightly, shown as `rel_err_vs_reference_A`). Single linears: against float64 on the
  unquantized weights, overall and per row.
- **Memory**: `peak_gib` is the process peak while the variant ran (the bf16 base DiT stays resident
  while fp8 variants are measured); `standalone_peak_gib` = the variant's own weights + its
  activation peak, what it needs alone.
- **Paths** (variant ids `family/variant`): `ds/...` is DiffSynth's `model_fn_qwen_image` (the
  baseline; with the pack's fp8 linears for comparison; compiled = `torch.compile` of each block's
  call, as the anchors did); `fast/...` is the pack's own forward (`qwen_edit.fast_forward`, what its
  sampler runs: batched true CFG, the pack's regional compile); `comfy/...` is ComfyUI 0.3.75's core
  `QwenImageTransformer2DModel` on the same tensors; `torchao/...` is torchao float8 dynamic row-wise.
- **Ratios**: baseline time / variant time within the same record set: DiffSynth bf16 eager,
  ComfyUI 0.3.75 core bf16 compiled, torchao float8 row-wise compiled. GPUs of one kind differed by
  ~15% between machines (shared/docs/anchors.md): compare ratios within one section, not absolute
  times across sections. `forward/ds/bf16-eager-repeat` times the baseline again at the end of its
  run: the difference is that run's noise.

## How to add a run

On the device machine run `python3 bench/harness.py ...` (parts and ids: its docstring, `--list`),
then here, with the fetched output folders:

    python3 bench/harness.py --merge OUT_DIR_1 OUT_DIR_2 ... --out bench/out/merged --record

which merges the results, prints the table, copies the charts to `docs/benchmarks/<date>-<gpu>/`
and appends one section below.
"""


# ----------------------------------------------------------------------------- environment


def _version(module: str) -> str | None:
    try:
        from importlib import metadata

        return metadata.version(module)
    except Exception:  # any failure just means "unknown"
        return None


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
    """One section for docs/benchmarks.md: environment, command(s), every figure with what it is compared with."""
    runs = store.runs
    env = runs[-1] if runs else {}
    when = env.get("started", datetime.now(timezone.utc).isoformat(timespec="seconds"))
    lines = [f"## {title or (str(env.get('gpu', '?')) + ', ' + when[:10])}", ""]
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


def append_record(section: str, path: Path = RECORD_PATH) -> Path:
    """Append ``section`` to the benchmark record, creating it with the method header when missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or not path.read_text().strip():
        path.write_text(RECORD_HEADER)
    with path.open("a") as fh:
        fh.write("\n" + section)
    return path


def record_run(store: ResultStore, out: Path, charts: dict[str, str], path: Path = RECORD_PATH) -> Path:
    """Copy the charts next to the record (``docs/benchmarks/<date>-<gpu>/``) and append the section
    referencing them there."""
    import re
    import shutil

    env = store.runs[-1] if store.runs else {}
    stamp = re.sub(r"[^A-Za-z0-9]+", "-", f"{env.get('started', '')[:16]}-{env.get('gpu', 'cpu')}").strip("-")
    folder = Path(path).parent / "benchmarks" / stamp
    linked = {}
    for name, file in charts.items():
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(out) / file, folder / name)
        linked[name] = f"benchmarks/{stamp}/{name}"
    return append_record(markdown_section(store, linked), path)


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
