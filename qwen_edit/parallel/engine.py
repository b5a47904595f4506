"""The driver's side: starts one worker process per rank, sends each edit, relays progress, interrupt and errors.

The driver (ComfyUI's process, or any Python process) never joins the collectives, so a worker that hangs or dies
cannot block it: it waits on the workers' connections and processes with a short timeout, and

* a worker that exits ends the prompt with :class:`WorkerDiedError` naming its rank, device and exit code; the other
  workers are stopped, and the next edit starts a new group;
* an error in a worker ends the prompt with :class:`WorkerError` (its type, message and traceback); when not every
  rank reported it (the others may wait in a collective) the group is stopped too;
* an interrupt (``callbacks.check_interrupt`` raising in the driver) is sent to every rank; they stop at the same
  step (:mod:`.worker`), and the driver re-raises the interrupt.

Workers are plain processes of the driver's Python (``subprocess``, ``worker_main.py``), connected by
``multiprocessing.connection`` over a Unix socket with a random key; see the decision record on the parallel engine
for why not Ray or ``torch.multiprocessing``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Listener, wait
from pathlib import Path

import torch

from ..sampling import Callbacks
from .layout import ParallelChoice

logger = logging.getLogger(__name__)

__all__ = ["ParallelEngine", "WorkerDiedError", "WorkerError", "engine_for", "stop_engine"]

START_TIMEOUT_S = 300.0
"""Seconds the workers get to import, join the group and report ready."""

POLL_S = 0.1

PACK_ROOT = Path(__file__).resolve().parents[2]
PACK_NAME = __name__.rsplit(".qwen_edit.", 1)[0]


class WorkerError(RuntimeError):
    """A worker raised; the message says which rank and what it raised."""


class WorkerDiedError(RuntimeError):
    """A worker process exited while the driver needed it."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _exit_text(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


class ParallelEngine:
    """A group of worker processes for one :class:`.layout.ParallelChoice` on one device kind ("cuda"/"cpu").

    ``dtype``: the compute dtype of the workers' runtimes (the driver's). Start costs one Python start per rank
    (imports) plus the group's rendezvous; models load on the first edit and stay loaded.
    """

    def __init__(self, layout: ParallelChoice, device_kind: str, dtype: torch.dtype):
        self.layout, self.device_kind, self.dtype = layout, device_kind, dtype
        self._dir = tempfile.mkdtemp(prefix="qwen-edit-parallel-")
        self._authkey = secrets.token_bytes(32)
        self._listener = Listener(os.path.join(self._dir, "driver.sock"), family="AF_UNIX", authkey=self._authkey)
        self.procs: list[subprocess.Popen] = []
        self.conns: dict[int, object] = {}
        self.notes: list[str] = []
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def device_name(self, rank: int) -> str:
        return f"cuda:{self.layout.devices[rank]}" if self.device_kind == "cuda" else "cpu"

    def _start(self) -> None:
        dist_init = f"tcp://127.0.0.1:{_free_port()}"
        for rank in range(self.layout.world):
            settings = {"address": self._listener.address, "rank": rank, "cfg": self.layout.cfg,
                        "ulysses": self.layout.ulysses, "gpus": list(self.layout.gpus), "dist_init": dist_init,
                        "device": self.device_name(rank), "dtype": str(self.dtype).removeprefix("torch."),
                        "pack_name": PACK_NAME, "pack_root": str(PACK_ROOT), "sys_path": sys.path}
            proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("worker_main.py")),
                                     json.dumps(settings)], stdin=subprocess.PIPE, text=True)
            proc.stdin.write(self._authkey.hex() + "\n")
            proc.stdin.close()
            self.procs.append(proc)
        accepted: list = []
        accepting = threading.Thread(target=self._accept, args=(accepted,), daemon=True)
        accepting.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = set(range(self.layout.world))
        while pending:
            self._check_alive("starting")
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"parallel workers did not start within {START_TIMEOUT_S:.0f} s "
                                      f"(ranks {sorted(pending)} not ready); see the server log")
            for conn in list(accepted):
                if conn.poll():
                    message = pickle.loads(conn.recv_bytes())
                    if message[0] == "ready":
                        self.conns[message[1]] = conn
                        pending.discard(message[1])
                        accepted.remove(conn)
            time.sleep(POLL_S)
        logger.info("parallel workers ready: %s", self.layout.describe())

    def _accept(self, accepted: list) -> None:
        for _ in range(self.layout.world):
            try:
                accepted.append(self._listener.accept())
            except OSError:
                return

    def _check_alive(self, doing: str) -> None:
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                self.close()
                raise WorkerDiedError(
                    f"parallel worker rank {rank} ({self.device_name(rank)}) stopped while {doing} "
                    f"({_exit_text(code)}); the other workers were stopped and the next edit starts new ones "
                    "(see the server log for the worker's output)")

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(proc.poll() is None for proc in self.procs) and len(self.conns) == \
            self.layout.world

    def run(self, job: dict, callbacks: Callbacks | None = None) -> tuple[torch.Tensor, list[str]]:
        """Send ``job`` (:func:`.worker.job`) to every rank; returns rank 0's latents (CPU) and its notes.

        ``callbacks.on_step`` gets rank 0's progress; ``callbacks.check_interrupt`` is polled while waiting.
        """
        callbacks = callbacks or Callbacks()
        payload = pickle.dumps(("job", job))
        for conn in self.conns.values():
            conn.send_bytes(payload)
        finished: dict[int, tuple] = {}
        interrupt: BaseException | None = None
        error_deadline = None
        while len(finished) < self.layout.world:
            ready = wait([c for r, c in self.conns.items() if r not in finished], timeout=POLL_S)
            for conn in ready:
                try:
                    message = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self._check_alive("denoising")
                    continue
                if message[0] == "step":
                    callbacks.on_step(message[1], message[2], message[3])
                elif message[0] in ("done", "interrupted", "error"):
                    finished[message[1]] = message
                    if message[0] == "error" and error_deadline is None:
                        error_deadline = time.monotonic() + 5.0
            self._check_alive("denoising")
            if interrupt is None:
                try:
                    callbacks.check_interrupt()
                except BaseException as exc:  # the host's interrupt exception, re-raised below
                    interrupt = exc
                    for conn in self.conns.values():
                        conn.send_bytes(pickle.dumps(("interrupt",)))
            if error_deadline is not None and time.monotonic() > error_deadline:
                break
        errors = [m for m in finished.values() if m[0] == "error"]
        if errors:
            rank, kind, text, trace = errors[0][1:]
            logger.error("parallel worker rank %d failed:\n%s", rank, trace)
            if len(finished) < self.layout.world:
                self.close()
            raise WorkerError(f"parallel worker rank {rank} ({self.device_name(rank)}) failed: {kind}: {text}")
        if interrupt is not None:
            raise interrupt
        _, _, latents, notes = finished[0]
        return latents, notes

    def close(self) -> None:
        """Stop the workers (politely, then by force) and remove the socket."""
        for conn in self.conns.values():
            with contextlib.suppress(OSError):
                conn.send_bytes(pickle.dumps(("stop",)))
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()
        self.procs.clear()
        self._listener.close()
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)


_ENGINE: ParallelEngine | None = None
_ENGINE_LOCK = threading.Lock()


def engine_for(layout: ParallelChoice, device_kind: str, dtype: torch.dtype) -> ParallelEngine:
    """The process's engine for this layout (kept between edits; another layout, or a dead group, starts anew)."""
    global _ENGINE
    with _ENGINE_LOCK:
        engine = _ENGINE
        if engine is not None and (engine.layout, engine.device_kind, engine.dtype) == (layout, device_kind, dtype) \
                and engine.alive:
            return engine
        if engine is not None:
            engine.close()
            _ENGINE = None
        _ENGINE = ParallelEngine(layout, device_kind, dtype)
        return _ENGINE


def stop_engine() -> None:
    """Stop the process's workers (their models go with them)."""
    global _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is not None:
            _ENGINE.close()
            _ENGINE = None
