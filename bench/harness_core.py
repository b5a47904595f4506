"""Shared pieces of the benchmark harness: selection, budget, timing, memory, results store, guarded runs.

Nothing here builds a model. Every measurement has an id ``<part>/<family>/<variant>[@size]``
(``forward/ds/fp8-rowwise-compiled``, ``resolution/ds/bf16-compiled@1328``, ``linear/8192x3072x3072/bf16-eager``)
and ends as one record in ``results.json``: status ``ok`` (with figures), ``error`` (with the
exception text), ``not run`` (with the reason: budget, --no-compile, ...) or ``unavailable``. The
store is rewritten atomically after every record, so a run killed at its time limit still leaves
everything measured so far.
"""

from __future__ import annotations

import contextlib
import fnmatch
import gc
import json
import logging
import math
import os
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("forward", "cfg", "resolution", "e2e", "linear")
"""Parts in the order one run executes them (linear last, after every model is freed: a time budget that
runs out then costs the least important part)."""

OK, ERROR, NOT_RUN, UNAVAILABLE = "ok", "error", "not run", "unavailable"
SCHEMA = 1
GIB = 2**30

logger = logging.getLogger("bench")


def load_pack():
    """Import this checkout as ``qwen_edit_hopper`` (scripts/pack.py) and return the package."""
    scripts = str(ROOT / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    from pack import load_pack as _load

    return _load()


def card_name(gpu: str) -> str:
    """The GPU kind a record file is named after: ``"NVIDIA H200"`` -> ``"H200"``, ``"NVIDIA H100 80GB HBM3"`` ->
    ``"H100"``; other names are reduced to letters, digits and dashes."""
    match = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Za-z]?)\b", gpu.replace("NVIDIA", ""))
    if match:
        return match.group(1)
    return re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-") or "unknown"


def log(*parts: object) -> None:
    """Progress line on stdout (flushed: the device tool returns the tail of the output)."""
    print(*parts, flush=True)


# ----------------------------------------------------------------------------- selection


def parse_parts(text: str) -> tuple[str, ...]:
    """``"forward,cfg"`` / ``"all"`` -> parts in execution order. Raises ValueError naming the allowed parts."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names or "all" in names:
        return PARTS
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; allowed: {', '.join(PARTS)}, all")
    return tuple(p for p in PARTS if p in names)


@dataclass(frozen=True)
class Selection:
    """Which measurements run: the parts, and ``--only`` patterns (comma separated).

    A pattern with a wildcard (``*?[``) is an fnmatch pattern matched against the full id and against
    the id without its part (``ds/*`` selects ``forward/ds/bf16-eager`` and ``cfg/ds/bf16-compiled``);
    a pattern without one is a substring of the full id. No pattern: everything in the parts.
    """

    parts: tuple[str, ...] = PARTS
    only: tuple[str, ...] = ()

    @classmethod
    def parse(cls, parts: str = "all", only: str | None = None) -> Selection:
        patterns = tuple(p.strip() for p in (only or "").split(",") if p.strip())
        return cls(parse_parts(parts), patterns)

    def wants(self, measurement_id: str) -> bool:
        part, _, rest = measurement_id.partition("/")
        if part not in self.parts:
            return False
        if not self.only:
            return True
        for pattern in self.only:
            if any(ch in pattern for ch in "*?["):
                if fnmatch.fnmatchcase(measurement_id, pattern) or fnmatch.fnmatchcase(rest, pattern):
                    return True
            elif pattern in measurement_id:
                return True
        return False


class Budget:
    """Wall-clock budget of one run: a measurement whose estimated cost no longer fits is not started.

    ``limit_s <= 0`` means no limit. The device tool kills a command at 600 s; 540 leaves time for
    the last save and the table.
    """

    def __init__(self, limit_s: float, clock: Callable[[], float] = time.monotonic):
        self.limit_s = float(limit_s)
        self.clock = clock
        self.start = clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def allows(self, estimate_s: float) -> bool:
        return self.limit_s <= 0 or self.elapsed() + estimate_s <= self.limit_s

    def reason(self, estimate_s: float) -> str:
        return (f"time budget: {self.elapsed():.0f} s used of --budget-s {self.limit_s:.0f}, this needs about "
                f"{estimate_s:.0f} s; rerun it with --only")


# ----------------------------------------------------------------------------- timing and memory


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], Any], device: torch.device, *, warmup: int = 2, reps: int = 7) -> dict[str, Any]:
    """Median time of ``fn`` after ``warmup`` untimed calls (CUDA events on a GPU, host clock on CPU).

    Returns ``{"ms", "min_ms", "max_ms", "reps", "first_call_s"}``; ``first_call_s`` is the first warm-up
    call on the host clock, synchronized (it includes any compile).
    """
    if reps < 1:
        raise ValueError("reps must be >= 1")
    first = None
    for _ in range(max(warmup, 0)):
        started = time.perf_counter()
        fn()
        synchronize(device)
        if first is None:
            first = time.perf_counter() - started
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
    return {"ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "reps": reps,
            "first_call_s": first}


def capture_cuda_graph(fn: Callable[[], Any], warmups: int = 2) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``fn`` captured in one CUDA graph after ``warmups`` calls on a side stream: (graph, fn's output inside it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_ms_per_call(step: Callable[[int], Any], calls: int, reps: int = 7) -> float:
    """Median ms per call of ``step(i)`` for i in 0..calls-1, captured as one CUDA graph (after one warm-up pass
    on a side stream) and replayed ``reps`` times: kernel time without the host's launch cost."""
    graph, _ = capture_cuda_graph(lambda: [step(i) for i in range(calls)], warmups=1)
    ms = time_calls(graph.replay, torch.device("cuda"), warmup=2, reps=reps)["ms"] / calls
    del graph
    return ms


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def memory_now(device: torch.device) -> tuple[int, int]:
    """(allocated, reserved) bytes on a CUDA device; (RSS, RSS) of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
                return rss, rss
    except OSError:
        pass
    return 0, 0


@dataclass
class PeakProbe:
    """Peak memory of a region: ``with PeakProbe(device) as probe: ...``; then ``probe.figures()``.

    ``peak_gib``: the process's peak allocated bytes in the region (every model alive counts);
    ``activation_peak_gib``: that peak minus what was allocated when the region began (activations,
    workspaces, compile buffers).
    """

    device: torch.device
    before: int = 0
    peak: int = 0

    def __enter__(self) -> PeakProbe:
        free_memory()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.before = memory_now(self.device)[0]
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self.peak = max(self.before, memory_now(self.device)[0])

    def figures(self) -> dict[str, float]:
        return {"peak_gib": self.peak / GIB, "activation_peak_gib": max(0, self.peak - self.before) / GIB}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN when ``out`` holds a NaN or inf (never passes a check)."""
    out64, ref64 = out.detach().to(torch.float64), ref.detach().to(torch.float64)
    if not bool(torch.isfinite(out64).all()):
        return float("nan")
    den = torch.linalg.vector_norm(ref64).item()
    num = torch.linalg.vector_norm(out64 - ref64).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def tensor_gib(module: torch.nn.Module) -> float:
    """GiB held by a module's parameters and buffers (shared storages once; TE fp8 tensors by their data)."""
    load_pack()
    from qwen_edit_hopper.fp8.swap import module_bytes

    return module_bytes(module) / GIB


# ----------------------------------------------------------------------------- results


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _plain(value: Any) -> Any:
    """JSON-safe copy: NaN/inf become strings, tuples lists, unknown objects their str()."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


@dataclass
class Record:
    """One measurement's outcome. ``figures`` holds numbers (ms, GiB, errors, ratios); ``compared_with``
    says what its error and ratios are relative to."""

    id: str
    status: str
    figures: dict[str, Any] = field(default_factory=dict)
    compared_with: str = ""
    error: str = ""
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    when: str = field(default_factory=_now)

    @property
    def part(self) -> str:
        return self.id.split("/", 1)[0]

    def to_json(self) -> dict[str, Any]:
        return _plain({"id": self.id, "status": self.status, "figures": self.figures,
                       "compared_with": self.compared_with, "error": self.error, "notes": self.notes,
                       "wall_s": self.wall_s, "when": self.when})

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Record:
        figures = {k: (float(v) if v in ("nan", "inf", "-inf") else v) for k, v in data.get("figures", {}).items()}
        return cls(id=data["id"], status=data["status"], figures=figures, compared_with=data.get("compared_with", ""),
                   error=data.get("error", ""), notes=list(data.get("notes", [])), wall_s=data.get("wall_s", 0.0),
                   when=data.get("when", ""))


class ResultStore:
    """``results.json`` of one output folder: runs (environment, command) and records by id.

    Resume-safe: opening a folder that already has a results.json keeps its records; ``has_ok(id)``
    lets a rerun skip what already succeeded. Every ``put`` rewrites the file atomically.
    """

    def __init__(self, out_dir: Path | None, run_info: dict[str, Any] | None = None):
        """``out_dir``: the output folder (its ``results.json``), a ``.json`` file of results, or None (memory)."""
        if out_dir is None:
            self.path = None
        else:
            self.path = Path(out_dir) if str(out_dir).endswith(".json") else Path(out_dir) / "results.json"
        self.runs: list[dict[str, Any]] = []
        self.records: dict[str, Record] = {}
        self.fallback: ResultStore | None = None
        if self.path is not None and self.path.is_file():
            data = json.loads(self.path.read_text())
            self.runs = list(data.get("runs", []))
            self.records = {r["id"]: Record.from_json(r) for r in data.get("results", [])}
        if run_info is not None:
            self.runs.append(_plain(run_info))
            self.save()

    def has_ok(self, measurement_id: str) -> bool:
        record = self.records.get(measurement_id)
        return record is not None and record.status == OK

    def get(self, measurement_id: str) -> Record | None:
        return self.records.get(measurement_id)

    def put(self, record: Record) -> Record:
        self.records[record.id] = record
        self.save()
        return record

    def figure(self, measurement_id: str, name: str) -> Any:
        """A figure of an ok record; else the same from ``fallback`` (results of earlier runs, ``--prior``)."""
        record = self.records.get(measurement_id)
        if record is None or record.status != OK:
            return None if self.fallback is None else self.fallback.figure(measurement_id, name)
        return record.figures.get(name)

    def merge(self, other: ResultStore) -> None:
        """Take ``other``'s runs, and its records where ours is missing or not ok (a later ok wins)."""
        self.runs.extend(other.runs)
        for rid, record in other.records.items():
            mine = self.records.get(rid)
            if mine is None or mine.status != OK or record.status == OK:
                self.records[rid] = record

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "runs": self.runs, "results": [r.to_json() for r in self.records.values()]}

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        os.replace(tmp, self.path)


def load_results(items: list[str] | list[Path]) -> ResultStore:
    """Results of earlier runs merged into one in-memory store: each item is a results ``.json`` file or a
    folder (its ``results.json``, else every ``*.json`` in it). Raises FileNotFoundError naming what is missing."""
    merged = ResultStore(None)
    for item in items:
        path = Path(item)
        if path.is_dir():
            files = [path / "results.json"] if (path / "results.json").is_file() else sorted(path.glob("*.json"))
        else:
            files = [path]
        if not files or not all(f.is_file() for f in files):
            raise FileNotFoundError(f"no results json at {path}")
        for file in files:
            merged.merge(ResultStore(file))
    return merged


def error_text(exc: BaseException, limit: int = 600) -> str:
    """``Type: message`` on one line, cut to ``limit`` characters."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " | ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Runner:
    """Runs measurements: skips unselected ids, keeps earlier ok records, respects the budget, and turns
    every exception into an ``error`` record (the run goes on)."""

    def __init__(self, store: ResultStore, selection: Selection, budget: Budget, *, redo: bool = False):
        self.store = store
        self.selection = selection
        self.budget = budget
        self.redo = redo
        self.recorded: set[str] = set()

    def wants(self, measurement_id: str) -> bool:
        """Selected, and not already ok in the store (unless --redo)."""
        return self.selection.wants(measurement_id) and (self.redo or not self.store.has_ok(measurement_id))

    def record(self, record: Record) -> Record:
        self.store.put(record)
        self.recorded.add(record.id)
        figures = ", ".join(f"{k}={_short(v)}" for k, v in list(record.figures.items())[:6])
        detail = figures if record.status == OK else (record.error or "; ".join(record.notes))
        log(f"[{self.budget.elapsed():6.0f}s] {record.id:58s} {record.status:11s} {detail[:220]}")
        return record

    def skip(self, measurement_id: str, status: str, reason: str) -> Record:
        return self.record(Record(measurement_id, status, error=reason))

    def run(self, measurement_id: str, fn: Callable[[], dict[str, Any]], *, estimate_s: float = 30.0,
            compared_with: str = "", notes: list[str] | None = None) -> Record | None:
        """Run ``fn`` (returns figures) as measurement ``measurement_id``; None when it is not selected."""
        if not self.wants(measurement_id):
            return None
        if not self.budget.allows(estimate_s):
            return self.skip(measurement_id, NOT_RUN, self.budget.reason(estimate_s))
        started = time.monotonic()
        try:
            figures = fn()
            record = Record(measurement_id, OK, figures, compared_with, notes=list(notes or []))
            bad = [k for k, v in figures.items() if isinstance(v, float) and math.isnan(v)]
            if bad:
                record.status, record.error = ERROR, f"non-finite result in {', '.join(bad)} (NaN never passes)"
        except Exception as exc:  # one failing variant must not end the run: its error is the result
            record = Record(measurement_id, ERROR, compared_with=compared_with, error=error_text(exc),
                            notes=[*(notes or []), traceback.format_exc(limit=6)[-1500:]])
            traceback.clear_frames(exc.__traceback__)
            del exc
            free_memory()
        record.wall_s = time.monotonic() - started
        return self.record(record)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)[:40]


@contextlib.contextmanager
def guarded(runner: Runner, ids: list[str], what: str) -> Iterator[list[str]]:
    """Setup shared by several measurements (building a model): if it raises, each selected id gets an
    ``error`` record naming ``what`` failed, and the block is left. Yields the ids still wanted."""
    wanted = [i for i in ids if runner.wants(i)]
    try:
        yield wanted
    except Exception as exc:  # a failed build is the result of every measurement that needed it
        text = f"{what} failed: {error_text(exc)}"
        tb = traceback.format_exc(limit=6)[-1500:]
        traceback.clear_frames(exc.__traceback__)
        del exc
        for measurement_id in wanted:
            if measurement_id not in runner.recorded:
                runner.record(Record(measurement_id, ERROR, error=text, notes=[tb]))
        free_memory()
