"""One edit's denoising on one GPU against CFG-parallel (and Ulysses) on several GPUs of this host: a short table.

The DiT is a full-size random-weight Qwen-Image-Edit-2509 file in Comfy-Org's fp8_e4m3fn layout (written here with
bench/full_size_files.py's writer when the models folder lacks it, about a minute on a GPU), loaded through the
pack's runtime as users load it, in the fastest preset (row-wise fp8 GEMMs with fast accumulation and cuBLASLt,
cudnn_fp8 attention, regional compile; whole-forward CUDA graphs on one GPU and under CFG-parallel alone). The
conditioning is random (prompts of 300 and 287 tokens, ``--references`` references at the output size): the text
encoder and the VAE run in the driver either way and are not timed.

Per layout: one warm-up edit of 2 steps (loading, compile, graph capture: the workers' start is reported apart),
then the timed edit: ``--steps`` steps, true CFG ``--cfg``. The one-GPU path runs its default, the two prompts as
one batch-2 forward. ``rel diff`` compares the final latents with the one-GPU ones.

    python3 bench/parallel_bench.py MODELS [--layouts 1,cfg2,u2,cfg2xu2] [--size 1024] [--steps 40] [--cfg 4]
                                           [--references 1]
    python3 bench/parallel_bench.py MODELS --tiny --layouts 1,cfg2     # the code path on the CPU, in seconds
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pack import load_pack

load_pack()

from full_size_files import DIT_FILES, FOLDERS, dit_entries, write_file  # noqa: E402
from harness_forward import FASTEST_GEMM_KERNEL, FASTEST_PRESET  # noqa: E402
from harness_models import FULL, TINY, configs  # noqa: E402
from qwen_edit_hopper.fp8 import Fp8Config  # noqa: E402
from qwen_edit_hopper.qwen_edit.checkpoints.layouts import LAYOUT_SINGLE_FILES, ModelFiles  # noqa: E402
from qwen_edit_hopper.qwen_edit.compile import compiled_forward_context  # noqa: E402
from qwen_edit_hopper.qwen_edit.parallel.engine import engine_for, stop_engine  # noqa: E402
from qwen_edit_hopper.qwen_edit.parallel.layout import ParallelChoice  # noqa: E402
from qwen_edit_hopper.qwen_edit.parallel.worker import job  # noqa: E402
from qwen_edit_hopper.qwen_edit.plan import CompileChoice, PipePlan, Variant  # noqa: E402
from qwen_edit_hopper.qwen_edit.runtime import PlanRuntime  # noqa: E402
from qwen_edit_hopper.qwen_edit.sampling import Callbacks, Conditioning, EditRequest, EditSampler  # noqa: E402

LAYOUTS = {"1": None, "cfg2": ParallelChoice(cfg=2), "u2": ParallelChoice(ulysses=2),
           "u4": ParallelChoice(ulysses=4), "cfg2xu2": ParallelChoice(cfg=2, ulysses=2),
           "cfg2xu4": ParallelChoice(cfg=2, ulysses=4)}


def dit_file(models: Path, tiny: bool, device: torch.device) -> Path:
    path = models / FOLDERS["dit"] / ("tiny" if tiny else "") / DIT_FILES["fp8"]
    if not path.is_file():
        dit_config = configs(TINY if tiny else FULL)[0]
        done = write_file(path, dit_entries(dit_config, "fp8"), device, 1)
        print(f"wrote {path} ({done['bytes'] / 1e9:.2f} GB) in {done['seconds']:.1f} s", flush=True)
    return path


def make_plan(path: Path, tiny: bool) -> PipePlan:
    files = ModelFiles(layout=LAYOUT_SINGLE_FILES, dit=(path,), text_encoder=(path,), vae=(path,))
    if tiny:  # the CPU runs the same path in fp32, eager, SDPA
        return PipePlan(files=files, variant=Variant.EDIT_2509, variant_reason="bench")
    fp8 = Fp8Config(backend="scaled_mm_rowwise", preset=FASTEST_PRESET, fast_accum=True,
                    gemm_kernel=FASTEST_GEMM_KERNEL)
    return PipePlan(files=files, variant=Variant.EDIT_2509, variant_reason="bench", attention="cudnn_fp8", fp8=fp8,
                    compile=CompileChoice(cuda_graphs=True))


def conditioning(text_dim: int, size: int, device: torch.device, dtype: torch.dtype, references: int = 1
                 ) -> Conditioning:
    g = torch.Generator("cpu").manual_seed(1)

    def prompt(n):
        return {"prompt_emb": torch.randn(1, n, text_dim, generator=g).to(device, dtype),
                "prompt_emb_mask": torch.ones(1, n, dtype=torch.long, device=device)}

    return Conditioning(positive=prompt(300), negative=prompt(287),
                        edit_latents=[torch.randn(1, 16, size // 8, size // 8, generator=g).to(device, dtype)
                                      for _ in range(references)])


def one_device(plan, request, cond, device, dtype) -> tuple[float, torch.Tensor]:
    runtime = PlanRuntime(device, dtype)
    dit = runtime.dit(plan)
    sampler = EditSampler(runtime.conditioning)

    def run(req):
        with compiled_forward_context(plan.compile):
            latents = sampler.denoise(req, cond, dit=dit.prepared, variant=plan.variant, device=device, dtype=dtype,
                                      callbacks=Callbacks(), attention=plan.attention if plan.attention != "auto"
                                      else "sdpa", options=plan.forward)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return latents

    run(EditRequest(**{**request.__dict__, "steps": 2}))
    started = time.perf_counter()
    latents = run(request).float().cpu()
    seconds = time.perf_counter() - started
    runtime.evict_all()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return seconds, latents


def parallel(plan, layout, request, cond, device, dtype) -> tuple[float, float, torch.Tensor]:
    started = time.perf_counter()
    engine = engine_for(layout, device.type, dtype)
    start_s = time.perf_counter() - started
    engine.run(job(plan.with_parallel(layout), EditRequest(**{**request.__dict__, "steps": 2}), cond))
    started = time.perf_counter()
    latents, _ = engine.run(job(plan.with_parallel(layout), request, cond))
    return time.perf_counter() - started, start_s, latents.float()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", type=Path, help="a ComfyUI models folder (the DiT file is written when missing)")
    parser.add_argument("--layouts", default="1,cfg2", help=f"comma-separated, from {', '.join(LAYOUTS)}")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--cfg", type=float, default=4.0)
    parser.add_argument("--references", type=int, default=1, choices=(1, 2, 3),
                        help="reference images, each at the output size (vLLM-Omni's published run: 2 at 1536, 35 "
                        "steps)")
    parser.add_argument("--tiny", action="store_true", help="the tiny DiT on the CPU (checks the code path)")
    args = parser.parse_args(argv)
    names = args.layouts.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"--layouts: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if not args.tiny:
        wanted = max(LAYOUTS[n].world if LAYOUTS[n] else 1 for n in names)
        if torch.cuda.device_count() < wanted:
            parser.error(f"--layouts: {wanted} GPUs needed, {torch.cuda.device_count()} visible")
    path = dit_file(args.models, args.tiny, device)
    plan = make_plan(path, args.tiny)
    text_dim = configs(TINY if args.tiny else FULL)[0].text_dim
    cond = conditioning(text_dim, args.size, device, dtype, args.references)
    request = EditRequest(images=(), prompt="", negative_prompt="", seed=7, steps=args.steps, cfg=args.cfg,
                          width=args.size, height=args.size)
    card = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    rows, reference = [], None
    try:
        for name in names:
            layout = LAYOUTS[name]
            if layout is None:
                seconds, latents = one_device(plan, request, cond, device, dtype)
                start_s, gpus, label = 0.0, 1, "one GPU (batched CFG)"
            else:
                seconds, start_s, latents = parallel(plan, layout, request, cond, device, dtype)
                gpus, label = layout.world, layout.describe()
            reference = latents if reference is None else reference
            diff = ((latents - reference).norm() / reference.norm()).item()
            rows.append((name, gpus, seconds, start_s, diff, label))
            print(f"{name}: {seconds:.2f} s", flush=True)
    finally:
        stop_engine()
    base = rows[0][2]
    print(f"\n{args.size}x{args.size} edit, {args.references} reference(s), {args.steps} steps, "
          f"true CFG {args.cfg:g}, "
          f"{'tiny DiT fp32' if args.tiny else 'fastest preset (fp8 rowwise, cudnn_fp8, compiled)'}, {card}")
    print("| layout | GPUs | denoise s | s/step | speed-up | workers start s | rel diff |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, gpus, seconds, start_s, diff, label in rows:
        print(f"| {name}: {label} | {gpus} | {seconds:.2f} | {seconds / args.steps:.3f} | {base / seconds:.2f}x | "
              f"{start_s:.1f} | {diff:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
