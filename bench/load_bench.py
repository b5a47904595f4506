"""How fast the Sampler's first prompt loads its models from files in the page cache, part by part.

Reads the full-size files ``bench/full_size_files.py`` writes (the Comfy-Org single files in a ComfyUI models
folder) on the GPU and times, each after one untimed pass that puts the file in the page cache:

* the DiT's groups (60 blocks and the rest) read onto the GPU by safetensors' own reader (``load_tensors``, one
  group at a time) and by the staged reader (``checkpoints.staged_read``) at several thread counts;
* the DiT build of the fastest preset (fp8 row-wise, "attn+mlp+mod compute": ``dit_build.build_dit``);
* the text encoder: its file read into host memory (``load_text_encoder`` on the CPU), then its layers moved into
  page-locked memory for streaming (``LayerStreaming.add_all``) with one thread and with the runtime's count, then
  both as the runtime does them (``stream_layers``).

Run from the repo root on the GPU machine, with the pack's dependencies importable::

    python3 bench/load_bench.py MODELS_DIR [--threads 1,4,8,16]

Prints one table (seconds and GB/s per part) and writes it as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pack import load_pack

load_pack()

from full_size_files import DIT_FILES, FOLDERS, TEXT_ENCODER_FILE, VAE_FILE  # noqa: E402
from harness_forward import FASTEST_GEMM_KERNEL, FASTEST_PRESET  # noqa: E402
from qwen_edit_hopper.fp8 import Fp8Config  # noqa: E402
from qwen_edit_hopper.qwen_edit.checkpoints import resolve_single_files  # noqa: E402
from qwen_edit_hopper.qwen_edit.checkpoints.loader import load_text_encoder  # noqa: E402
from qwen_edit_hopper.qwen_edit.checkpoints.safetensors_io import load_tensors  # noqa: E402
from qwen_edit_hopper.qwen_edit.checkpoints.staged_read import read_groups  # noqa: E402
from qwen_edit_hopper.qwen_edit.dit_build import DitSource, build_dit  # noqa: E402
from qwen_edit_hopper.qwen_edit.runtime import text_encoder_units  # noqa: E402
from qwen_edit_hopper.qwen_edit.streaming import PIN_THREADS, LayerStreaming, stream_layers  # noqa: E402


def _card_used_gib(device: torch.device) -> float | None:
    """GPU memory in use on the card (the driver's count: PyTorch's pool included), GiB."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return round((total - free) / 2**30, 2)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(work) -> float:
    _sync()
    started = time.perf_counter()
    work()
    _sync()
    return time.perf_counter() - started


class _SafetensorsGroups:
    """A ``DitSource`` whose groups are read by safetensors' own reader, one tensor after another (the comparison)."""

    def __init__(self, source: DitSource):
        self.source = source

    def __getattr__(self, name: str):
        return getattr(self.source, name)

    def read_groups(self, groups, *, device, dtype):
        from qwen_edit_hopper.qwen_edit.checkpoints.scaled_fp8 import dequantize

        for group, spans in zip(groups, self.source.spans(groups), strict=True):
            tensors = {}
            for path in {span.path for span in spans}:
                names = {s.key: s.name for s in spans if s.path == path}
                tensors.update((names[k], t) for k, t in load_tensors(path, device=device, keys=list(names)).items())
            yield group, dequantize(tensors, dtype=dtype, source=self.source.path)


def _streamed_text_encoder(files, device: torch.device) -> torch.nn.Module:
    model = load_text_encoder(files, device="cpu")
    stream_layers(model, text_encoder_units(model), device)
    return model


def _safetensors_groups(source: DitSource, device: torch.device) -> int:
    total = 0
    for spans in source.spans(source.groups()):
        for path in {span.path for span in spans}:
            tensors = load_tensors(path, device=device, keys=[s.key for s in spans if s.path == path])
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
    return total


def _staged_groups(source: DitSource, device: torch.device, threads: int) -> int:
    total = 0
    for tensors in read_groups(source.spans(source.groups()), device=device, threads=threads):
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", type=Path, help="the ComfyUI models folder full_size_files.py wrote")
    parser.add_argument("--dit", choices=tuple(DIT_FILES), default="fp8")
    parser.add_argument("--threads", default="1,4,8,16", help="staged reader thread counts to time")
    parser.add_argument("--device", default="cuda", help="cuda; cpu rehearses the script on tiny files")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    files = resolve_single_files(args.models / FOLDERS["dit"] / DIT_FILES[args.dit],
                                 args.models / FOLDERS["text_encoder"] / TEXT_ENCODER_FILE,
                                 args.models / FOLDERS["vae"] / VAE_FILE)
    source = DitSource(files)
    dit_bytes = sum(span.info.nbytes for spans in source.spans(source.groups()) for span in spans)
    rows: list[dict] = []

    def row(part: str, seconds: float, nbytes: int) -> None:
        card = _card_used_gib(device)
        rows.append({"part": part, "s": round(seconds, 3), "GB": round(nbytes / 1e9, 2),
                     "GB/s": round(nbytes / 1e9 / seconds, 2), "card_used_GiB": card,
                     "torch_allocated_GiB": round(torch.cuda.memory_allocated() / 2**30, 2)
                     if device.type == "cuda" else None})
        print(f"  {part}: {seconds:.2f} s, card {card} GiB", flush=True)

    _staged_groups(source, device, 8)  # the file into the page cache, the CUDA context up
    row("DiT groups, safetensors load_tensors", _timed(lambda: _safetensors_groups(source, device)), dit_bytes)
    for threads in (int(t) for t in args.threads.split(",")):
        row(f"DiT groups, staged reader, {threads} threads",
            _timed(lambda threads=threads: _staged_groups(source, device, threads)), dit_bytes)
    config = Fp8Config(backend="scaled_mm_rowwise", preset=FASTEST_PRESET, gemm_kernel=FASTEST_GEMM_KERNEL,
                       emulate=device.type != "cuda")
    built: list = []
    for attempt, reader in enumerate(("staged", "safetensors", "staged")):
        built_from = source if reader == "staged" else _SafetensorsGroups(source)
        row(f"DiT build, fastest fp8 preset, {reader} reads (#{attempt + 1})",
            _timed(lambda: built.append(build_dit(built_from, device=device, fp8_config=config))),  # noqa: B023
            dit_bytes)
        built.clear()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    te_bytes = sum(Path(p).stat().st_size for p in files.text_encoder)
    load_text_encoder(files, device="cpu")  # page cache
    models = []
    row("text encoder file -> host tensors", _timed(lambda: models.append(load_text_encoder(files, device="cpu"))),
        te_bytes)
    if device.type == "cuda":
        for threads in (1, PIN_THREADS):
            model = models.pop() if models else load_text_encoder(files, device="cpu")
            streaming = LayerStreaming(device)
            row(f"text encoder layers -> page-locked memory, {threads} threads",
                _timed(lambda: streaming.add_all(text_encoder_units(model), threads)), te_bytes)  # noqa: B023
            streaming.remove()
            del model, streaming
            gc.collect()
        row("text encoder as the runtime builds it (file -> host tensors -> page-locked layers)",
            _timed(lambda: _streamed_text_encoder(files, device).layer_streaming.remove()), te_bytes)
    allocator = torch.cuda.get_allocator_backend() if device.type == "cuda" else "cpu"
    print(f"\nallocator: {allocator}; card GiB: in use on the card right after the part (before the next one's "
          "clean-up)\n\n| part | s | GB | GB/s | card GiB | torch GiB |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['part']} | {r['s']:.2f} | {r['GB']:.2f} | {r['GB/s']:.2f} | {r['card_used_GiB']} | "
              f"{r['torch_allocated_GiB']} |")
    if args.json:
        card = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        args.json.write_text(json.dumps({"card": card, "allocator": allocator, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
