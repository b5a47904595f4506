"""Write random-weight Qwen-Image-Edit-2509 files in the layouts users download, at full size, in about a minute.

The files are the Comfy-Org single files and the Lightning LoRA, under a ComfyUI ``models`` folder::

    diffusion_models/qwen_image_edit_2509_fp8_e4m3fn.safetensors   every 2-D weight float8_e4m3fn (no scale),
                                                                   1-D tensors bf16 (20.4 GB)
    diffusion_models/qwen_image_edit_2509_bf16.safetensors         with --dit bf16 instead (40.9 GB; the GPU
                                                                   machine's 64 GB disk holds one DiT at a time)
    text_encoders/qwen_2.5_vl_7b_fp8_scaled.safetensors            ComfyUI's fp8_scaled form: 2-D linear weights
                                                                   float8_e4m3fn with a float32 per-tensor
                                                                   ``scale_weight``, the ``scaled_fp8`` marker, the
                                                                   rest bf16, no lm_head (8.3 GB)
    vae/qwen_image_vae.safetensors                                 bf16, ComfyUI's Wan-VAE key names (0.25 GB)
    loras/Qwen-Image-Edit-2509-Lightning-{4,8}steps-V1.0-bf16.safetensors
                                                                   lightx2v layout (``<m>.lora_down.weight`` [r, in],
                                                                   ``<m>.lora_up.weight`` [out, r], ``<m>.alpha``) on
                                                                   every 2-D weight of ``transformer_blocks``, rank 64
                                                                   (the published rank; 1.2 GB each)

Key names and shapes come from the pack's own modules built on ``meta`` (``create_dit``, ``create_text_encoder``
+ ``hf_key``, ``create_vae`` + ``diffusers_to_comfy_keys``), at the released sizes (bench/harness_models.py's
``configs``) or, with ``--tiny``, at the test sizes of qwen_edit/tiny.py. Values follow the harness's rule
(harness_models.random_fill_: fan-in scaled Gaussians, modulation and ``norm_out`` x0.1, norms 1, biases 0), each
tensor from its own seeded generator, so a file is the same whatever device wrote it. Timings measured on these
files are valid; images are noise.

Each tensor is drawn on the device (``cuda`` by default when there is one: 30 GB of Gaussians take seconds there),
cast, copied to the host and appended to the file by a writer thread after a hand-written safetensors header;
host memory holds at most a few tensors (the largest, the 1.1 GB token embedding). Tensors are laid out as
safetensors' own writer lays them out (larger elements first, then by name), so every tensor is aligned.

    python3 bench/full_size_files.py MODELS [--dit fp8|bf16] [--loras 4,8] [--lora-rank 64] [--json PATH]
    python3 bench/full_size_files.py MODELS --tiny        # test sizes, on the CPU, in seconds
"""

from __future__ import annotations

import argparse
import json
import math
import queue
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from harness_models import FULL, TINY, configs, random_fill_

DIT_FILES = {"fp8": "qwen_image_edit_2509_fp8_e4m3fn.safetensors", "bf16": "qwen_image_edit_2509_bf16.safetensors"}
TEXT_ENCODER_FILE = "qwen_2.5_vl_7b_fp8_scaled.safetensors"
VAE_FILE = "qwen_image_vae.safetensors"
LORA_FILES = {4: "Qwen-Image-Edit-2509-Lightning-4steps-V1.0-bf16.safetensors",
              8: "Qwen-Image-Edit-2509-Lightning-8steps-V1.0-bf16.safetensors"}
FOLDERS = {"dit": "diffusion_models", "text_encoder": "text_encoders", "vae": "vae", "lora": "loras"}
FP8_MAX = 448.0
"""Largest float8_e4m3fn value: ComfyUI's fp8_scaled scale is ``amax / 448`` per tensor."""
LORA_UP_SCALE = 0.1
"""LoRA up factors are drawn 10x smaller than the fan-in rule: each delta stays well below its weight."""
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3"}
IN_FLIGHT = 4
"""Tensors queued between the generating and the writing thread (bounds host memory)."""

Draw = Callable[[torch.Generator, torch.device], torch.Tensor]
"""Makes one tensor of its planned dtype and shape on the given device, from the given generator."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its stored name, dtype, shape and how to draw it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    draw: Draw
    seed_key: str = ""
    """Whose seed the generator gets (default: this tensor's name; a ``scale_weight`` takes its weight's)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def safetensors_order(entries: list[Entry]) -> list[Entry]:
    """Larger elements first, then by name (safetensors' own order): every tensor starts aligned."""
    return sorted(entries, key=lambda e: (-torch.empty((), dtype=e.dtype).element_size(), e.name))


def write_file(path: Path, entries: list[Entry], device: torch.device, seed: int) -> dict:
    """Write ``entries`` to ``path`` as one safetensors file; return bytes, tensors and seconds.

    Each tensor is drawn on ``device`` from a generator seeded by ``seed`` and its ``seed_key`` (or name); the
    header goes first, then each tensor's bytes as soon as it is drawn.
    """
    started = time.perf_counter()
    entries = safetensors_order(entries)
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        header[entry.name] = {"dtype": SAFETENSORS_DTYPES[entry.dtype], "shape": list(entry.shape),
                              "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    pending: queue.Queue = queue.Queue(maxsize=IN_FLIGHT)
    failure: list[BaseException] = []

    def drain(handle) -> None:
        try:
            while (chunk := pending.get()) is not None:
                handle.write(memoryview(chunk.numpy()))
        except BaseException as exc:  # handed to the generating thread
            failure.append(exc)
            while pending.get() is not None:
                pass

    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(blob)) + blob)
        writer = threading.Thread(target=drain, args=(handle,), daemon=True)
        writer.start()
        try:
            for entry in entries:
                key = (entry.seed_key or entry.name).encode()
                generator = torch.Generator(device=device).manual_seed(seed * 2**32 + zlib.crc32(key))
                tensor = entry.draw(generator, device)
                if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
                    raise RuntimeError(f"{entry.name}: drew {tensor.dtype} {tuple(tensor.shape)}, "
                                       f"planned {entry.dtype} {entry.shape}")
                pending.put(tensor.contiguous().reshape(-1).view(torch.uint8).cpu())
                if failure:
                    break
        finally:
            pending.put(None)
            writer.join()
    if failure:
        raise RuntimeError(f"writing {path} failed: {failure[0]!r}") from failure[0]
    size = path.stat().st_size
    if size != 8 + len(blob) + offset:
        raise RuntimeError(f"{path}: {size} bytes written, {8 + len(blob) + offset} planned")
    return {"path": str(path), "bytes": size, "tensors": len(entries),
            "seconds": round(time.perf_counter() - started, 2)}


def _shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items()}


def _random(name: str, shape: tuple[int, ...], dtype: torch.dtype, scale: float = 1.0) -> Draw:
    """``random_fill_``'s rule for a parameter called ``name`` (the DiffSynth name), times ``scale``, as ``dtype``."""

    def draw(generator: torch.Generator, device: torch.device) -> torch.Tensor:
        work = torch.float32 if dtype == torch.float32 else torch.bfloat16
        tensor = random_fill_(name, torch.empty(shape, dtype=work, device=device), generator)
        if scale != 1.0:
            tensor.mul_(scale)
        return tensor.to(dtype)

    return draw


def dit_entries(dit_config, weights: str) -> list[Entry]:
    """The Comfy-Org DiT file: DiffSynth names; ``weights`` "fp8" casts every 2-D ``.weight`` to e4m3 (no scale)."""
    from qwen_edit_hopper.qwen_edit.checkpoints.dit import create_dit

    entries = []
    for name, shape in _shapes(create_dit(dit_config)).items():
        fp8 = weights == "fp8" and len(shape) == 2 and name.endswith(".weight")
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        entries.append(Entry(name, dtype, shape, _random(name, shape, dtype)))
    return entries


def _scaled_fp8(name: str, shape: tuple[int, ...]) -> tuple[Draw, Draw]:
    """Draws of an fp8_scaled weight and of its ``scale_weight`` from the same seed: the weight as drawn by
    :func:`_random`, divided by ``scale = amax / 448`` and cast to e4m3; the scale as float32 ``[]``."""
    raw = _random(name, shape, torch.float32)

    def scaled(generator: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        weight = raw(generator, device)
        return weight, weight.abs().amax().clamp(min=1e-12) / FP8_MAX

    def draw_weight(generator: torch.Generator, device: torch.device) -> torch.Tensor:
        weight, scale = scaled(generator, device)
        return (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)

    def draw_scale(generator: torch.Generator, device: torch.device) -> torch.Tensor:
        return scaled(generator, device)[1].reshape(())

    return draw_weight, draw_scale


def text_encoder_entries(text_config) -> list[Entry]:
    """ComfyUI's fp8_scaled Qwen2.5-VL file: Hugging Face names, no lm_head, 2-D linear weights (not the token
    embedding) e4m3 with a float32 ``scale_weight`` each, the ``scaled_fp8`` marker, the rest bf16."""
    from qwen_edit_hopper.qwen_edit.checkpoints.scaled_fp8 import MARKER_KEY
    from qwen_edit_hopper.qwen_edit.checkpoints.text_encoder import LM_HEAD, create_text_encoder, hf_key

    entries = [Entry(MARKER_KEY, torch.float8_e4m3fn, (0,),
                     lambda generator, device: torch.empty(0, dtype=torch.float8_e4m3fn, device=device))]
    for name, shape in _shapes(create_text_encoder(text_config)).items():
        stored = hf_key(name)
        if stored == LM_HEAD:
            continue
        if len(shape) == 2 and stored.endswith(".weight") and "embed_tokens" not in stored:
            draw_weight, draw_scale = _scaled_fp8(name, shape)
            entries.append(Entry(stored, torch.float8_e4m3fn, shape, draw_weight))
            entries.append(Entry(stored[: -len("weight")] + "scale_weight", torch.float32, (), draw_scale,
                                 seed_key=stored))
        else:
            entries.append(Entry(stored, torch.bfloat16, shape, _random(name, shape, torch.bfloat16)))
    return entries


def vae_entries(vae_config) -> list[Entry]:
    """ComfyUI's Wan-VAE file, bf16."""
    from qwen_edit_hopper.qwen_edit.checkpoints.vae import create_vae, diffusers_to_comfy_keys

    shapes = _shapes(create_vae(vae_config))
    comfy = diffusers_to_comfy_keys(shapes)
    return [Entry(comfy[name], torch.bfloat16, shape, _random(name, shape, torch.bfloat16))
            for name, shape in shapes.items()]


def lora_entries(dit_config, rank: int) -> list[Entry]:
    """A Lightning LoRA in lightx2v's layout on every 2-D weight of the transformer blocks; alpha = rank."""
    from qwen_edit_hopper.qwen_edit.checkpoints.dit import create_dit

    entries = []
    for name, shape in _shapes(create_dit(dit_config)).items():
        if not (name.startswith("transformer_blocks.") and name.endswith(".weight") and len(shape) == 2):
            continue
        module = name[: -len(".weight")]
        out_features, in_features = shape
        entries += [
            Entry(f"{module}.lora_down.weight", torch.bfloat16, (rank, in_features),
                  _random(f"{module}.lora_down.weight", (rank, in_features), torch.bfloat16)),
            Entry(f"{module}.lora_up.weight", torch.bfloat16, (out_features, rank),
                  _random(f"{module}.lora_up.weight", (out_features, rank), torch.bfloat16, LORA_UP_SCALE)),
            Entry(f"{module}.alpha", torch.float32, (),
                  lambda generator, device: torch.tensor(float(rank), dtype=torch.float32, device=device)),
        ]
    return entries


def write_all(models: Path, *, size: str = FULL, dit: str = "fp8", loras: tuple[int, ...] = (4, 8),
              lora_rank: int = 64, device: str | torch.device | None = None) -> dict:
    """Write every file of the module docstring under ``models``; return what was written (paths, bytes, seconds).

    Args:
        models: a ComfyUI ``models`` folder (created); files go to its usual subfolders.
        size: ``"full"`` (the released sizes) or ``"tiny"`` (qwen_edit/tiny.py's test sizes).
        dit: ``"fp8"`` (Comfy-Org's fp8_e4m3fn file) or ``"bf16"``; ``"none"`` writes no DiT.
        loras: which Lightning LoRAs (4 and/or 8 steps).
        device: where tensors are drawn (default: ``cuda`` if available, else the CPU).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dit_config, text_config, vae_config = configs(size)
    plan: list[tuple[str, Path, Callable[[], list[Entry]], int]] = []
    if dit != "none":
        plan.append(("dit", models / FOLDERS["dit"] / DIT_FILES[dit], lambda: dit_entries(dit_config, dit), 1))
    plan.append(("text_encoder", models / FOLDERS["text_encoder"] / TEXT_ENCODER_FILE,
                 lambda: text_encoder_entries(text_config), 2))
    plan.append(("vae", models / FOLDERS["vae"] / VAE_FILE, lambda: vae_entries(vae_config), 3))
    for steps in loras:
        plan.append((f"lora_{steps}", models / FOLDERS["lora"] / LORA_FILES[steps],
                     lambda: lora_entries(dit_config, lora_rank), 10 + steps))
    started = time.perf_counter()
    record: dict = {"size": size, "device": str(device), "dit": dit, "lora_rank": lora_rank, "files": {}}
    for role, path, entries, seed in plan:
        done = write_file(path, entries(), device, seed)
        record["files"][role] = done
        print(f"wrote {path} ({done['bytes'] / 1e9:.2f} GB, {done['tensors']} tensors) in {done['seconds']:.1f} s",
              flush=True)
    record["seconds"] = round(time.perf_counter() - started, 2)
    record["bytes"] = sum(f["bytes"] for f in record["files"].values())
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", type=Path, help="a ComfyUI models folder (created)")
    parser.add_argument("--tiny", action="store_true", help="the test sizes of qwen_edit/tiny.py, on the CPU")
    parser.add_argument("--dit", choices=("fp8", "bf16", "none"), default="fp8")
    parser.add_argument("--loras", default="4,8", help="Lightning LoRAs to write: '4,8', '4' or 'none'")
    parser.add_argument("--lora-rank", type=int, help="default 64 (the published rank), 4 with --tiny")
    parser.add_argument("--device", help="where to draw tensors (default: cuda if available; cpu with --tiny)")
    parser.add_argument("--json", type=Path, help="also write what was written here")
    args = parser.parse_args()
    loras = () if args.loras == "none" else tuple(int(s) for s in args.loras.split(","))
    record = write_all(args.models, size=TINY if args.tiny else FULL, dit=args.dit, loras=loras,
                       lora_rank=args.lora_rank or (4 if args.tiny else 64),
                       device=args.device or ("cpu" if args.tiny else None))
    print(f"{record['bytes'] / 1e9:.2f} GB in {record['seconds']:.1f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
