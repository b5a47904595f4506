"""One edit's denoising on one GPU against CFG-parallel (and Ulysses) on several GPUs of this host: a short table.

The DiT is a full-size random-weight Qwen-Image-Edit-2509 file in Comfy-Org's fp8_e4m3fn layout (written here with
bench/full_size_files.py's writer when the models folder lacks it, about a minute on a GPU), loaded through the
pack's runtime as users load it, in the fastest preset (row-wise fp8 GEMMs with fast accumulation and cuBLASLt,
cudnn_fp8 attention, regional compile; whole-forward CUDA graphs on one GPU and under CFG-parallel alone). The
conditioning is random (prompts of 300 and 287 tokens, ``--references`` references at the output size): the text
encoder and the VAE run in the driver either way and are not timed.

Per layout: one warm-up edit of 2 steps (loading, compile, graph capture: the workers' start is reported apart),
then the timed edit: ``--steps`` steps, true CFG ``--cfg``. The one-GPU path runs its default, the two prompts as
one batch-2 forward. ``rel diff`` compares the final latents with the first row's (the one-GPU ones when ``1`` comes
first). ``--options`` given more than once runs the multi-GPU layouts once per options set, in the order given, and
the one-GPU layout with the first set only: an A/B of a forward option within one call.

    python3 bench/parallel_bench.py MODELS [--layouts 1,cfg2,u2,cfg2xu2] [--size 1024] [--steps 40] [--cfg 4]
                                           [--references 1]
    python3 bench/parallel_bench.py MODELS --layouts 1,u2 --options shipped --options shipped-with:ulysses_fp8_exchange
    python3 bench/parallel_bench.py MODELS --tiny --layouts 1,cfg2     # the code path on the CPU, in seconds

``--profile-degree P`` instead shows where one Ulysses rank's DiT forward spends its time. It spawns P processes (NCCL
on GPUs; gloo with ``--tiny``), one per device; each builds the DiT as a parallel worker does (CUDA graphs off under
Ulysses), joins one sequence-parallel group and runs the prompt's forward (batch 1: one CFG branch, as under CFG 2 x
Ulysses P): ``--warmup`` calls (compile), ``--repeats`` timed calls, one call under the profiler. ``P = 1`` runs the
same forward without shards on one device, CUDA graphs off too: what a P-rank forward should approach 1/P of. Rank 0
prints ms per forward, its GPU kernel time by category (NCCL apart) against the wall time (a GPU busy well under the
wall: the host or a wait holds it back), the top kernels and the top host-side ops.

    python3 bench/parallel_bench.py MODELS --profile-degree 2 [--size 1024] [--references 1]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pack import load_pack

load_pack()

from comfy_server import free_port  # noqa: E402
from full_size_files import DIT_FILES, FOLDERS, dit_entries, write_file  # noqa: E402
from harness_forward import FASTEST_GEMM_KERNEL, FASTEST_PRESET  # noqa: E402
from harness_models import FULL, TINY, configs  # noqa: E402
from profile_forward import category, options_named  # noqa: E402
from qwen_edit_hopper.fp8 import Fp8Config  # noqa: E402
from qwen_edit_hopper.qwen_edit.checkpoints.layouts import LAYOUT_SINGLE_FILES, ModelFiles  # noqa: E402
from qwen_edit_hopper.qwen_edit.compile import compiled_forward_context  # noqa: E402
from qwen_edit_hopper.qwen_edit.fast_forward import fast_model_fn  # noqa: E402
from qwen_edit_hopper.qwen_edit.parallel.engine import engine_for, stop_engine  # noqa: E402
from qwen_edit_hopper.qwen_edit.parallel.layout import ParallelChoice  # noqa: E402
from qwen_edit_hopper.qwen_edit.parallel.ulysses import SequenceShards  # noqa: E402
from qwen_edit_hopper.qwen_edit.parallel.worker import job  # noqa: E402
from qwen_edit_hopper.qwen_edit.plan import CompileChoice, PipePlan, Variant  # noqa: E402
from qwen_edit_hopper.qwen_edit.runtime import PlanRuntime  # noqa: E402
from qwen_edit_hopper.qwen_edit.sampling import (  # noqa: E402
    Callbacks,
    Conditioning,
    EditRequest,
    EditSampler,
    start_denoising,
)

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


def kernel_category(name: str) -> str:
    """NCCL's kernels apart from :func:`profile_forward.category`'s."""
    return "NCCL" if "nccl" in name.lower() else category(name)


COLLECTIVE = re.compile(r"c10d|nccl|gloo|all_?to_?all|all_?gather|all_?reduce|wait_tensor", re.IGNORECASE)
"""Host ops that are collectives (torch.distributed's, the functional ones, their waits)."""


def profile_summary(prof, wall_ms: float, top: int = 10) -> str:
    """Kernel ms by category against ``wall_ms``, the ``top`` kernels and the ``top`` host-side ops."""
    averages = prof.key_averages()
    # Device events only: a host op that launches a kernel (a custom op, nccl:all_to_all, aten::copy_) carries that
    # kernel's time as its own self device time too, which would count it twice.
    kernels = [(e.key, e.self_device_time_total / 1e3, e.count) for e in averages
               if e.device_type != DeviceType.CPU and e.self_device_time_total > 0]
    by_category: dict[str, float] = {}
    for name, ms, _ in kernels:
        by_category[kernel_category(name)] = by_category.get(kernel_category(name), 0.0) + ms
    busy = sum(ms for name, ms, _ in kernels if kernel_category(name) != "NCCL")
    lines = [f"wall {wall_ms:.1f} ms; kernels outside NCCL {busy:.1f} ms ({100 * busy / wall_ms:.0f}% of the wall)",
             "  by category: " + ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(by_category.items(),
                                                                                 key=lambda i: -i[1])),
             "  top kernels:"]
    lines += [f"    {ms:8.2f} ms x{count:<5d} {name[:110]}" for name, ms, count in
              sorted(kernels, key=lambda k: -k[1])[:top]]
    host = sorted((e for e in averages if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)[:top]
    lines.append("  top host-side ops (self time):")
    lines += [f"    {e.self_cpu_time_total / 1e3:8.2f} ms x{e.count:<5d} {e.key[:110]}" for e in host]
    # every collective the ranks called, however short (the top ops above rank them by time among all host ops)
    collectives = [e for e in averages if e.device_type == DeviceType.CPU and COLLECTIVE.search(e.key)]
    lines.append("  collectives (host ops): " + (", ".join(f"{e.key[:60]} x{e.count}" for e in collectives)
                                                 or "none"))
    return "\n".join(lines)


def profile_rank(rank: int, args: argparse.Namespace, port: int) -> None:
    """One rank of ``--profile-degree``: see the module's docstring."""
    tiny, degree = args.tiny, args.profile_degree
    device = torch.device("cpu") if tiny else torch.device("cuda", rank)
    dtype = torch.float32 if tiny else torch.bfloat16
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shards = None
    if degree > 1:
        dist.init_process_group("gloo" if tiny else "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=degree, timeout=timedelta(seconds=600),
                                **({} if tiny else {"device_id": device}))
        shards = SequenceShards(group=dist.group.WORLD, degree=degree, rank=rank)
    plan = make_plan(dit_file(args.models, tiny, device), tiny).with_forward(args.options)
    runtime = PlanRuntime(device, dtype)
    dit = runtime.dit(plan).prepared
    if dit.graphs is not None:
        dit.disable_cuda_graphs()
    text_dim = configs(TINY if tiny else FULL)[0].text_dim
    cond = conditioning(text_dim, args.size, device, dtype, args.references)
    request = EditRequest(images=(), prompt="", negative_prompt="", seed=7, steps=4, cfg=4.0, width=args.size,
                          height=args.size)
    _, latents, shared = start_denoising(request, cond, plan.variant, device, dtype)
    timestep = torch.tensor([500.0], dtype=dtype, device=device)
    attention = plan.attention if plan.attention != "auto" else "sdpa"

    def forward():
        out = fast_model_fn(dit=dit, latents=latents, timestep=timestep, attention_backend=attention,
                            options=plan.forward, sequence_shards=shards, **cond.positive, **shared)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out

    with compiled_forward_context(plan.compile), torch.inference_mode():
        for _ in range(args.warmup):
            forward()
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            forward()
            times.append((time.perf_counter() - started) * 1e3)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            started = time.perf_counter()
            forward()
            profiled_ms = (time.perf_counter() - started) * 1e3
    if rank == 0:
        median = sorted(times)[len(times) // 2]
        card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"\n{args.size}x{args.size} edit, {args.references} reference(s), prompt branch (batch 1), "
              f"{'Ulysses ' + str(degree) if degree > 1 else 'one device, no shards'}, CUDA graphs off, "
              f"forward options {args.options.describe()}, {card}: "
              f"median {median:.1f} ms per forward over {len(times)} calls (min {min(times):.1f})")
        print(profile_summary(prof, profiled_ms), flush=True)
    if degree > 1:
        dist.destroy_process_group()
    runtime.evict_all()


def profile(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--profile-degree``: the file first (written here, so the ranks only read it), then one process per rank."""
    if not args.tiny and torch.cuda.device_count() < args.profile_degree:
        parser.error(f"--profile-degree {args.profile_degree}: {torch.cuda.device_count()} GPUs visible")
    dit_file(args.models, args.tiny, torch.device("cpu" if args.tiny else "cuda"))
    port = free_port()
    if args.profile_degree == 1:
        profile_rank(0, args, port)
    else:
        mp.spawn(profile_rank, args=(args, port), nprocs=args.profile_degree, join=True)
    return 0


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
    parser.add_argument("--options", action="append", type=options_named,
                        help="the fast forward's options: shipped (default), unfused, shipped-without:F[+F...], "
                             "shipped-with:F (e.g. shipped-without:ulysses_traced_exchange); again for an A/B of the "
                             "multi-GPU layouts")
    parser.add_argument("--profile-degree", type=int, choices=(1, 2, 4, 8),
                        help="instead of the layouts: profile one forward on this many Ulysses ranks (1: no shards)")
    parser.add_argument("--warmup", type=int, default=3, help="--profile-degree: forwards before timing")
    parser.add_argument("--repeats", type=int, default=5, help="--profile-degree: timed forwards")
    args = parser.parse_args(argv)
    options = args.options or [options_named("shipped")]
    if args.profile_degree:
        if len(options) > 1:
            parser.error("--profile-degree: one --options at a time")
        args.options = options[0]
        return profile(parser, args)
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
    base_plan = make_plan(path, args.tiny)
    runs = [(name, chosen) for i, chosen in enumerate(options) for name in names if i == 0 or LAYOUTS[name]]
    text_dim = configs(TINY if args.tiny else FULL)[0].text_dim
    cond = conditioning(text_dim, args.size, device, dtype, args.references)
    request = EditRequest(images=(), prompt="", negative_prompt="", seed=7, steps=args.steps, cfg=args.cfg,
                          width=args.size, height=args.size)
    card = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    rows, reference = [], None
    try:
        for name, chosen in runs:
            layout, plan = LAYOUTS[name], base_plan.with_forward(chosen)
            if layout is None:
                seconds, latents = one_device(plan, request, cond, device, dtype)
                start_s, gpus, label = 0.0, 1, "one GPU (batched CFG)"
            else:
                seconds, start_s, latents = parallel(plan, layout, request, cond, device, dtype)
                gpus, label = layout.world, layout.describe()
            reference = latents if reference is None else reference
            diff = ((latents - reference).norm() / reference.norm()).item()
            rows.append((name, gpus, seconds, start_s, diff, label, chosen.describe()))
            print(f"{name} ({chosen.describe()}): {seconds:.2f} s", flush=True)
    finally:
        stop_engine()
    base = rows[0][2]
    print(f"\n{args.size}x{args.size} edit, {args.references} reference(s), {args.steps} steps, "
          f"true CFG {args.cfg:g}, "
          f"{'tiny DiT fp32' if args.tiny else 'fastest preset (fp8 rowwise, cudnn_fp8, compiled)'}, {card}")
    print("| layout | forward options | GPUs | denoise s | s/step | speed-up | workers start s | rel diff |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, gpus, seconds, start_s, diff, label, described in rows:
        print(f"| {name}: {label} | {described} | {gpus} | {seconds:.2f} | {seconds / args.steps:.3f} | "
              f"{base / seconds:.2f}x | {start_s:.1f} | {diff:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
