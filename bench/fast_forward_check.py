#!/usr/bin/env python3
"""The fast DiT forward against DiffSynth's at full size on one Hopper GPU: error and time per forward.

Run from the repository root on the device machine (about 5 minutes on an H100, compiles included)::

    python3 bench/fast_forward_check.py            # table last, JSON in $OUT/fast_forward.json

``--smoke`` runs the same script logic on CPU at toy size (compile backend "eager", no triton_fp8)
in a few seconds, to check the script itself before spending device time.

Model: ``create_dit(DiTConfig(dim=3072, num_layers=60, num_heads=24, head_dim=128, text_dim=3584))``
built on meta, ``to_empty`` on the GPU in bf16 (38 GiB), random weights as in
``/work/shared/reference/anchor_probe.py`` (N(0, 1/fan_in), modulation and norm_out x0.1, norms 1,
biases 0). Work unit: a 1024x1024 edit with one 1024x1024 reference (2 x 4096 image tokens) and 300
text tokens (8492 tokens). Batched true CFG pairs that prompt with a 287-token negative one.

Variants, in this order (one bf16 copy of the model at any time: fuse_qkv and the fp8 conversion
change it in place, so later rows include the earlier transforms):

1. DiffSynth ``model_fn_qwen_image``, eager (the reference output);
2. fast_model_fn eager (sdpa);
3. fast_model_fn, blocks compiled (``compile_blocks``: one graph for all blocks, sequence dims dynamic);
4. + ``fuse_qkv``;
5. + fp8 row-wise ``torch._scaled_mm`` (``quantize_linears``, the default preset plus the fused
   Q/K/V names, so the fused layers are fp8 too);
6. + ``attention_backend="triton_fp8"`` (skipped with the reason if it cannot run);
7. true CFG on the model of 5/6: one batch-2 forward (prompts of 300 and 287 tokens) vs two batch-1
   forwards, each followed by ``neg + cfg * (pos - neg)``.

Time: CUDA events, median of ``--reps`` (5) after 2 warm-up calls (the first of which compiles and is
reported as ``first_call_s``). Error: ``||out - ref|| / ||ref||`` against variant 1 (batch 2: each
sample against the batch-1 fast forward of the same model with the same prompt).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from pack import load_pack  # noqa: E402

load_pack()

import torch  # noqa: E402
from qwen_edit_hopper.fp8 import Fp8Config, LayerPreset, get_preset, quantize_linears  # noqa: E402
from qwen_edit_hopper.fp8.attention import check_backend  # noqa: E402
from qwen_edit_hopper.fp8.presets import DEFAULT_PRESET  # noqa: E402
from qwen_edit_hopper.qwen_edit.checkpoints.dit import DiTConfig, create_dit  # noqa: E402
from qwen_edit_hopper.qwen_edit.fast_forward import (  # noqa: E402
    FUSED_QKV_PATTERN,
    batch_prompts,
    compile_blocks,
    fast_model_fn,
    fuse_qkv,
)

FULL = DiTConfig(dim=3072, num_layers=60, num_heads=24, head_dim=128, text_dim=3584)
SIZE = 1024
TEXT_TOKENS = (300, 287)
CFG_SCALE = 4.0
BUDGET_S = 450.0  # optional rows are skipped after this (the command limit is 600 s, 8 minutes asked)


def log(*parts) -> None:
    print(*parts, flush=True)


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """anchor_probe.py's init: matrices N(0, 1/fan_in) (modulation, norm_out x0.1), norms 1, biases 0."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]), generator=gen)
                if "_mod." in name or "norm_out" in name:
                    p.mul_(0.1)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()


def build_random_dit(config: DiTConfig = FULL, device: str = "cuda", seed: int = 0) -> torch.nn.Module:
    """DiffSynth's DiT at ``config`` size in bf16 on ``device`` with random weights (no second copy at any time)."""
    dit = create_dit(config).to(torch.bfloat16)  # still on meta: free
    dit = dit.to_empty(device=device)
    randomize(dit, seed)
    return dit.eval()


def make_inputs(config: DiTConfig, size: int = SIZE, text_tokens: tuple[int, ...] = TEXT_TOKENS,
                device: str = "cuda", seed: int = 1) -> dict:
    """Batch-1 inputs for the first prompt, plus ``prompts``: one conditioning dict per text length."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16)

    latent = size // 8
    prompts = [{"prompt_emb": randn(1, n, config.text_dim),
                "prompt_emb_mask": torch.ones(1, n, dtype=torch.long, device=device)} for n in text_tokens]
    return {
        "latents": randn(1, 16, latent, latent),
        "edit_latents": [randn(1, 16, latent, latent)],
        "timestep": torch.full((1,), 500.0, device=device, dtype=torch.bfloat16),
        "height": size,
        "width": size,
        "prompts": prompts,
    }


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_ms(fn, warm: int = 2, reps: int = 5) -> tuple[float, float, list[float]]:
    """(median ms, first call wall s, all ms): CUDA events around each call after ``warm`` calls (CPU: wall)."""
    started = time.perf_counter()
    fn()
    _sync()
    first_s = time.perf_counter() - started
    for _ in range(warm - 1):
        fn()
    _sync()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), first_s, times


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class Run:
    def __init__(self, out_dir: Path, reps: int):
        self.out_dir = out_dir
        self.reps = reps
        self.started = time.perf_counter()
        self.payload: dict = {"rows": {}, "notes": []}

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def save(self) -> None:
        self.payload["elapsed_s"] = round(self.elapsed(), 1)
        (self.out_dir / "fast_forward.json").write_text(json.dumps(self.payload, indent=1))

    def row(self, name: str, fn, ref: torch.Tensor | None = None, optional: bool = True, **extra) -> dict | None:
        if optional and self.elapsed() > BUDGET_S:
            self.payload["rows"][name] = {"skipped": f"time budget ({BUDGET_S:.0f} s) spent"}
            log(f"{name}: skipped (time budget)")
            self.save()
            return None
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        graphs_before = graphs_compiled()
        try:
            ms, first_s, times = time_ms(fn, reps=self.reps)
            out = fn()
            result = {"ms": round(ms, 2), "first_call_s": round(first_s, 2), "all_ms": [round(t, 2) for t in times],
                      "peak_gib": round(_peak_gib(), 2),
                      "graphs_compiled": graphs_compiled() - graphs_before, **extra}
            if ref is not None:
                result["rel_err"] = rel_err(out, ref)
        except Exception as exc:  # a row that fails is reported, the others still run
            result = {"error": f"{type(exc).__name__}: {str(exc)[:600]}"}
            traceback.print_exc()
        self.payload["rows"][name] = result
        log(f"{name}: {json.dumps({k: v for k, v in result.items() if k != 'all_ms'})}")
        self.save()
        return result


def fused_preset() -> LayerPreset:
    """The default preset plus the fused Q/K/V names (harmless if the default already has them)."""
    base = get_preset(DEFAULT_PRESET)
    return LayerPreset(name=base.name + " + fused qkv", description=base.description,
                       compute=(*base.compute, FUSED_QKV_PATTERN), storage=base.storage, keep=base.keep)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=FULL.num_layers, help="transformer blocks (60 = full model)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--mode", default=None, help="torch.compile mode (default: None)")
    parser.add_argument("--smoke", action="store_true", help="CPU, toy size: check this script, not the model")
    args = parser.parse_args()
    device, size, backend = ("cpu", 128, "eager") if args.smoke else ("cuda", SIZE, "inductor")

    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    run = Run(out_dir, args.reps)
    if args.smoke:
        config = DiTConfig(dim=256, num_layers=2, num_heads=2, head_dim=128, text_dim=64)
    else:
        config = DiTConfig(dim=FULL.dim, num_layers=args.layers, num_heads=FULL.num_heads, head_dim=FULL.head_dim,
                           text_dim=FULL.text_dim)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)"
    run.payload.update(device=name, torch=torch.__version__, layers=config.num_layers, size=size,
                       text_tokens=TEXT_TOKENS, compile_mode=args.mode)
    log("device", run.payload["device"], "torch", torch.__version__)

    dit = build_random_dit(config, device)
    log(f"model built: {sum(p.numel() for p in dit.parameters()) * 2 / 2**30:.1f} GiB, {run.elapsed():.0f} s")
    x = make_inputs(config, size, device=device)
    prompts = x.pop("prompts")
    one = {**x, **prompts[0]}

    from diffsynth.pipelines.qwen_image import model_fn_qwen_image

    def diffsynth():
        return model_fn_qwen_image(dit=dit, **one)

    ref = diffsynth().float()
    rows = {}
    rows["diffsynth eager"] = run.row("diffsynth eager", diffsynth, optional=False)
    rows["fast eager"] = run.row("fast eager", lambda: fast_model_fn(dit, **one), ref)

    torch._dynamo.reset()
    compile_blocks(dit, mode=args.mode, backend=backend)
    rows["fast compiled"] = run.row("fast compiled", lambda: fast_model_fn(dit, **one), ref)

    fuse_qkv(dit)
    torch._dynamo.reset()
    rows["+ fuse_qkv"] = run.row("+ fuse_qkv", lambda: fast_model_fn(dit, **one), ref)

    report = quantize_linears(dit, Fp8Config(backend="scaled_mm_rowwise", preset=fused_preset(), emulate=args.smoke))
    run.payload["fp8_conversion"] = report.counts
    run.payload["notes"].append(report.summary())
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    rows["+ fp8 rowwise"] = run.row("+ fp8 rowwise", lambda: fast_model_fn(dit, **one), ref)

    ok, reason = check_backend("triton_fp8", device, head_dim=config.head_dim, dtype=torch.bfloat16)
    backends = ["sdpa"]
    if ok:
        backends.append("triton_fp8")
        torch._dynamo.reset()
        rows["+ triton_fp8 attention"] = run.row(
            "+ triton_fp8 attention", lambda: fast_model_fn(dit, **one, attention_backend="triton_fp8"), ref)
    else:
        run.payload["rows"]["+ triton_fp8 attention"] = {"skipped": reason}

    # True CFG: batch 2 (prompts of different lengths, per-sample attention) vs 2 x batch 1.
    text2 = batch_prompts(prompts)
    two = {**x, **text2, "latents": x["latents"].expand(2, -1, -1, -1)}
    for backend in backends:
        suffix = "" if backend == "sdpa" else f" ({backend})"

        def sequential(backend=backend):
            pos = fast_model_fn(dit, **x, **prompts[0], attention_backend=backend)
            neg = fast_model_fn(dit, **x, **prompts[1], attention_backend=backend)
            return torch.cat([pos, neg]), neg + CFG_SCALE * (pos - neg)

        def batched(backend=backend):
            both = fast_model_fn(dit, **two, attention_backend=backend)
            pos, neg = both.chunk(2)
            return both, neg + CFG_SCALE * (pos - neg)

        name_seq, name_bat = f"cfg step 2 x batch 1{suffix}", f"cfg step batch 2{suffix}"
        rows[name_seq] = run.row(name_seq, lambda s=sequential: s()[0])
        expect = sequential()[0]
        rows[name_bat] = run.row(name_bat, lambda b=batched: b()[0], expect)

    # Summary
    base = rows["diffsynth eager"] or {}
    one_fwd = {b: (rows.get("+ fp8 rowwise") if b == "sdpa" else rows.get("+ triton_fp8 attention")) or {}
               for b in backends}
    cfg = {}
    for backend in backends:
        suffix = "" if backend == "sdpa" else f" ({backend})"
        single = one_fwd[backend].get("ms")
        for kind in ("2 x batch 1", "batch 2"):
            r = rows.get(f"cfg step {kind}{suffix}") or {}
            if single and "ms" in r:
                cfg[f"{kind}{suffix}"] = round(r["ms"] / single, 3)
    run.payload["cfg_step_over_one_forward"] = cfg
    run.save()

    log("")
    log(f"| path ({config.num_layers} blocks, {size}x{size} + 1 ref, {TEXT_TOKENS[0]} text) | ms "
        "| x vs DiffSynth eager | rel. error | first call s | graphs |")
    log("|---|---|---|---|---|---|")
    for name, r in run.payload["rows"].items():
        if not r or "ms" not in r:
            log(f"| {name} | - | - | {(r or {}).get('error') or (r or {}).get('skipped')} | - | - |")
            continue
        speed = f"{base['ms'] / r['ms']:.2f}" if base.get("ms") and not name.startswith("cfg") else "-"
        err = f"{r['rel_err']:.2e}" if "rel_err" in r else "ref"
        log(f"| {name} | {r['ms']:.1f} | {speed} | {err} | {r['first_call_s']:.1f} | {r['graphs_compiled']} |")
    for key, value in cfg.items():
        log(f"true-CFG step / one forward, {key}: {value:.2f} (target <= 1.9)")
    log(f"total {run.elapsed():.0f} s; JSON: {out_dir / 'fast_forward.json'}")


if __name__ == "__main__":
    with torch.no_grad():
        main()
