"""A model built on a worker thread while the caller's thread does other work.

A first prompt needs the text encoder (loaded, then the prompt encoded) and the DiT (built from its file); the two
are independent until the first denoising step. :class:`BackgroundBuild` runs the DiT's build on a thread of its
own so that the text encoder's load and the encoding happen meanwhile on the caller's thread.

Only the build itself runs on the thread: reading the file, moving tensors to the device, quantizing. Whatever
talks to the host's memory manager (making room before, registering the model after) stays on the caller's
thread, which ComfyUI's memory manager expects. The heavy parts of a build (page-cache reads, host-to-device
copies, GPU kernels) release Python's GIL, so the two threads overlap; the build's kernels share the device's
default stream with the caller's, so their order on the GPU is the order they were issued in.

A cancelled build (the caller failed, or the user interrupted) stops between weight groups, and what it had built
is dropped before :meth:`BackgroundBuild.cancel` returns.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)


class BuildCancelledError(Exception):
    """Raised inside a build that was cancelled, between two of its weight groups."""


class BackgroundBuild:
    """Runs ``build(check_cancelled)`` on a daemon thread; :meth:`result` waits for what it returns.

    Args:
        label: the model's name, for the thread's name and the log.
        build: builds and returns the model; it calls ``check_cancelled()`` between weight groups (that raises
            :class:`BuildCancelledError` once :meth:`cancel` was called).
        device: the build's device; on CUDA the thread makes it the current device.

    Attributes:
        seconds: the build's own wall time, once it ended.
        waited_s: how long :meth:`result` blocked the caller (0 when the build had finished before).
    """

    def __init__(self, label: str, build: Callable[[Callable[[], None]], Any], device: torch.device):
        self.label = label
        self.device = torch.device(device)
        self.seconds: float | None = None
        self.waited_s = 0.0
        self._build = build
        self._cancelled = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"build {label}", daemon=True)

    def start(self) -> BackgroundBuild:
        self._thread.start()
        return self

    def _check_cancelled(self) -> None:
        if self._cancelled.is_set():
            raise BuildCancelledError(f"the build of {self.label} was cancelled")

    def _run(self) -> None:
        started = time.perf_counter()
        device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        try:
            with device:
                self._result = self._build(self._check_cancelled)
        except BaseException as exc:  # handed to the caller's thread by result()
            self._error = exc
        finally:
            self.seconds = time.perf_counter() - started

    def result(self, check_interrupt: Callable[[], None] = lambda: None, poll_s: float = 0.05) -> Any:
        """Wait for the build and return its model, or raise the build's own error.

        ``check_interrupt`` is called while waiting; when it raises, the build is cancelled (and its memory
        released) before the error goes on.
        """
        started = time.perf_counter()
        while self._thread.is_alive():
            self._thread.join(poll_s)
            try:
                check_interrupt()
            except BaseException:
                self.cancel()
                raise
        self.waited_s = time.perf_counter() - started
        error, self._error = self._error, None
        if error is not None:
            raise error
        module, self._result = self._result, None
        return module

    def cancel(self) -> None:
        """Stop the build at its next weight group, wait for the thread, and drop what it built."""
        self._cancelled.set()
        self._thread.join()
        self._result = self._error = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        logger.info("cancelled the build of %s; what it had built was dropped", self.label)
