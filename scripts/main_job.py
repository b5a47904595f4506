"""Main job: a headless ComfyUI with this pack runs a preset workflow through the HTTP API.

Without ``--models`` it writes a tiny Qwen-Image-Edit checkpoint set (real key
layout, a few layers) into a fresh models folder, so it runs on any machine in a
minute; with ``--models`` (a ComfyUI ``models`` folder holding the real files)
it runs the real model. Prints the output image path and the run's timings.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from comfy_server import COMFYUI_VERSIONS, DEFAULT_COMFYUI, ComfyServer
from workflows import INPUT_IMAGE, PRESETS, to_api

ROOT = Path(__file__).resolve().parents[1]


def example_image(path: Path, size: int = 512) -> None:
    """A synthetic photo-like test image (sky gradient, ground, a sun), written as PNG."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:size, 0:size] / size
    sky = np.stack([0.35 + 0.3 * y, 0.55 + 0.2 * y, 0.95 - 0.2 * y], axis=-1)
    ground = np.stack([0.25 + 0.1 * x, 0.45 + 0.1 * x, 0.2 + 0 * x], axis=-1)
    image = np.where((y > 0.62)[..., None], ground, sky)
    sun = ((x - 0.7) ** 2 + (y - 0.3) ** 2) < 0.006
    image[sun] = (1.0, 0.9, 0.6)
    Image.fromarray((image * 255).astype("uint8"), "RGB").save(path)


def write_extra_model_paths(base: Path, models: Path) -> Path:
    config = base / "extra_model_paths.yaml"
    folders = ["diffusion_models", "text_encoders", "vae", "loras", "qwen_edit"]
    lines = ["qwen_edit_main_job:", f"    base_path: {models}"] + [f"    {name}: {name}" for name in folders]
    config.write_text("\n".join(lines) + "\n")
    return config


def choose(folder: Path, wanted: str, patterns: tuple[str, ...]) -> str:
    """The workflow's file name if present in ``folder``, else the first file matching a pattern."""
    if (folder / wanted).exists():
        return wanted
    for pattern in patterns:
        found = sorted(p.name for p in folder.glob(pattern) if p.suffix == ".safetensors")
        if found:
            return found[0]
    raise SystemExit(f"no {wanted} (or {patterns}) in {folder}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, help="a ComfyUI models folder with the real weights")
    parser.add_argument("--gpu", action="store_true", help="run ComfyUI on the GPU (default: --cpu)")
    parser.add_argument("--comfyui", default=DEFAULT_COMFYUI, choices=list(COMFYUI_VERSIONS),
                        help=f"which of the test environment's ComfyUIs runs it (default {DEFAULT_COMFYUI})")
    parser.add_argument("--preset", default="qwen_edit_bf16_baseline",
                        choices=[p().name for p in PRESETS], help="which shipped workflow to run")
    parser.add_argument("--image", type=Path, help="input image (default: a synthetic test image)")
    parser.add_argument("--steps", type=int, help="override the workflow's steps")
    parser.add_argument("--size", type=int, help="override output width and height (multiple of 16)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs", help="where to keep the run folder")
    args = parser.parse_args()

    workflow = next(p() for p in PRESETS if p().name == args.preset)
    prompt = to_api(workflow)
    base = args.out / time.strftime("main-job-%Y%m%d-%H%M%S")
    (base / "input").mkdir(parents=True)
    extra_args: tuple[str, ...] = ()
    if args.models is None:
        from tiny_models import install_tiny_models

        print("no --models given: writing a tiny Qwen-Image-Edit checkpoint set (real layout, random weights)")
        install_tiny_models(base / "models")
        steps, size = args.steps or 8, args.size or 256
    else:
        models = args.models.resolve()
        extra_args = ("--extra-model-paths-config", str(write_extra_model_paths(base, models)))
        steps, size = args.steps, args.size
        for node in prompt.values():
            inputs = node["inputs"]
            if node["class_type"] == "QwenEditHopper_Load":
                inputs["diffusion_model"] = choose(models / "diffusion_models", inputs["diffusion_model"],
                                                   ("qwen_image_edit*",))
                inputs["text_encoder"] = choose(models / "text_encoders", inputs["text_encoder"], ("qwen_2.5_vl*",))
                inputs["vae"] = choose(models / "vae", inputs["vae"], ("qwen_image_vae*",))
    for node in prompt.values():
        inputs = node["inputs"]
        if node["class_type"] in ("QwenEditHopper_Sampler", "QwenEditHopper_Benchmark"):
            if steps:
                inputs["steps"] = steps
            if size:
                inputs["width"] = inputs["height"] = size
                if "reference_megapixels" in inputs:
                    inputs["reference_megapixels"] = round(size * size / 2**20, 4)

    if args.image:
        shutil.copy(args.image, base / "input" / INPUT_IMAGE)
    else:
        example_image(base / "input" / INPUT_IMAGE)

    server = ComfyServer(base, extra_args=extra_args, cpu=not args.gpu, comfyui=args.comfyui)
    print(f"starting ComfyUI {args.comfyui} ({'GPU' if args.gpu else 'CPU'}) in {base}")
    started = time.perf_counter()
    server.start()
    try:
        print(f"server ready in {time.perf_counter() - started:.1f} s; queueing {workflow.name}")
        queued = time.perf_counter()
        entry = server.run(prompt, timeout=3600)
        wall = time.perf_counter() - queued
        images = server.output_files(entry)
        texts = [t for out in entry["outputs"].values() for t in out.get("text", [])]
        print("\n".join(texts))
        for path in images:
            print(f"output image: {path}")
        print(f"prompt wall time: {wall:.2f} s (queue to history)")
        (base / "result.json").write_text(json.dumps({"workflow": workflow.name, "wall_s": wall,
                                                      "images": [str(p) for p in images], "info": texts}, indent=2))
        return 0 if images else 1
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
