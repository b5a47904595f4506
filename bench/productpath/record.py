"""Summaries, tables, the targets and the benchmark record written from bench/product_path.py's results."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

from harness_core import card_name

from .plans import MODEL_PATH

ROOT = Path(__file__).resolve().parents[2]
PERFORMANCE_DIR = ROOT / "docs" / "performance"
RESULTS_DIR = PERFORMANCE_DIR / "results"
"""Where the results.json files behind the product path records are kept (one per run, named CARD-DATE-PLAN-COMMIT)."""


def _num(value: Any, digits: int = 2) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return f"{value:.{digits}f}" if isinstance(value, float) else str(value)
    return str(value)


def _shown_arg(arg: str) -> str:
    """A server argument as the table shows it: paths by their last part (``.../extra_model_paths.yaml``)."""
    return f".../{Path(arg).name}" if arg.startswith("/") else arg


def torch_memory(system_stats: dict[str, Any]) -> dict[str, float] | None:
    """PyTorch's memory on the server's first CUDA device from ComfyUI's ``/system_stats`` (its ``torch_vram_total``
    is what the allocator reserved, ``torch_vram_free`` the reserved part no tensor uses): ``allocated_MiB`` (live
    tensors) and ``reserved_MiB``; None without a CUDA device."""
    for device in system_stats.get("devices", []):
        if device.get("type") == "cuda":
            reserved, unused = device["torch_vram_total"], device["torch_vram_free"]
            return {"allocated_MiB": round((reserved - unused) / 2**20, 1), "reserved_MiB": round(reserved / 2**20, 1)}
    return None


def _settled_note(job: dict[str, Any]) -> str:
    """A ``free`` row's note: whether the server's allocation had stopped falling when it was read."""
    settled = job.get("torch_settled")
    if settled is None:
        return " "
    return " unload done (allocation steady) " if settled else " allocation still falling when read "


def _gib(mib: float | None) -> float | None:
    return None if mib is None else round(mib / 1024, 2)


def _growth(first: float | None, last: float | None) -> float | None:
    if first is None or last is None or first == 0:
        return None
    return round(100.0 * (last - first) / first, 2)


def _first_prompt(server: dict[str, Any]) -> dict[str, Any] | None:
    """A server's first job that ran and is not a ``free`` request: the prompt of its first image."""
    return next((j for j in server["jobs"] if "skipped" not in j and not j["job"].startswith("free")), None)


def first_image_parts(server: dict[str, Any]) -> str | None:
    """Where a server's first pack prompt spent its time, from the Sampler's report and the server log: the nodes
    before the Sampler, the Sampler's set-up and the encoding (each model's load; how long it waited for a DiT built
    beside the encoding), the first step, the other steps; None when the report lacks the figures."""
    first = _first_prompt(server)
    if first is None or not first.get("ok"):
        return None
    st = first.get("stages") or {}
    if not all(key in st for key in ("node_s", "total_s", "encode_s", "denoise_s", "first_step_s")):
        return None
    before = (first.get("around_sampler") or {}).get("before_s")
    loads = ", ".join(f"{kind} {seconds:.2f} s" for kind, seconds in (st.get("loads_s") or {}).items())
    waited = f"; waited {st['dit_waited_s']:.2f} s for the DiT built beside it" if "dit_waited_s" in st else ""
    parts = [] if before is None else [f"before the Sampler {before:.2f} s"]
    parts += [f"the Sampler's set-up and encoding {st['node_s'] - st['total_s'] + st['encode_s']:.2f} s"
              + (f" ({loads}{waited})" if loads or waited else ""),
              f"first step {st['first_step_s']:.2f} s",
              f"the other steps {st['denoise_s'] - st['first_step_s']:.2f} s"]
    return "where it went: " + ", ".join(parts)


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Figures across jobs: first images per server, repeated series, LoRA changes."""
    summary: dict[str, Any] = {"servers": [], "series": [], "lora_changes": []}
    for server in results["servers"]:
        jobs = [j for j in server["jobs"] if "skipped" not in j]
        first = _first_prompt(server)
        entry = {"label": server["label"], "caches": server["caches"], "start_s": server.get("start_s"),
                 "idle_anon_GiB": (server.get("idle") or {}).get("anon_GiB"),
                 "idle_gpu_GiB": _gib((server.get("idle") or {}).get("gpu_MiB")),
                 "jobs_ok": sum(1 for j in jobs if j.get("ok")), "jobs_failed": sum(1 for j in jobs if not j.get("ok")),
                 "jobs_skipped": len(server["jobs"]) - len(jobs), "restarts": len(server.get("restarts", [])),
                 "alive_at_end": server.get("alive_at_end")}
        if first is not None and first.get("ok") and server.get("start_s") is not None:
            entry["first_job"] = first["job"]
            entry["first_image_s"] = round(server["start_s"] + first["queue_to_image_s"], 2)
        peaks = [(j.get("host") or {}).get("peak_GiB") for j in jobs]
        peaks = [p for p in peaks if p is not None]
        if peaks and entry["idle_anon_GiB"] is not None:
            entry["anon_peak_above_idle_GiB"] = round(max(peaks) - entry["idle_anon_GiB"], 2)
        summary["servers"].append(entry)
        series: dict[str, list[dict[str, Any]]] = {}
        for job in server["jobs"]:
            series.setdefault(job["series"], []).append(job)
        for name, members in series.items():
            ran = [j for j in members if "skipped" not in j]
            if len(members) < 2 or name.startswith("free") or not ran:
                continue
            walls = [j["queue_to_image_s"] for j in ran if j.get("ok")]
            steps = [j["stages"].get("s_per_step") or (j.get("log") or {}).get("s_per_step")
                     for j in ran if j.get("ok")]
            steps = [s for s in steps if s]
            held = [(j.get("gpu") or {}).get("held_MiB") for j in ran]
            anon = [(j.get("host") or {}).get("after_GiB") for j in ran]
            summary["series"].append({
                "server": server["label"], "series": name, "planned": len(members), "ran": len(ran),
                "ok": len(walls), "failed": len(ran) - len(walls), "skipped": len(members) - len(ran),
                "wall_median_s": round(statistics.median(walls), 3) if walls else None,
                "wall_min_s": min(walls) if walls else None, "wall_max_s": max(walls) if walls else None,
                "s_per_step_median": round(statistics.median(steps), 4) if steps else None,
                "gpu_held_first_GiB": _gib(held[0]), "gpu_held_last_GiB": _gib(held[-1]),
                "gpu_held_growth_pct": _growth(held[0], held[-1]),
                "gpu_peak_max_GiB": _gib(max((p for j in ran if (p := (j.get("gpu") or {}).get("peak_MiB"))),
                                             default=None)),
                "anon_after_first_GiB": anon[0], "anon_after_last_GiB": anon[-1],
                "anon_growth_pct": _growth(anon[0], anon[-1]),
                "survived_all": all(j.get("survived") for j in ran if not j.get("unfinished")),
            })
        for _, job in _lora_changes(jobs):
            summary["lora_changes"].append({
                "server": server["label"], "job": job["job"], "ok": job.get("ok"),
                "queue_to_image_s": job.get("queue_to_image_s"),
                "graphs_compiled": job["stages"].get("graphs_compiled"),
                "first_step_s": job["stages"].get("first_step_s")})
    return summary


def one_line(job: dict[str, Any]) -> str:
    """A job's main figures on one line (progress output)."""
    stages, gpu, host = job.get("stages", {}), job.get("gpu", {}), job.get("host", {})
    parts = [f"ok={job.get('ok')}", f"queue->image {job.get('queue_to_image_s', job.get('poll_wall_s'))} s"]
    for key in ("encode_s", "denoise_s", "s_per_step", "decode_s", "first_step_s", "graphs_compiled"):
        if key in stages:
            parts.append(f"{key} {stages[key]}")
    if (job.get("log") or {}).get("s_per_step") and "s_per_step" not in stages:
        parts.append(f"log s/step {job['log']['s_per_step']}")
    if gpu:
        parts.append(f"GPU peak/held {_gib(gpu.get('peak_MiB'))}/{_gib(gpu.get('held_MiB'))} GiB")
    if host:
        parts.append(f"anon peak/after {host.get('peak_GiB')}/{host.get('after_GiB')} GiB")
    parts.append(f"survived={job.get('survived')}")
    return ", ".join(parts)


def textwrap_error(job: dict[str, Any]) -> str:
    return f"  error: {job.get('error')}\n{job.get('traceback') or job.get('log_tail', '')[-1500:]}"


def markdown(results: dict[str, Any], heading: str = "###") -> str:
    """The run as markdown: what ran where, one row per job, the summary."""
    c = results.get("card") or {}
    where = f"{c['name']} ({c['memory']}, driver {c['driver']})" if c else results.get("device", "")
    lines = [f"{heading} {results['plan']}: {results.get('description', '')}", "",
             f"- card: {where}; "
             f"date {results['date']}; commit {results['commit']}; ComfyUI {results['comfyui_version']}; "
             f"{results['sizes']} sizes; files: {results['files']['dit']}, {results['files']['text_encoder']}, "
             f"{results['files']['vae']}"]
    if results.get("note"):
        lines.append(f"- note: {results['note']}")
    written = results.get("written")
    if written:
        lines.append(f"- files written in {written.get('seconds')} s ({written.get('bytes', 0) / 1e9:.1f} GB, "
                     f"drawn on {written.get('device')})")
    lines.append("- every server: `python main.py --listen 127.0.0.1 --port P --base-directory B "
                 "--disable-auto-launch --disable-api-nodes --database-url sqlite:///:memory:` plus the arguments "
                 "below (the models through extra_model_paths.yaml, an empty --front-end-root); the rest is "
                 "ComfyUI's default")
    for server in results["servers"]:
        if server.get("skipped"):
            lines.append(f"- server `{server['label']}` (caches {server['caches']}): skipped, {server['skipped']}")
            continue
        stats = server.get("system_stats") or {}
        device = ((stats.get("devices") or [{}])[0]).get("name", "")
        args = " ".join(_shown_arg(a) for a in [*(["--cpu"] if server.get("cpu") else []), *server.get("args", [])])
        idle = server.get("idle") or {}
        gpu_idle = f"idle GPU {_num(_gib(idle.get('gpu_MiB')))} GiB, " if idle.get("gpu_MiB") is not None else "idle "
        caches = server["caches"] + (f", {server['kept_cache_files']} files at its start from earlier runs"
                                     if "kept_cache_files" in server else "")
        kinds = "Inductor/Triton/CUDA JIT" if "CUDA_CACHE_PATH" in (server.get("env") or {}) else "Inductor/Triton"
        lines.append(f"- server `{server['label']}` ({kinds} caches {caches}): `{args}`; "
                     f"start {_num(server.get('start_s'))} s; {gpu_idle}host anon {_num(idle.get('anon_GiB'))} GiB; "
                     f"device `{device}`"
                     + (f"; did not start: {' '.join(server['start_error'].split())[-300:]}"
                        if server.get("start_error") else ""))
    lines += ["", "| server | # | job | ok | queue->image s | encode s | denoise s | s/step | decode s | first step s "
              "/ graphs | GPU peak / held GiB (card) | torch peak / held GiB | anon peak / after GiB | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for server in results["servers"]:
        for job in server["jobs"]:
            st, gpu, host, log = job.get("stages", {}), job.get("gpu", {}), job.get("host", {}), job.get("log", {})
            if "skipped" in job:
                note = "skipped: " + job["skipped"]
            elif not job.get("ok"):
                note = " ".join((job.get("error") or "").split())[:160].replace("|", "/")
            else:
                note = "survived" if job.get("survived") else "server gone after it"
                if st.get("cuda_graphs"):
                    note = f"CUDA graphs: {st['cuda_graphs'][:100]}"
            if job["job"].startswith("free") and "skipped" not in job:
                torch_after = job.get("torch_after") or {}
                torch_held = (f"{_num(_gib(torch_after['allocated_MiB']))} / {_num(_gib(torch_after['reserved_MiB']))}"
                              " (allocated / reserved)" if torch_after else "")
                lines.append(f"| {server['label']} | {job['n']} | free | {_num(job.get('ok'))} | "
                             f"{_num(job.get('seconds'))} | | | | | | held {_num(_gib(gpu.get('held_MiB')))} | "
                             f"{torch_held} | after {_num(host.get('after_GiB'))} |{_settled_note(job)}|")
                continue
            step = st.get("s_per_step") or log.get("s_per_step")
            encode = _num(st.get("encode_s")) + (" (cached)" if st.get("encode_cached") else "")
            first = "" if "first_step_s" not in st else f"{_num(st['first_step_s'])} / {st.get('graphs_compiled')}"
            lines.append(
                f"| {server['label']} | {job['n']} | {job['job']} | {_num(job.get('ok'))} | "
                f"{_num(job.get('queue_to_image_s'))} | {encode} | {_num(st.get('denoise_s'))} | {_num(step, 3)} | "
                f"{_num(st.get('decode_s'))} | {first} | {_num(_gib(gpu.get('peak_MiB')))} / "
                f"{_num(_gib(gpu.get('held_MiB')))} | {_num(st.get('torch_peak_GiB'))} / "
                f"{_num(st.get('torch_held_GiB'))} | {_num(host.get('peak_GiB'))} / {_num(host.get('after_GiB'))} | "
                f"{note} |")
    summary = results.get("summary") or summarize(results)
    lines.append("")
    parts = {server["label"]: first_image_parts(server) for server in results["servers"]}
    for s in summary["servers"]:
        if "first_image_s" in s:
            lines.append(f"- `{s['label']}` (caches {s['caches']}): server start {s['start_s']} s + first "
                         f"{s['first_job']} prompt = first image after **{s['first_image_s']} s**"
                         + (f"; {parts[s['label']]}" if parts.get(s["label"]) else ""))
        if "anon_peak_above_idle_GiB" in s:
            lines.append(f"- `{s['label']}`: host anonymous memory peak {s['anon_peak_above_idle_GiB']} GiB above the "
                         f"idle server ({s['idle_anon_GiB']} GiB); jobs ok {s['jobs_ok']}, failed {s['jobs_failed']}, "
                         f"skipped {s['jobs_skipped']}; restarts {s['restarts']}; alive at the end: "
                         f"{_num(s['alive_at_end'])}")
    for s in summary["series"]:
        lines.append(f"- series `{s['series']}` on `{s['server']}`: {s['ok']} of {s['planned']} ok ({s['failed']} "
                     f"failed, {s['skipped']} skipped), queue->image median {_num(s['wall_median_s'])} s "
                     f"(min {_num(s['wall_min_s'])}, max {_num(s['wall_max_s'])}), s/step median "
                     f"{_num(s['s_per_step_median'], 3)}; "
                     + (f"GPU held {_num(s['gpu_held_first_GiB'])} -> {_num(s['gpu_held_last_GiB'])} GiB "
                        f"({_num(s['gpu_held_growth_pct'])}%), peak max {_num(s['gpu_peak_max_GiB'])} GiB; "
                        if s["gpu_held_first_GiB"] is not None else "")
                     + f"host anon {_num(s['anon_after_first_GiB'])} -> "
                     f"{_num(s['anon_after_last_GiB'])} GiB ({_num(s['anon_growth_pct'])}%); server survived every "
                     f"prompt: {_num(s['survived_all'])}")
    for s in summary["lora_changes"]:
        lines.append(f"- LoRA change `{s['job']}` on `{s['server']}`: {_num(s['queue_to_image_s'])} s queue->image, "
                     f"graphs compiled {s['graphs_compiled']}, first step {_num(s['first_step_s'])} s")
    errors = [(server["label"], job) for server in results["servers"] for job in server["jobs"]
              if "skipped" not in job and not job.get("ok")]
    for label, job in errors[:6]:
        error = " ".join((job.get("error") or "").split())[:400]
        lines.append(f"- error in `{job['job']}` (#{job['n']}, `{label}`): {error}")
    return "\n".join(lines) + "\n"


def _jobs(runs: list[dict[str, Any]], version: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(server, job) of every job that ran on ComfyUI ``version``."""
    return [(server, job) for run in runs if run["comfyui_version"] == version for server in run["servers"]
            for job in server["jobs"] if "skipped" not in job]


def _job_kind(job: str) -> str:
    """``fastest``, ``core`` (ComfyUI core's own workflow), ``model`` (ComfyUI's loaders with the pack's nodes on
    the MODEL), ``free``, or ``other`` (the pack's other workflows)."""
    if job.split(":")[0] == MODEL_PATH:
        return "model"
    for kind in ("fastest", "core", "free"):
        if job.startswith(kind):
            return kind
    return "other"


COMFY_LOADER_KINDS = ("core", "model")
"""Job kinds whose models ComfyUI's own loaders hold, and keep (in GPU or host memory) after the prompt."""


def _after_comfy_loaders(server: dict[str, Any], job: dict[str, Any]) -> bool:
    """Whether a job of :data:`COMFY_LOADER_KINDS` ran on ``server`` before ``job``: then the card and the server's
    host memory also hold what ComfyUI keeps of that model, and ``job``'s peaks are not its own."""
    return any(_job_kind(j["job"]) in COMFY_LOADER_KINDS and "skipped" not in j
               for j in server["jobs"][:server["jobs"].index(job)])


def _anon_above_idle(runs: list[dict[str, Any]], version: str, kind: str) -> float | None:
    """The highest host anonymous memory of a server during prompts of ``kind`` (:func:`_job_kind`), above that
    server when idle (GiB); for the pack's own workflows, only prompts that no ComfyUI-loader prompt preceded on
    their server (:func:`_after_comfy_loaders`)."""
    above = []
    for run in runs:
        if run["comfyui_version"] != version:
            continue
        for server in run["servers"]:
            idle = (server.get("idle") or {}).get("anon_GiB")
            peaks = [(j.get("host") or {}).get("peak_GiB") for j in server["jobs"]
                     if "skipped" not in j and _job_kind(j["job"]) == kind
                     and (kind in COMFY_LOADER_KINDS or not _after_comfy_loaders(server, j))]
            peaks = [p for p in peaks if p is not None]
            if idle is not None and peaks:
                above.append(round(max(peaks) - idle, 2))
    return max(above, default=None)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def _check(value: float | None, limit: float) -> str:
    return "" if value is None else ("yes" if value <= limit else "no")


def _across_runs(verdict: str, sides: list[list[dict[str, Any]]], commit_of: dict[int, str]) -> str:
    """``verdict``, saying so where the two sides of a ratio ran in different calls (commits named)."""
    commits = [sorted({commit_of.get(id(j), "?") for j in side}) for side in sides]
    if verdict and (len(commits[0]) != 1 or commits[0] != commits[1]):
        return f"{verdict} (a ratio across runs: {', '.join(commits[0])} / {', '.join(commits[1])})"
    return verdict


def _lora_changes(jobs: list[dict[str, Any]]) -> list[tuple[dict[str, Any] | None, dict[str, Any]]]:
    """Of one server's prompts in order: (the previous prompt of the same workflow or None, the prompt) for each
    prompt with ``lora=``/``strength=`` options other than that previous prompt's (a repeat is no change)."""
    last: dict[str, dict[str, Any]] = {}
    found = []
    for job in jobs:
        workflow = job["job"].split(":")[0]
        previous, last[workflow] = last.get(workflow), job
        if ("lora=" in job["job"] or "strength=" in job["job"]) and (previous or {}).get("job") != job["job"]:
            found.append((previous, job))
    return found


def _per_server(jobs: list[tuple[dict, dict]]) -> list[list[dict[str, Any]]]:
    """(server, job) pairs grouped into each server's jobs, in order."""
    grouped: dict[int, list[dict[str, Any]]] = {}
    for srv, job in jobs:
        grouped.setdefault(id(srv), []).append(job)
    return list(grouped.values())


def _model_lora_changes(jobs: list[tuple[dict, dict]]) -> list[tuple[dict, dict, dict | None]]:
    """The MODEL path's LoRA changes (:func:`_lora_changes` of the prompts that ran), each with the MODEL-path prompt
    before it and the next one when it kept the new options."""
    found = []
    for seq in _per_server([(srv, j) for srv, j in jobs if _job_kind(j["job"]) == "model" and j.get("ok")]):
        following = {id(a): b for a, b in pairwise(seq)}
        for before, change in _lora_changes(seq):
            if before is not None:
                after = following.get(id(change))
                found.append((change, before, after if after and after["job"] == change["job"] else None))
    return found


def _model_path_rows(ok: list[tuple[dict, dict]], of: Callable[..., list[dict[str, Any]]],
                     commit_of: dict[int, str]) -> list[tuple[str, str, str]]:
    """The MODEL path's targets: warm s/step (KSampler's progress line) against ComfyUI core's best warm s/step on
    the same files (with or without TorchCompileModel) and against the pack's own fastest workflow."""
    model_jobs = [j for j in of(MODEL_PATH, warm=True) if (j.get("log") or {}).get("s_per_step")]
    if not model_jobs:
        return []
    step = statistics.median(j["log"]["s_per_step"] for j in model_jobs)
    core_jobs = [j for _, j in ok if _job_kind(j["job"]) == "core"
                 and not j.get("first_on_server") and (j.get("log") or {}).get("s_per_step")]
    core = [j["log"]["s_per_step"] for j in core_jobs]
    fastest_jobs = [j for j in of("fastest", warm=True) if "s_per_step" in j["stages"]]
    model_commits = {commit_of.get(id(j)) for j in model_jobs}
    fastest_jobs = [j for j in fastest_jobs if commit_of.get(id(j)) in model_commits] or fastest_jobs  # same run first
    fastest = [j["stages"]["s_per_step"] for j in fastest_jobs]
    rows = [("ComfyUI core nodes + FP8 (KSampler on the pack's MODEL), warm s/step", f"median {_num(step, 3)}", "")]
    compiled = [j for _, j in ok if j["job"].startswith("core:compile") and not j.get("first_on_server")
                and (j.get("log") or {}).get("s_per_step")]
    if core:
        ratio = round(step / min(core), 3)
        measured = f"{ratio}x ({_num(step, 3)} / {_num(min(core), 3)})"
        if compiled:
            best = min(core_jobs, key=lambda j: j["log"]["s_per_step"])
            rows.append(("its s/step <= 0.55x core's best warm s/step on the same files", measured,
                         _across_runs(_check(ratio, 0.55), [model_jobs, [best]], commit_of)))
        else:  # core's best is its compiled step: without it the target cannot be judged
            rows.append(("its s/step against core's warm s/step without TorchCompileModel (the target, 0.55x "
                         "core's best, needs core's compiled warm step, not measured here)", measured, ""))
    if fastest:
        pack = statistics.median(fastest)
        ratio = round(step / pack, 3)
        rows.append(("its s/step within 10% of the pack's fastest workflow",
                     f"{ratio}x ({_num(step, 3)} / {_num(pack, 3)})",
                     _across_runs(_check(ratio, 1.10), [model_jobs, fastest_jobs], commit_of)))
    return rows


def targets(runs: list[dict[str, Any]]) -> str:
    """The product path's targets against what the runs of one card measured, per ComfyUI version, as markdown."""
    lines = ["| ComfyUI | target | measured | met |", "|---|---|---|---|"]
    for version in sorted({r["comfyui_version"] for r in runs}):
        jobs = _jobs(runs, version)
        ok = [(srv, j) for srv, j in jobs if j.get("ok")]

        def of(name: str, warm: bool | None = None, plain: bool = True, ok=ok) -> list[dict[str, Any]]:
            return [j for _, j in ok if j["job"].split(":")[0] == name
                    and (not plain or j["job"] in (name, f"{name}:vary"))
                    and (warm is None or j.get("first_on_server") is not warm)]

        def newest(name: str, warm: bool | None = None, plain: bool = True, version: str = version,
                   keep: Callable[[dict[str, Any], dict[str, Any]], bool] = lambda srv, j: True
                   ) -> tuple[list[dict[str, Any]], str]:
            """:func:`of`'s jobs (those ``keep(server, job)`` takes) from the newest run of ``version`` that has any
            (the pack's build changes between runs; its memory and times are those of the newest code measured),
            and that run's date and commit."""
            for run in sorted((r for r in runs if r["comfyui_version"] == version), key=lambda r: r["date"],
                              reverse=True):
                picked = of(name, warm, plain, ok=[(srv, j) for srv in run["servers"] for j in srv["jobs"]
                                                   if "skipped" not in j and j.get("ok") and keep(srv, j)])
                if picked:
                    return picked, f" (newest run: {run['date'][:10]}, {run['commit'][:7]})"
            return [], ""

        series = [{**s, "run": f" ({r['date'][:10]}, {r['commit'][:7]})"}  # each 20-prompt series, its run named
                  for r in sorted(runs, key=lambda r: r["date"]) if r["comfyui_version"] == version
                  for s in summarize(r)["series"] if s["series"].startswith("fastest:vary") and s["planned"] >= 20]
        rows: list[tuple[str, str, str]] = []
        for s in series:
            rows.append(("20 fastest prompts in a row, new seeds and prompts: nothing lost, no crash",
                         f"{s['ok']} of {s['planned']} ok, server survived each: {_num(s['survived_all'])}{s['run']}",
                         "yes" if s["ok"] == s["planned"] and s["survived_all"] else "no"))
        alone, fastest_run = newest("fastest", keep=lambda srv, j: not _after_comfy_loaders(srv, j))
        peak = max((j["gpu"]["peak_MiB"] for j in alone if (j.get("gpu") or {}).get("peak_MiB")), default=None)
        torch_peak = max((j["stages"]["torch_peak_GiB"] for j in alone if "torch_peak_GiB" in j["stages"]),
                         default=None)
        rows.append(("GPU peak of a fastest prompt <= 28 GiB (card; PyTorch's allocator), on servers where no "
                     "ComfyUI-loader prompt ran before it",
                     f"{_num(_gib(peak))} GiB; {_num(torch_peak)} GiB{fastest_run}", _check(_gib(peak), 28.0)))
        held = [j["gpu"]["held_MiB"] for j in alone if (j.get("gpu") or {}).get("held_MiB")]
        rows.append(("GPU memory held between fastest prompts (card): the fp8 DiT + what ComfyUI keeps",
                     f"median {_num(_gib(_median(held)))} GiB{fastest_run}", ""))
        low, low_run = newest("low_vram")
        low = [j["gpu"]["peak_MiB"] for j in low if (j.get("gpu") or {}).get("peak_MiB")]
        rows.append(("GPU peak of a low VRAM prompt <= 20 GiB (card)",
                     f"{_num(_gib(max(low, default=None)))} GiB{low_run}", _check(_gib(max(low, default=None)), 20.0)))
        warm_jobs, warm_run = newest("fastest", warm=True)
        seeds_only = [j["queue_to_image_s"] for j in warm_jobs if j["job"] == "fastest"]
        new_prompts = [j["queue_to_image_s"] for j in of("fastest", warm=True) if j["job"] == "fastest:vary"]
        warm = _median(seeds_only or new_prompts)
        rows.append(("warm fastest, queue to image <= 14.0 s (H100)" + ("" if seeds_only else
                     ", each prompt a new text (its encoding included)"), f"median {_num(warm)} s{warm_run}",
                     _check(warm, 14.0)))
        if seeds_only and new_prompts:
            rows.append(("warm fastest with a new prompt text each time (its encoding included)",
                         f"median {_num(_median(new_prompts))} s", ""))
        commit_of = {id(j): r["commit"][:7] for r in runs for srv in r["servers"] for j in srv["jobs"]}
        core_jobs = [j for _, j in ok if _job_kind(j["job"]) == "core" and not j.get("first_on_server")]
        if warm is not None and core_jobs:
            best = min(core_jobs, key=lambda j: j["queue_to_image_s"])
            ratio = round(warm / best["queue_to_image_s"], 3)
            measured = f"{ratio}x ({warm} s / {best['queue_to_image_s']} s)"
            if any(j["job"].startswith("core:compile") for j in core_jobs):
                rows.append(("warm fastest <= 0.42x core's best warm prompt (core's workflow on the runs' fp8 or bf16 "
                             "DiT file, whichever was faster)", measured,
                             _across_runs(_check(ratio, 0.42), [warm_jobs, [best]], commit_of)))
            else:  # core's best is its compiled prompt: without it the target cannot be judged
                rows.append(("warm fastest against core's warm prompt without TorchCompileModel (the target, 0.42x "
                             "core's best, needs core's compiled warm prompt, not measured on this version)",
                             measured, ""))
        rows += _model_path_rows(ok, of, commit_of)
        lightning, lightning_run = newest("lightning_4step", warm=True)
        lightning = _median([j["queue_to_image_s"] for j in lightning])
        rows.append(("Lightning 4-step warm, queue to image <= 1.2 s", f"median {_num(lightning)} s{lightning_run}",
                     _check(lightning, 1.2)))
        above = _anon_above_idle(runs, version, "fastest")
        rows.append(("server anonymous host memory peak <= 10 GiB above the idle server (fastest prompts)",
                     f"{_num(above)} GiB", _check(above, 10.0)))
        for kind, label in (("other", "the same during the pack's other workflows (low VRAM keeps DiT blocks in "
                                      "pinned host memory)"),
                            ("model", "the same during ComfyUI core nodes + FP8 prompts (ComfyUI's loaders keep the "
                                      "bf16 model in host memory)"),
                            ("core", "the same during ComfyUI core's own prompts (for comparison)")):
            if (other := _anon_above_idle(runs, version, kind)) is not None:
                rows.append((label, f"{_num(other)} GiB", ""))
        for s in series:
            growth = max(abs(g) for g in (s["gpu_held_growth_pct"] or 0, s["anon_growth_pct"] or 0))
            rows.append(("growth over 20 prompts <= 2% (GPU held; host anonymous)",
                         f"{_num(s['gpu_held_growth_pct'])}%; {_num(s['anon_growth_pct'])}%{s['run']}",
                         _check(growth, 2.0)))
        dated = sorted(((r["date"], r["commit"][:7], summarize(r)["servers"]) for r in runs
                        if r["comfyui_version"] == version), key=lambda d: d[0])
        for caches, limit, label in (("fresh", 75.0, "empty"), ("reuse", 40.0, "warm")):
            firsts = [(s["first_image_s"], commit) for _, commit, run_servers in dated for s in run_servers
                      if s["caches"] == caches and s.get("first_job", "").startswith("fastest")]
            if firsts:  # every run's, oldest first; judged on the newest run's (the build changes between runs)
                newest_commit = firsts[-1][1]
                rows.append((f"server start to first fastest image, {label} Inductor cache <= {limit:g} s "
                             "(judged on the newest run)", ", ".join(f"{v} s ({c})" for v, c in firsts),
                             _check(max(v for v, c in firsts if c == newest_commit), limit)))
        changes = [j for seq in _per_server(ok) for _, j in _lora_changes(seq) if _job_kind(j["job"]) != "model"]
        for j in changes:
            rows.append(("a LoRA change: time, recompiles (none expected)",
                         f"{j['queue_to_image_s']} s, graphs compiled {j['stages'].get('graphs_compiled')}",
                         "yes" if j["stages"].get("graphs_compiled") == 0 else "no"))
        for change, before, after in _model_lora_changes(jobs):
            later = f"{after['queue_to_image_s']} s" if after else "not run"
            rows.append((f"MODEL path, a LoRA strength change ({before['job']} to {change['job']}): its prompt and "
                         "card peak, the prompts before and after it (moving the fp8 copy off the card and back, or "
                         "a recompile, would add tens of seconds)",
                         f"{change['queue_to_image_s']} s, peak {_num(_gib((change.get('gpu') or {}).get('peak_MiB')))}"
                         f" GiB; before {before['queue_to_image_s']} s; after {later} ({commit_of.get(id(change))})",
                         ""))
        for core, label in ((False, "every prompt of the pack's workflows ran (failures by job)"),
                            (True, "ComfyUI core's own prompts (for comparison)")):
            mine = [(srv, j) for srv, j in jobs if (_job_kind(j["job"]) == "core") == core]
            if core and not mine:
                continue
            failed = [(srv["label"], j) for srv, j in mine if not j.get("ok")]
            rows.append((label, f"{len(mine) - len(failed)} of {len(mine)} ok" + "".join(
                f"; {j['job']} on {srv}: {' '.join((j.get('error') or '').split())[:120]}" for srv, j in failed[:4]),
                ("yes" if not failed else "no") if not core else ""))
        rows = [(t, m if any(c.isdigit() for c in m) else "not measured in these runs", met) for t, m, met in rows]
        lines += [f"| {version} | {t} | {m.replace('|', '/')} | {met} |" for t, m, met in rows]
    return "\n".join(lines) + "\n"


def _shown_path(path: Path) -> str:
    """``path`` relative to the checkout when inside it."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def write_record(paths: list[Path], folder: Path = PERFORMANCE_DIR) -> Path:
    """Rewrite ``<folder>/<card>-product-path.md`` with the results ``paths`` (runs on one card); returns the file.

    The card is named as the harness's records are (``harness_core.card_name``: ``H100``, ``H200``)."""
    runs = [json.loads(p.read_text()) for p in paths]
    c = runs[0].get("card") or {}
    versions = sorted({r["comfyui_version"] for r in runs})
    dates = sorted({r["date"][:10] for r in runs})
    gpu = str(c.get("name") or runs[0].get("device") or "unknown")
    commits = sorted({str(r.get("commit") or "unknown") for r in runs})
    section = [f"# Product path on {card_name(gpu)}: ComfyUI {' and '.join(versions)} servers", "",
               f"Written by `python3 bench/product_path.py record {' '.join(_shown_path(p) for p in paths)}` (the "
               f"runs' results.json files; {_shown_path(RESULTS_DIR)} keeps them); a new record replaces this file. "
               f"GPU: {gpu}. Dates: {', '.join(dates)}. Commit: {', '.join(commits)}. Commands: "
               f"`bash bench/product_path_device.sh PLAN` on the GPU machine (plans: "
               f"{', '.join(sorted({str(r.get('plan')) for r in runs}))}).", "",
               "Full-size random-weight files in the Comfy-Org layout written on the GPU by "
               "`bench/full_size_files.py`, a real ComfyUI server with the pack started with ComfyUI's defaults "
               "(plus the arguments named), the shipped API workflows and ComfyUI core's own workflow queued over "
               "HTTP (`bash bench/product_path_device.sh PLAN` on the GPU machine). queue->image: from the POST to "
               "ComfyUI's `execution_success`; stages: the Sampler's own report; GPU memory: nvidia-smi on the card "
               "every 0.25 s (held: one second after the prompt); host: the server's RssAnon. The model files sit in "
               "the page cache (written just before).", ""]
    section += ["### Targets", "", targets(runs)]
    for run in runs:
        section.append(markdown(run, heading="###"))
    path = Path(folder) / f"{card_name(gpu)}-product-path.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(section).rstrip() + "\n", encoding="utf-8")
    return path


