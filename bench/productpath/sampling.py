"""Memory sampling for bench/product_path.py: the card's memory (nvidia-smi) and a process tree's anonymous host
memory (/proc)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

GIB, MIB = 2**30, 2**20
SAMPLE_S = 0.25
"""Seconds between two memory samples."""


class MemorySampler:
    """GPU memory used on the card (nvidia-smi, every 0.25 s) and one process's anonymous host memory (/proc).

    Samples are ``(time, value)`` in wall-clock seconds, the clock of ComfyUI's timestamps; nvidia-smi's samples
    carry its own timestamps, so a late line still lands at the time it was taken.
    """

    def __init__(self, gpu: bool):
        self.gpu: list[tuple[float, float]] = []  # MiB used on GPU 0
        self.anon: list[tuple[float, float, float]] = []  # (t, server RssAnon bytes, tree RssAnon bytes)
        self.pid: int | None = None
        self._stop = threading.Event()
        self._smi: subprocess.Popen | None = None
        if gpu and shutil.which("nvidia-smi"):
            command = ["nvidia-smi", "-i", "0", "--query-gpu=timestamp,memory.used", "--format=csv,noheader,nounits",
                       "-lms", str(int(SAMPLE_S * 1000))]
            if shutil.which("stdbuf"):
                command = ["stdbuf", "-oL", *command]  # a line as soon as it is sampled
            self._smi = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            threading.Thread(target=self._read_smi, daemon=True).start()
        threading.Thread(target=self._read_proc, daemon=True).start()

    def _read_smi(self) -> None:
        for line in self._smi.stdout:
            stamp, _, used = line.strip().rpartition(",")
            try:
                when = datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
            except ValueError:
                when = time.time()
            with contextlib.suppress(ValueError):
                self.gpu.append((when, float(used)))

    def _read_proc(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            if self.pid is not None:
                own = rss_anon(self.pid)
                if own is not None:
                    self.anon.append((time.time(), own, own + sum(rss_anon(p) or 0 for p in descendants(self.pid))))

    def settle(self, t: float, timeout: float = 3.0) -> None:
        """Wait (at most ``timeout`` s) until the GPU samples reach time ``t``."""
        deadline = time.monotonic() + timeout
        while self._smi is not None and (not self.gpu or self.gpu[-1][0] < t) and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        if self._smi is not None:
            self._smi.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._smi.wait(timeout=5)

    @staticmethod
    def _last_before(samples: list, t: float, column: int = 1) -> float | None:
        found = None
        for sample in samples:
            if sample[0] > t:
                break
            found = sample[column]
        return found

    @staticmethod
    def _peak(samples: list, t0: float, t1: float, column: int = 1) -> float | None:
        values = [s[column] for s in samples if t0 <= s[0] <= t1]
        return max(values) if values else None

    def gpu_at(self, t: float) -> float | None:
        """MiB used on the card at ``t`` (the last sample before it)."""
        return self._last_before(self.gpu, t)

    def gpu_window(self, t0: float, t1: float, t_after: float) -> dict[str, float | None]:
        """MiB used: the last sample before ``t0``, the peak in [t0, max(t1, t_after)] (so it bounds the held
        reading), the last sample at ``t_after``."""
        if not self.gpu:
            return {}
        t1 = max(t1, t_after)
        return {"before_MiB": self._last_before(self.gpu, t0), "peak_MiB": self._peak(self.gpu, t0, t1),
                "held_MiB": self._last_before(self.gpu, t_after)}

    def anon_window(self, t0: float, t1: float, t_after: float) -> dict[str, float | None]:
        """GiB of the server's RssAnon: before, peak (up to the after reading, which it bounds), after; and the
        peak of its process tree's."""
        if not self.anon:
            return {}
        t1 = max(t1, t_after)
        gib = lambda v: None if v is None else round(v / GIB, 3)  # noqa: E731
        return {"before_GiB": gib(self._last_before(self.anon, t0)), "peak_GiB": gib(self._peak(self.anon, t0, t1)),
                "after_GiB": gib(self._last_before(self.anon, t_after)),
                "tree_peak_GiB": gib(self._peak(self.anon, t0, t1, column=2))}


def rss_anon(pid: int) -> int | None:
    """Anonymous resident memory of ``pid`` in bytes (``RssAnon`` of /proc/PID/status), None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (compile workers and the like), from /proc/*/stat."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def wait_steady(read: Callable[[], float | None], keep_waiting: Callable[[], bool], tolerance: float = 16.0,
                reads: int = 4, interval_s: float = 0.5, sleep: Callable[[float], None] = time.sleep) -> bool | None:
    """Read a value (e.g. a server's allocated MiB) every ``interval_s`` until it changed by under ``tolerance`` over
    ``reads`` reads in a row: True then; False once ``keep_waiting()`` says stop first; None when ``read`` returns
    None (nothing to read)."""
    last, steady = None, 0
    while keep_waiting():
        now = read()
        if now is None:
            return None
        steady = steady + 1 if last is not None and abs(now - last) < tolerance else 0
        if steady >= reads:
            return True
        last = now
        sleep(interval_s)
    return False
