"""The product-path tool end to end at the tiny sizes on the CPU: bench/full_size_files.py writes the files,
bench/product_path.py starts a real ComfyUI server with the pack (each ComfyUI version the run selects, run by its
own Python as on the GPU machine), queues shipped workflows and records what a user sees (times, the Sampler's
stages, host memory, survival), as it does at full size on the GPU machine."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from comfy_server import COMFYUI_DIR, COMFYUI_VERSIONS
from fixtures_models import empty_full_size_names

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from full_size_files import write_all  # noqa: E402
from productpath.record import markdown, summarize  # noqa: E402


def _tool(*args: str, timeout: float, python: Path | str = sys.executable,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([str(python), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def test_a_tiny_run_records_each_prompt_and_the_server(tmp_path: Path, comfyui_version: str):
    install = COMFYUI_VERSIONS[comfyui_version]
    models, out = tmp_path / "models", tmp_path / "out"
    # the tool and its server refuse and log any connection beyond this machine (tests/netguard)
    guard = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "tests" / "netguard"), os.environ.get("PYTHONPATH"))
                                           if p),
             "QWEN_EDIT_NETGUARD_LOG": str(tmp_path / "netguard.log")}
    (tmp_path / "w.json").write_text(json.dumps(write_all(models, size="tiny", loras=(), device="cpu")))
    printed = _tool("bench/product_path.py", "run", "--comfyui", str(install.directory), "--models", str(models),
                    "--out", str(out), "--work", str(tmp_path / "work"), "--jobs", "low_vram,low_vram:vary,free",
                    "--tiny", "--cpu", "--deadline", "900", "--written", str(tmp_path / "w.json"), timeout=900,
                    python=install.python, env=guard).stdout

    results = json.loads((out / "results.json").read_text())
    assert results["comfyui_version"] == comfyui_version and results["sizes"] == "tiny"
    assert results["files"]["dit"] == "qwen_image_edit_2509_fp8_e4m3fn.safetensors"
    assert results["written"]["files"]["text_encoder"]["bytes"] > 0
    (server,) = results["servers"]
    assert server["start_s"] > 0 and server["idle"]["anon_GiB"] > 0.1 and server["alive_at_end"] is True
    assert "--cpu" in server["command"] and "--disable-cuda-malloc" not in server["command"]
    first, second, free = server["jobs"]
    for job in (first, second):
        assert job["ok"] and job["survived"], job
        assert job["queue_to_image_s"] >= job["exec_s"] > 0
        assert job["stages"]["denoise_s"] > 0 and job["stages"]["s_per_step"] > 0 and job["stages"]["total_s"] > 0
        assert job["host"]["peak_GiB"] >= job["host"]["after_GiB"] > 0
        assert all(Path(p).is_file() for p in job["images"]) and job["images"]
    assert free["ok"] and free["survived"]
    assert second["seed"] != first["seed"] and second["prompt_text"] != first["prompt_text"]
    assert not second["first_on_server"] and first["first_on_server"]
    summary = results["summary"]["servers"][0]
    assert summary["first_image_s"] > server["start_s"] and summary["jobs_ok"] == 3
    table = (out / "table.md").read_text()
    assert "| jobs | 1 | low_vram | yes |" in table and table.strip() in printed
    assert (out / "server-1.log").read_text().count("Prompt executed in") == 2
    assert not (tmp_path / "netguard.log").exists()


def test_a_deadline_too_short_skips_the_server_and_still_writes_results(tmp_path: Path):
    models = empty_full_size_names(tmp_path / "models")
    _tool("bench/product_path.py", "run", "--comfyui", str(COMFYUI_DIR), "--models", str(models), "--out",
          str(tmp_path / "out"), "--jobs", "fastest", "--tiny", "--cpu", "--deadline", "20", timeout=120)
    (server,) = json.loads((tmp_path / "out" / "results.json").read_text())["servers"]
    assert "skipped" in server and server["jobs"] == []


def test_a_bad_lora_option_is_refused_by_name_before_anything_starts(tmp_path: Path):
    models = empty_full_size_names(tmp_path / "models")
    result = subprocess.run([sys.executable, "bench/product_path.py", "run", "--comfyui", str(COMFYUI_DIR),
                             "--models", str(models), "--out", str(tmp_path / "out"), "--jobs",
                             "low_vram,comfy_model_fp8:strength=strong", "--tiny", "--cpu"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "--jobs: job 'comfy_model_fp8:strength=strong': strength='strong' is not a number" in result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


def test_a_run_killed_after_its_first_prompt_leaves_its_results_and_the_servers_log(tmp_path: Path):
    """The GPU machine's call limit kills the tool and its server at once: what ran so far is kept in --out."""
    models, out = tmp_path / "models", tmp_path / "out"
    (tmp_path / "w.json").write_text(json.dumps(write_all(models, size="tiny", loras=(), device="cpu")))
    tool = subprocess.Popen(
        [sys.executable, "bench/product_path.py", "run", "--comfyui", str(COMFYUI_DIR), "--models", str(models),
         "--out", str(out), "--work", str(tmp_path / "work"), "--jobs", "low_vram*3", "--tiny", "--cpu",
         "--deadline", "900", "--written", str(tmp_path / "w.json")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    printed = []
    try:
        for line in tool.stdout:
            printed.append(line)
            if line.startswith("[jobs 2]"):  # the second prompt has begun: kill the tool and its server together
                break
    finally:
        os.killpg(tool.pid, signal.SIGKILL)
        tool.wait(timeout=60)
        # the server runs in a process group of its own ("ready in ... (pid N)"); the device machine ends with the call
        for pid in re.findall(r"ready in [\d.]+ s \(pid (\d+)\)", "".join(printed)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(pid), signal.SIGKILL)
    assert any(line.startswith("  ok=True") for line in printed), "".join(printed)[-4000:]
    results = json.loads((out / "results.json").read_text())
    (server,) = results["servers"]
    first, second = server["jobs"]
    assert first["job"] == second["job"] == "low_vram" and first["ok"] and "unfinished" not in first
    assert second["unfinished"] and not second["ok"] and second["error"].startswith("unfinished")
    assert (out / "server-1.log").read_text().count("Prompt executed in") == 1
    results["summary"] = summarize(results)
    (series,) = results["summary"]["series"]
    assert (series["ok"], series["failed"], series["survived_all"]) == (1, 1, True)
    assert "| jobs | 2 | low_vram | no |" in markdown(results) and "unfinished: the run stopped" in markdown(results)
