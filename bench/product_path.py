"""The product path at full size: a real ComfyUI server with this pack, the shipped workflows over HTTP, what users see.

What runs: ComfyUI (0.3.75 or 0.33.0, its source folder given by ``--comfyui``) started the usual way
(``python main.py`` with ComfyUI's defaults: its own allocator choice, dynamic VRAM where 0.33 turns it on; only the
arguments a plan or ``--server-arg`` adds), this checkout as a custom-node pack, the model files of a ComfyUI
``models`` folder (``--models``, through extra_model_paths.yaml; bench/full_size_files.py writes full-size
random-weight ones). Jobs are queued over HTTP one after another:

* a shipped API workflow (``example_workflows/api/<name>.json``: ``fastest``, ``lightning_4step``, ``low_vram``,
  ``lora_fused``, ``bf16_baseline``, ``te_fp8``, ``benchmark``, ``comfy_model_fp8``) with the written files' names
  put in, a new seed for every job (ComfyUI serves an identical prompt from its cache) and, with ``:vary``, a new
  prompt text; ``comfy_model_fp8`` (ComfyUI core's nodes with Apply TE-FP8 and Compile Model on the MODEL)
  quantizes the bf16 DiT, so its plans (``v075-model``, ``v033-model``) run with ``--dit bf16``;
* ``core``: ComfyUI core's own Qwen-Image-Edit-2509 graph on the same files (UNETLoader, CLIPLoader type
  qwen_image, VAELoader, ImageScaleToTotalPixels 1 MP, TextEncodeQwenImageEditPlus, VAEEncode,
  ModelSamplingAuraFlow shift 3.1, KSampler euler/simple 40 steps cfg 4, VAEDecode, SaveImage); ``core:compile``
  puts TorchCompileModel (inductor) after the UNETLoader;
* ``free``: POST /free (unload models, free memory), as ComfyUI's "free model and node cache" button does; the job
  ends once the server's PyTorch allocation stops falling (the unload moves models to the CPU in the background).

A job spec is ``name[:option[:option...]][*repeat]``; options: ``vary`` (new prompt text), ``lora=4|8`` (which
Lightning LoRA file), ``strength=X`` (on ``comfy_model_fp8`` either one adds ComfyUI's LoraLoaderModelOnly after its
UNETLoader), ``graphs=off`` (CUDA graphs off in the Compile node), ``compile`` (core),
``seed=N``, ``host_blocks=N`` (the Load node's DiT blocks kept in host memory). Plans (``--plan``; ``plan NAME``
prints one) are lists of servers, each with its arguments, its Inductor, Triton and CUDA driver JIT caches (fresh empty
folders, or the previous server's; ``CUDA_CACHE_PATH`` too, so that no earlier run on the machine warms a start) and
its jobs.

Recorded per job (``results.json``, rewritten after every job): queue-to-image seconds (the POST to ComfyUI's own
``execution_success`` timestamp) and execution seconds; the Qwen Edit Sampler's reported stages (prompt encoding,
denoising and s/step, VAE decode, total, first step and graphs compiled this run, CUDA graphs, PyTorch's GPU peak
and held memory); for ``core`` the s/step of the KSampler's progress line in the server log; GPU memory used on the
card (nvidia-smi every 0.25 s: before, peak during, held one second after; under 0.33's dynamic VRAM PyTorch's
counters miss ComfyUI's own weights, the card does not); the server's anonymous host memory (``RssAnon`` of
/proc/PID/status every 0.25 s: before, peak, after; its process tree's too); errors with their traceback; whether the
server survived. Per server: arguments, caches, start seconds, idle GPU and host memory, ComfyUI's /system_stats
(the device line names the allocator). Summary: cold time to the first image (server start + first prompt, fresh
caches), the same with the caches warm (a second server on the first one's caches), each repeated series (e.g. 20
prompts in a row: failures, median, growth of held GPU and host memory from its first to its last prompt), LoRA
changes (time, graphs compiled). A markdown table goes to ``table.md`` and is printed last.

``--keep-caches`` puts every server's Inductor/Triton caches in one folder under ``--work`` that no run empties, so
a later call on the same warm GPU machine starts where an earlier one left off: ComfyUI core's TorchCompileModel
prompt compiles for 330 to 380 s the first time, too long to share one 600 s call with the prompts it is compared
with. Such a server's caches read ``kept`` (with the files they held at its start), and its first image counts
neither as an empty-cache nor as a warm-cache start.

``--deadline S`` ends a run cleanly S seconds after it started: a job (or a server start) that would not finish in
the time left, by its duration measured earlier in the run or a full-size estimate, is recorded as skipped.

On the GPU machine bench/product_path_device.sh does everything in one command (wheels, ComfyUI source, files,
this tool); here::

    python3 bench/product_path.py run --comfyui .testenv/comfyui --models M --out O --plan tiny-smoke --tiny
    python3 bench/product_path.py table O/results.json
    python3 bench/product_path.py targets O/results.json [O2/results.json ...]  # the product path's targets, one card
    python3 bench/product_path.py record O/results.json [O2/results.json ...]  # docs/performance/<card>-product-path.md
    python3 bench/product_path.py integrity --device cuda --synthetic-blocks 6  # the load check's cost
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from comfy_server import ComfyInstall, ComfyServer, PromptFailedError, PromptRejectedError  # noqa: E402
from main_job import example_image, write_extra_model_paths  # noqa: E402
from workflows import INPUT_IMAGE, PROMPT  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from productpath.integrity import integrity_main  # noqa: E402
from productpath.logs import parse_log, parse_stages  # noqa: E402
from productpath.plans import (  # noqa: E402
    ESTIMATE_S,
    MODEL_PATH,
    PLANS,
    SERVER_START_ESTIMATE_S,
    Job,
    Plan,
    ServerSpec,
    parse_jobs,
)
from productpath.prompts import FULL_SIZE, PROMPTS, TINY_SIZE, ModelFiles, core_prompt, shipped_prompt  # noqa: E402
from productpath.record import (  # noqa: E402
    PERFORMANCE_DIR,
    markdown,
    one_line,
    summarize,
    targets,
    textwrap_error,
    torch_memory,
    write_record,
)
from productpath.sampling import GIB, MemorySampler, rss_anon, wait_steady  # noqa: E402

HELD_AFTER_S = 1.0
"""Seconds after a prompt ends at which the memory it left held is read."""
FREE_SETTLE_S = 120.0
"""Seconds a ``free`` job waits at most for the server's PyTorch allocation to stop falling."""
FREE_SETTLED_READS = 4
"""Reads 0.5 s apart with an unchanged allocation after which a ``free`` job counts the unload as done."""
RESERVE_S = 20.0
"""Seconds kept at the end of a deadline for stopping the server and writing results."""
KEPT_CACHES = "kept-caches"
"""``--keep-caches``' folder under ``--work``: Inductor's and Triton's caches kept between runs."""


# ----------------------------------------------------------------------------- the run


def commit_of(root: Path) -> str:
    """``git describe``-like id of the checkout (short hash, ``+dirty`` when files differ), or ``unknown``."""
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=10", "HEAD"], capture_output=True,
                             text=True, check=True, timeout=20).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=20).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def comfyui_version(comfyui: Path) -> str:
    text = (comfyui / "comfyui_version.py").read_text()
    m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", text)
    return m.group(1) if m else "unknown"


def card() -> dict[str, str]:
    """GPU 0's name, memory and driver from nvidia-smi (empty without one)."""
    if not shutil.which("nvidia-smi"):
        return {}
    try:
        line = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=name,memory.total,driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout
        name, memory, driver = (s.strip() for s in line.strip().split(","))
        return {"name": name, "memory": memory, "driver": driver}
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}


class Deadline:
    """Seconds left until the run's deadline (None: no deadline)."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.monotonic() - RESERVE_S


class Run:
    """Servers and jobs of one plan; ``results`` is the JSON written after every job."""

    def __init__(self, args: argparse.Namespace, plan_name: str, plan: Plan):
        self.args = args
        self.plan = plan
        self.out: Path = args.out
        self.work: Path = args.work
        self.deadline = Deadline(args.deadline)
        self.files = ModelFiles.find(args.models.resolve())
        uses_model_path = any(job.name == MODEL_PATH for spec in plan.servers for job in parse_jobs(spec.jobs))
        if uses_model_path and "fp8" in self.files.dit:
            raise SystemExit(f"plan {plan_name} runs {MODEL_PATH}, which quantizes high-precision weights; the "
                             f"models folder holds {self.files.dit}: write the bf16 DiT (--dit bf16)")
        self.sampler = MemorySampler(gpu=not args.cpu)
        self.durations: dict[tuple[str, bool], float] = {}
        self.seed = args.seed
        self.prompt_index = 0
        self.server: ComfyServer | None = None
        self.log_offset = 0
        self.object_info: dict[str, Any] = {}
        self.loaded: set[str] = set()
        version = comfyui_version(args.comfyui)
        if plan.comfyui not in ("any", version):
            raise SystemExit(f"plan {plan_name} runs on ComfyUI {plan.comfyui}; {args.comfyui} is {version}")
        self.results: dict[str, Any] = {
            "tool": "bench/product_path.py", "plan": plan_name, "description": plan.description,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": args.commit or commit_of(ROOT),
            "card": card(), "comfyui_version": version, "sizes": "tiny" if args.tiny else "full",
            "device": "cpu" if args.cpu else "gpu", "files": {**self.files.__dict__, "models": str(args.models)},
            "written": json.loads(args.written.read_text()) if args.written and args.written.exists() else None,
            "servers": [], "summary": {},
        }

    # -- bookkeeping

    def save(self) -> None:
        """results.json and the running server's log so far, in ``--out``: a run stopped from outside (the device
        call's limit) still leaves both behind."""
        self.results["summary"] = summarize(self.results)
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1) + "\n")
        tmp.replace(self.out / "results.json")
        self.keep_server_log()

    def keep_server_log(self) -> None:
        """The current server's log (its last 2 MB) as ``--out``/server-N.log, N its place in the plan."""
        if self.server is None:
            return
        with contextlib.suppress(OSError):
            log = self.server.log_path.read_text(errors="replace")
            (self.out / f"server-{len(self.results['servers'])}.log").write_text(log[-2_000_000:])

    def estimate(self, job: Job) -> float:
        first = job.kind != "free" and job.estimate_key not in self.loaded
        measured = self.durations.get((job.estimate_key, first))
        if measured is not None:
            return measured
        full = ESTIMATE_S.get(job.estimate_key, (120, 45))[0 if first else 1]
        return full * (0.5 if self.args.tiny else 1.0)

    # -- servers

    def start_server(self, spec: ServerSpec, index: int, record: dict[str, Any]) -> bool:
        base = self.work / f"{index}-{spec.label}"
        if base.exists():
            shutil.rmtree(base)
        (base / "input").mkdir(parents=True)
        example_image(base / "input" / INPUT_IMAGE, TINY_SIZE if self.args.tiny else FULL_SIZE)
        (base / "frontend").mkdir()
        cache = self.cache_dirs(spec, index, record)
        env = {"TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
               "CUDA_CACHE_PATH": str(cache / "cuda")}  # the driver JIT cache, else machine-wide
        if self.args.cpu:
            env["QWEN_EDIT_FP8_EMULATE"] = "1"  # FP8 kernels that cannot run on a CPU run as their mirrors, said
        args = ("--extra-model-paths-config", str(write_extra_model_paths(base, self.args.models.resolve())),
                "--front-end-root", str(base / "frontend"), *spec.args, *self.args.server_arg)
        installation = ComfyInstall(self.results["comfyui_version"], self.args.comfyui, Path(sys.executable))
        self.server = ComfyServer(base, extra_args=args, cpu=self.args.cpu, env=env, installation=installation)
        record.update(args=list(args), command=self.server.command[1:], env=env, cpu=self.args.cpu, base=str(base))
        started = time.perf_counter()
        try:
            self.server.start(timeout=max(30.0, min(300.0, self.deadline.left())))
        except (RuntimeError, TimeoutError, OSError) as exc:
            record["start_error"] = str(exc)[-4000:]
            print(f"server {spec.label} did not start: {str(exc)[-2000:]}", flush=True)
            return False
        record["start_s"] = round(time.perf_counter() - started, 2)
        self.sampler.pid = self.server.process.pid
        self.log_offset = self.server.log_path.stat().st_size
        self.loaded.clear()
        time.sleep(HELD_AFTER_S)
        now = time.time()
        self.sampler.settle(now)
        record["idle"] = {"gpu_MiB": self.sampler.gpu_at(now),
                          "anon_GiB": round((rss_anon(self.server.process.pid) or 0) / GIB, 3)}
        with contextlib.suppress(Exception):
            record["system_stats"] = self.server.get("/system_stats", timeout=10).json()
        with contextlib.suppress(Exception):
            self.object_info = self.server.object_info()
        print(f"server {spec.label} ready in {record['start_s']} s (pid {self.server.process.pid}); "
              f"idle {record['idle']}", flush=True)
        return True

    def cache_dirs(self, spec: ServerSpec, index: int, record: dict[str, Any]) -> Path:
        if self.args.keep_caches:
            cache = self.work / KEPT_CACHES
            cache.mkdir(parents=True, exist_ok=True)
            record["caches"] = "kept"
            record["kept_cache_files"] = sum(1 for path in cache.rglob("*") if path.is_file())
            return cache
        if spec.caches == "reuse" and index > 0:
            return self.work / f"cache-{index - 1}"
        cache = self.work / f"cache-{index}"
        if cache.exists():
            shutil.rmtree(cache)
        cache.mkdir(parents=True)
        return cache

    def stop_server(self, record: dict[str, Any]) -> None:
        if self.server is None:
            return
        process = self.server.process
        record["alive_at_end"] = process is not None and process.poll() is None
        if process is not None and process.poll() is not None:
            record["returncode"] = process.returncode
        self.server.stop()
        self.sampler.pid = None
        self.keep_server_log()
        self.server = None

    def alive(self) -> bool:
        if self.server is None or self.server.process is None or self.server.process.poll() is not None:
            return False
        try:
            return self.server.get("/system_stats", timeout=15).ok
        except Exception:  # any failure to answer: not alive
            return False

    def new_log(self) -> str:
        with open(self.server.log_path, "rb") as handle:
            handle.seek(self.log_offset)
            data = handle.read()
        self.log_offset += len(data)
        return data.decode(errors="replace")

    # -- jobs

    def wait_allocated_settled(self, since: float) -> bool | None:
        """Wait until the server's PyTorch allocation stops falling after a ``/free``: ComfyUI's prompt worker moves
        each model to its offload device (the CPU) in the background, 15-24 s for 20-30 GiB. True once
        ``allocated_MiB`` changed by under 16 MiB over ``FREE_SETTLED_READS`` reads 0.5 s apart, False after
        ``FREE_SETTLE_S`` (or near the deadline), None where ``/system_stats`` has no CUDA device."""

        def allocated() -> float | None:
            try:
                now = torch_memory(self.server.get("/system_stats", timeout=10).json())
            except Exception:  # the server is judged alive or not after the job
                return None
            return None if now is None else now["allocated_MiB"]

        return wait_steady(allocated, lambda: time.time() - since < FREE_SETTLE_S and self.deadline.left() > RESERVE_S,
                           reads=FREE_SETTLED_READS)

    def run_job(self, job: Job, number: int) -> dict[str, Any]:
        record: dict[str, Any] = {"n": number, "job": job.label, "series": job.series, "index": job.index}
        if job.kind == "free":
            t0 = time.time()
            self.server.free()
            time.sleep(2.0)
            self.server.wait_idle(timeout=60)
            record["torch_settled"] = self.wait_allocated_settled(t0)
            time.sleep(HELD_AFTER_S)
            after = time.time()
            self.sampler.settle(after)
            record.update(ok=True, seconds=round(after - t0, 2), gpu=self.sampler.gpu_window(t0, after, after),
                          host=self.sampler.anon_window(t0, after, after))
            self.loaded.clear()
            with contextlib.suppress(Exception):  # what PyTorch's allocator holds: live tensors or its cache
                record["torch_after"] = torch_memory(self.server.get("/system_stats", timeout=10).json())
            record["survived"] = self.alive()
            return record
        self.seed = int(job.options["seed"]) if job.options.get("seed") else self.seed + 1
        text = None
        if "vary" in job.options:
            self.prompt_index += 1
            text = PROMPTS[self.prompt_index % len(PROMPTS)]
        if job.kind == "core":
            prompt = core_prompt(job, self.files, self.seed, text or PROMPT, self.args.tiny, self.object_info)
        else:
            prompt = shipped_prompt(job, self.files, self.seed, text, self.args.tiny)
        record.update(seed=self.seed, prompt_text=text or PROMPT, first_on_server=job.estimate_key not in self.loaded)
        timeout = max(10.0, min(self.args.job_timeout, self.deadline.left()))
        t0 = time.time()
        try:
            entry = self.server.run(prompt, timeout=timeout)
            record["ok"] = True
            record["images"] = [str(p) for p in self.server.output_files(entry)]
            record["info"] = [t for out in entry.get("outputs", {}).values() for t in out.get("text", [])]
            messages = dict(entry.get("status", {}).get("messages", []))
        except PromptRejectedError as exc:
            record.update(ok=False, error="rejected: " + exc.messages()[:2000])
            messages = {}
        except PromptFailedError as exc:
            event = exc.event("execution_error") or {}
            interrupted = exc.event("execution_interrupted")
            record.update(ok=False, error=f"{event.get('exception_type')}: {event.get('exception_message')}"
                          if event else ("interrupted" if interrupted else str(exc)[:2000]),
                          error_node=event.get("node_type"), traceback="".join(event.get("traceback", []))[-6000:])
            messages = dict(exc.messages)
        except TimeoutError as exc:
            record.update(ok=False, error=f"timeout after {timeout:.0f} s: {exc}")
            messages = {}
            with contextlib.suppress(Exception):
                self.server.interrupt()
                self.server.wait_idle(timeout=15)
        except Exception as exc:  # the server died or hung: recorded
            record.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[-3000:]}")
            messages = {}
        t1 = time.time()
        record["poll_wall_s"] = round(t1 - t0, 2)
        end = messages.get("execution_success") or messages.get("execution_error") or {}
        start = messages.get("execution_start") or {}
        if "timestamp" in end:
            record["queue_to_image_s" if record["ok"] else "queue_to_end_s"] = round(end["timestamp"] / 1000 - t0, 3)
            if "timestamp" in start:
                record["exec_s"] = round((end["timestamp"] - start["timestamp"]) / 1000, 3)
            t1 = min(t1, end["timestamp"] / 1000)
        time.sleep(HELD_AFTER_S)
        after = time.time()
        self.sampler.settle(after)
        record["gpu"] = self.sampler.gpu_window(t0, t1, after)
        record["host"] = self.sampler.anon_window(t0, t1, after)
        info = "\n".join(record.get("info", []))
        record["stages"] = parse_stages(info)
        with contextlib.suppress(OSError):
            log = self.new_log()
            record["log"] = parse_log(log)
            wall = record["log"].get("sampler_wall")
            if wall and "timestamp" in start and "timestamp" in end:
                record["around_sampler"] = {"before_s": round(wall[0] - start["timestamp"] / 1000, 3),
                                            "after_s": round(end["timestamp"] / 1000 - wall[1], 3)}
            if not record["ok"]:
                record["log_tail"] = log[-4000:]
        record["survived"] = self.alive()
        if record["ok"]:
            self.durations[(job.estimate_key, record["first_on_server"])] = record["poll_wall_s"] + HELD_AFTER_S
            self.loaded.add(job.estimate_key)
        return record

    def run(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        number = 0
        for index, spec in enumerate(self.plan.servers):
            jobs = parse_jobs(spec.jobs)
            record: dict[str, Any] = {"label": spec.label, "caches": spec.caches, "jobs_planned": spec.jobs,
                                      "jobs": [], "restarts": []}
            self.results["servers"].append(record)
            first = jobs[0] if jobs else None
            needed = SERVER_START_ESTIMATE_S + (self.estimate(first) if first else 0)
            if self.deadline.left() < needed:
                record["skipped"] = f"{self.deadline.left():.0f} s left, a start and its first job need ~{needed:.0f}"
                self.save()
                continue
            if not self.start_server(spec, index, record):
                self.save()
                continue
            self.save()
            try:
                for job in jobs:
                    number += 1
                    if not self.alive() and not self.restart(spec, index, record):
                        record["jobs"].append({"n": number, "job": job.label, "series": job.series,
                                               "index": job.index, "skipped": "the server is gone"})
                        continue
                    need = self.estimate(job)
                    if self.deadline.left() < need:
                        record["jobs"].append({"n": number, "job": job.label, "series": job.series,
                                               "index": job.index,
                                               "skipped": f"{self.deadline.left():.0f} s left, needs ~{need:.0f}"})
                        print(f"skip {job.label}: {self.deadline.left():.0f} s left, needs ~{need:.0f}", flush=True)
                        self.save()
                        continue
                    # in the results until it ends: a run stopped from outside shows the prompt it stopped in
                    record["jobs"].append({"n": number, "job": job.label, "series": job.series, "index": job.index,
                                           "ok": False, "unfinished": True, "stages": {},
                                           "error": "unfinished: the run stopped while this prompt ran"})
                    self.save()
                    print(f"[{spec.label} {number}] {job.label} ({self.deadline.left():.0f} s left)", flush=True)
                    try:
                        result = self.run_job(job, number)
                    except Exception as exc:  # the tool's own failure (the server stopped answering): recorded
                        result = {"n": number, "job": job.label, "series": job.series, "index": job.index,
                                  "ok": False, "error": f"{type(exc).__name__}: {exc}"[-3000:], "stages": {},
                                  "survived": self.alive()}
                    record["jobs"][-1] = result
                    self.save()
                    print("  " + one_line(result), flush=True)
                    if not result.get("ok"):
                        print(textwrap_error(result), flush=True)
            finally:
                self.stop_server(record)
                self.save()

    def restart(self, spec: ServerSpec, index: int, record: dict[str, Any]) -> bool:
        """After the server died: record how, start it again on the same caches if there is time."""
        process = self.server.process if self.server else None
        event = {"returncode": None if process is None else process.poll()}
        with contextlib.suppress(OSError):
            event["log_tail"] = self.new_log()[-4000:]
        record["restarts"].append(event)
        if self.deadline.left() < SERVER_START_ESTIMATE_S + 30:
            return False
        self.server.stop()
        started = time.perf_counter()
        try:
            self.server.start(timeout=max(30.0, min(300.0, self.deadline.left())))
        except (RuntimeError, TimeoutError, OSError) as exc:
            event["start_error"] = str(exc)[-2000:]
            return False
        event["start_s"] = round(time.perf_counter() - started, 2)
        self.sampler.pid = self.server.process.pid
        self.log_offset = self.server.log_path.stat().st_size
        self.loaded.clear()
        return True


# ----------------------------------------------------------------------------- command line


def main() -> int:
    if sys.argv[1:2] == ["integrity"]:
        return integrity_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="start servers and run a plan's jobs")
    run.add_argument("--comfyui", type=Path, required=True, help="ComfyUI's source folder (holds main.py)")
    run.add_argument("--models", type=Path, required=True, help="a ComfyUI models folder with the files")
    run.add_argument("--out", type=Path, required=True, help="results.json, table.md and server logs go here")
    run.add_argument("--work", type=Path, help="server folders and Inductor/Triton caches (default OUT/../work)")
    run.add_argument("--plan", choices=sorted(PLANS), help="a named plan (see 'plan NAME')")
    run.add_argument("--jobs", help="one server with these jobs (with --plan: its first server's arguments)")
    run.add_argument("--server-arg", action="append", default=[], help="one more ComfyUI argument (repeatable)")
    run.add_argument("--tiny", action="store_true", help="tiny files: small images and steps")
    run.add_argument("--cpu", action="store_true", help="start ComfyUI with --cpu (FP8 kernels emulated, said)")
    run.add_argument("--keep-caches", action="store_true",
                     help="Inductor/Triton caches in WORK/kept-caches, kept between runs on this machine")
    run.add_argument("--deadline", type=float, help="end cleanly this many seconds after the start")
    run.add_argument("--job-timeout", type=float, default=900.0, help="seconds one prompt may take")
    run.add_argument("--seed", type=int, default=1000, help="jobs get seeds after this one")
    run.add_argument("--commit", help="the checkout's commit, where git cannot tell (no .git on the machine)")
    run.add_argument("--written", type=Path, help="bench/full_size_files.py's --json, recorded with the results")
    table = sub.add_parser("table", help="print a results file as markdown")
    table.add_argument("results", type=Path)
    record = sub.add_parser("record", help="rewrite docs/performance/<card>-product-path.md with results (one card)")
    record.add_argument("results", type=Path, nargs="+")
    record.add_argument("--to", type=Path, default=PERFORMANCE_DIR, help="the folder of the record")
    check = sub.add_parser("targets", help="print the targets against results (one card)")
    check.add_argument("results", type=Path, nargs="+")
    sub.add_parser("integrity", help="what the load-time NaN/Inf check costs (its own options: integrity --help)")
    show = sub.add_parser("plan", help="print a plan, or one field of it")
    show.add_argument("name", choices=sorted(PLANS))
    show.add_argument("--field", choices=("comfyui", "description"))
    args = parser.parse_args()

    if args.command == "table":
        print(markdown(json.loads(args.results.read_text())))
        return 0
    if args.command == "targets":
        print(targets([json.loads(p.read_text()) for p in args.results]))
        return 0
    if args.command == "record":
        path = write_record(args.results, args.to)
        print(path.read_text())
        print(f"wrote {path}")
        return 0
    if args.command == "plan":
        plan = PLANS[args.name]
        if args.field:
            print(getattr(plan, args.field))
        else:
            print(f"{args.name}: ComfyUI {plan.comfyui}; {plan.description}")
            for spec in plan.servers:
                print(f"  server {spec.label} (caches {spec.caches}, args {' '.join(spec.args) or '-'}): {spec.jobs}")
        return 0

    if not (args.plan or args.jobs):
        parser.error("give --plan, --jobs or both (a plan's first server with these jobs)")
    if args.plan and args.jobs:
        plan_name, plan = args.plan, PLANS[args.plan]
        plan = Plan(plan.comfyui, (dataclasses.replace(plan.servers[0], jobs=args.jobs),),
                    description=f"{plan.description}; here only the jobs {args.jobs}")
    elif args.plan:
        plan_name, plan = args.plan, PLANS[args.plan]
    else:
        plan_name, plan = "jobs", Plan("any", (ServerSpec("jobs", args.jobs),), description=f"jobs {args.jobs}")
    for spec in plan.servers:
        try:
            parse_jobs(spec.jobs)
        except ValueError as err:  # a bad --jobs item, named, before anything starts
            parser.error(f"--jobs: {err}")
    args.comfyui = args.comfyui.resolve()
    args.work = (args.work or args.out.resolve().parent / "work").resolve()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    runner = Run(args, plan_name, plan)
    try:
        runner.run()
    finally:
        runner.sampler.stop()
        runner.save()
        table_text = markdown(runner.results)
        (args.out / "table.md").write_text(table_text)
        print("\n" + table_text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
