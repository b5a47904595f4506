"""How fast the Sampler's first prompt loads its models from files in the page cache, part by part.

Reads the full-size files ``bench/full_size_files.py`` writes (the Comfy-Org single files in a ComfyUI models
folder) on the GPU and times, each after one untimed pass that puts the file in the page cache:

* the DiT's groups (60 blocks and the rest) read onto the GPU by safetensors' own reader (``load_tensors``, one
  group at a time) and by the staged reader (``checkpoints.staged_read``) at several thread counts;
* the DiT build of the fastest preset (fp8 row-wise, "attn+mlp+mod compute": ``dit_build.build_dit``);
* the text encoder: its file read into host memory (``load_text_encoder`` on the CPU), then its layers moved into
  page-locked memory for streaming (``stream_layers``).

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
from qwen_edit_hopper.qwen_edit.streaming import stream_layers  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(work) -> float:
    _sync()
    started = time.perf_counter()
    work()
    _sync()
    return time.perf_counter() - started


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
        rows.append({"part": part, "s": round(seconds, 3), "GB": round(nbytes / 1e9, 2),
                     "GB/s": round(nbytes / 1e9 / seconds, 2)})
        print(f"  {part}: {seconds:.2f} s", flush=True)

    _staged_groups(source, device, 8)  # the file into the page cache, the CUDA context up
    row("DiT groups, safetensors load_tensors", _timed(lambda: _safetensors_groups(source, device)), dit_bytes)
    for threads in (int(t) for t in args.threads.split(",")):
        row(f"DiT groups, staged reader, {threads} threads",
            _timed(lambda threads=threads: _staged_groups(source, device, threads)), dit_bytes)
    config = Fp8Config(backend="scaled_mm_rowwise", preset=FASTEST_PRESET, gemm_kernel=FASTEST_GEMM_KERNEL,
                       emulate=device.type != "cuda")
    built: list = []
    for attempt in range(2):
        row(f"DiT build, fastest fp8 preset (#{attempt + 1})",
            _timed(lambda: built.append(build_dit(source, device=device, fp8_config=config))), dit_bytes)
        built.clear()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    te_bytes = sum(Path(p).stat().st_size for p in files.text_encoder)
    load_text_encoder(files, device="cpu")  # page cache
    models = []
    row("text encoder file -> host tensors", _timed(lambda: models.append(load_text_encoder(files, device="cpu"))),
        te_bytes)
    model = models.pop()
    if device.type == "cuda":
        row("text encoder layers -> page-locked memory",
            _timed(lambda: stream_layers(model, text_encoder_units(model), device)), te_bytes)
    print("\n| part | s | GB | GB/s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['part']} | {r['s']:.2f} | {r['GB']:.2f} | {r['GB/s']:.2f} |")
    if args.json:
        card = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        args.json.write_text(json.dumps({"card": card, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
