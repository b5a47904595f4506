"""Read groups of safetensors tensors with several reader threads, through a staging buffer, the next group read
while the caller works on this one.

``load_tensors`` (safetensors' ``safe_open``) copies each tensor out of the memory-mapped file into a new host
tensor, then to the device from pageable memory, one tensor after another. For the 20.4 GB fp8 DiT that measured
7.7 s on an H200 host with the file in the page cache (2.6 GB/s). Here:

* a group's tensors (one DiT block: 0.34 GB in fp8, 0.68 GB in bf16) are read with ``os.preadv`` by
  :data:`READER_THREADS` threads, in chunks of at most :data:`CHUNK_BYTES`, into one staging buffer; on CUDA it is
  page-locked (``cudaHostRegister``, as :class:`~qwen_edit.streaming.HostArena`), so the copies to the device run
  at full bus speed and asynchronously;
* two staging buffers alternate: while the caller dequantizes, fuses and quantizes group ``i``, the threads read
  group ``i + 1`` (``os.preadv`` releases the GIL); the copies of a group to the device are waited for before the
  caller gets it (see :meth:`_Reads.tensors` for why);
* each tensor is copied into its own device tensor (it owns its memory: nothing keeps the staging buffer alive).

Host memory: two buffers of the largest group (about 0.7 GB for the fp8 DiT, 1.4 GB for bf16), released when the
iteration ends, early or not. Every tensor gets the same checks as ``load_tensors``: floating dtypes from the
header before any read, NaN/Inf on the device with one synchronization per group, errors naming the file.

Byte order: safetensors stores little-endian values; the tensors are viewed in place, so this reader needs a
little-endian host (``sys.byteorder``; every CUDA host is).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError
from .integrity import FiniteCheck, check_float_dtypes, raise_if_nonfinite
from .safetensors_io import SafetensorsHeader, TensorInfo

logger = logging.getLogger(__name__)

READER_THREADS = 8
"""Threads reading one group (page-cache copies scale with threads up to the memory bus; NVMe wants a queue)."""

CHUNK_BYTES = 16 << 20
"""Largest single ``preadv``: a 75 MB bf16 weight is read by several threads at once."""

ALIGN = 256
"""Byte alignment of each tensor in a staging buffer."""

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
"""safetensors dtype name -> torch dtype, for the floating dtypes this pack's weights use."""


@dataclass(frozen=True)
class Span:
    """One tensor to read: where it is in which file, and the name the caller gives it.

    Attributes:
        path: the file.
        key: the tensor's name in the file.
        name: the name it gets in the result.
        info: its header entry (dtype, shape, offsets in the data block).
        offset: its first byte in the file.
    """

    path: Path
    key: str
    name: str
    info: TensorInfo
    offset: int


def data_start(header: SafetensorsHeader) -> int:
    """The file offset of the data block: validated headers end their last tensor exactly at the end of the file."""
    return header.file_size - max((info.data_offsets[1] for info in header.tensors.values()), default=0)


def spans_of(header: SafetensorsHeader, names: dict[str, str]) -> list[Span]:
    """Spans of ``names`` (key in the file -> name in the result) of one validated file, in file order."""
    start = data_start(header)
    spans = [Span(header.path, key, name, header.tensors[key], start + header.tensors[key].data_offsets[0])
             for key, name in names.items()]
    return sorted(spans, key=lambda span: (str(span.path), span.offset))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def group_bytes(spans: Sequence[Span]) -> int:
    """Staging bytes a group needs (each tensor aligned)."""
    return sum(_aligned(span.info.nbytes) for span in spans)


class _Staging:
    """One staging buffer: plain host memory, page-locked on CUDA."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device = device
        if device.type == "cuda":
            from ..streaming import HostArena

            self.arena = HostArena(nbytes)
            self.buffer = self.arena.buffer
        else:
            self.arena = None
            self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self.view = memoryview(self.buffer.numpy())

    def release(self) -> None:
        self.view.release()
        if self.arena is not None:
            self.arena.release()


def _read_chunk(fd: int, view: memoryview, offset: int, span: Span) -> None:
    while len(view):
        got = os.preadv(fd, [view], offset)
        if got <= 0:
            raise CheckpointError(span.path, f"ended while tensor {span.key!r} was read (the file shrank or is "
                                  "truncated).", "Download or copy the file again.")
        view, offset = view[got:], offset + got


class _Reads:
    """The reads of one group into one staging buffer, in flight on the thread pool."""

    def __init__(self, pool: ThreadPoolExecutor, fds: dict[Path, int], spans: Sequence[Span], staging: _Staging,
                 chunk_bytes: int):
        self.spans = spans
        self.staging = staging
        self.places: list[int] = []
        self.futures: list[tuple[Future, Span]] = []
        place = 0
        for span in spans:
            self.places.append(place)
            for begin in range(0, span.info.nbytes, chunk_bytes):
                size = min(chunk_bytes, span.info.nbytes - begin)
                chunk = staging.view[place + begin:place + begin + size]
                self.futures.append((pool.submit(_read_chunk, fds[span.path], chunk, span.offset + begin, span), span))
            place += _aligned(span.info.nbytes)

    def wait(self) -> None:
        """Block until every chunk is in the buffer; the first read error is raised (a CheckpointError, or an
        OSError turned into one naming the file)."""
        for future, span in self.futures:
            try:
                future.result()
            except OSError as exc:
                raise CheckpointError(span.path, f"could not be read ({exc}).",
                                      "Check the disk and the file, or copy the file again.") from exc

    def cancel(self) -> None:
        """Cancel the reads not started and wait for the running ones (the buffer must outlive them)."""
        for future, _ in self.futures:
            future.cancel()
        for future, _ in self.futures:
            if not future.cancelled():
                future.exception()

    def tensors(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Each tensor of the group copied from the buffer into its own tensor on ``device`` (the copies are
        finished when this returns: the buffer can take the next group), checked for NaN/Inf there."""
        out: dict[str, torch.Tensor] = {}
        checks: dict[Path, FiniteCheck] = {}
        for span, place in zip(self.spans, self.places, strict=True):
            dtype = TORCH_DTYPES[span.info.dtype]
            stored = self.staging.buffer[place:place + span.info.nbytes].view(dtype).view(span.info.shape)
            tensor = torch.empty(span.info.shape, dtype=dtype, device=device)
            tensor.copy_(stored, non_blocking=device.type == "cuda")
            out[span.name] = tensor
            checks.setdefault(span.path, FiniteCheck()).add(span.key, tensor)
        if device.type == "cuda":
            # Waited for here, not left in flight: under cudaMallocAsync (ComfyUI's default allocator) letting the
            # copies run ahead of the next allocations left up to 5 GiB more on the card after the full-size build
            # than the tensors it kept (bench/card_memory_probe.py); they take about 10 ms a group.
            torch.cuda.current_stream(device).synchronize()
        try:
            for path, check in checks.items():
                raise_if_nonfinite(check, source=path)
        except BaseException:
            out.clear()
            raise
        return out


def check_spans(spans: Sequence[Span]) -> None:
    """Refuse, before any read, a span whose dtype is not a floating one this reader knows (naming its file)."""
    by_file: dict[Path, dict[str, str]] = {}
    for span in spans:
        by_file.setdefault(span.path, {})[span.key] = span.info.dtype
    for path, dtypes in by_file.items():
        check_float_dtypes(dtypes, source=path)
        unknown = {key: dtype for key, dtype in dtypes.items() if dtype not in TORCH_DTYPES}
        if unknown:
            key, dtype = next(iter(unknown.items()))
            raise CheckpointError(path, f"holds tensor {key!r} in {dtype}, a dtype these models' weights never use.",
                                  "Pick the bf16 or fp8 .safetensors release of this model.")


def read_groups(groups: Sequence[Sequence[Span]], *, device: torch.device | str,
                threads: int = READER_THREADS, chunk_bytes: int = CHUNK_BYTES) -> Iterator[dict[str, torch.Tensor]]:
    """Yield each group's tensors (name -> tensor on ``device``, in the file's dtype), reading the next group while
    the caller holds this one. ``threads`` and ``chunk_bytes`` shape the reads, never the result.

    Closing the iterator early (an error, an interrupt) waits for reads in flight and device copies, then frees the
    staging buffers: nothing stays behind.

    Raises:
        CheckpointError: a dtype that is not a float weight's (before any read), a file that cannot be read or
            ends early, a tensor with NaN or Inf; naming the file.
    """
    if threads < 1 or chunk_bytes < 1:
        raise ValueError(f"threads and chunk_bytes must be positive, got {threads} and {chunk_bytes}")
    if sys.byteorder != "little":
        raise RuntimeError("the staged safetensors reader needs a little-endian host")
    device = torch.device(device)
    for spans in groups:
        check_spans(spans)
    if not groups:
        return
    size = max(group_bytes(spans) for spans in groups)
    paths = sorted({span.path for spans in groups for span in spans}, key=str)
    fds: dict[Path, int] = {}
    stagings: list[_Staging] = []
    pending: _Reads | None = None
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="qwen-edit-read")
    try:
        for path in paths:
            try:
                fds[path] = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise CheckpointError(path, f"could not be opened ({exc}).", "Check the path and its "
                                      "permissions.") from exc
        stagings = [_Staging(size, device) for _ in range(min(2, len(groups)))]
        pending = _Reads(pool, fds, groups[0], stagings[0], chunk_bytes)
        for index in range(len(groups)):
            current = pending
            current.wait()
            pending = None
            if index + 1 < len(groups):
                following = stagings[(index + 1) % len(stagings)]  # its copies finished in its group's tensors()
                pending = _Reads(pool, fds, groups[index + 1], following, chunk_bytes)
            yield current.tensors(device)
    finally:
        if pending is not None:
            pending.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        for staging in stagings:
            staging.release()
        for fd in fds.values():
            os.close(fd)
