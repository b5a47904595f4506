"""Regional compilation of the DiT's transformer blocks.

One ``torch.compile`` of the fast forward's block function serves all 60
blocks (parameters are graph inputs, not constants; the last block, which
computes only the target tokens after its attention, is a second graph of
it), so compile time is about two blocks', and changing weights in place
(a LoRA, its strength) never recompiles. Switching a module between eager
and compiled (the Benchmark does) costs nothing after the first time:
compiled graphs live in dynamo's cache. PyTorch's own caches (Inductor's
FX graph cache and AOTAutograd cache, on by default) make a restart's first
compile fast.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from .memory import Resident
from .plan import CompileChoice

logger = logging.getLogger(__name__)

MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead")
RECOMPILE_LIMIT = 64
"""Dynamo's per-code-object cache limit while our blocks compile (60 blocks x a few shapes fit)."""


@contextlib.contextmanager
def dynamo_settings() -> Iterator[None]:
    """The one place where process-wide dynamo settings change for our compiles; restored on exit."""
    config = torch._dynamo.config
    names = ["cache_size_limit", "accumulated_cache_size_limit"]
    if hasattr(config, "recompile_limit"):
        names = ["recompile_limit", "accumulated_recompile_limit"]
    saved = {name: getattr(config, name) for name in names}
    try:
        setattr(config, names[0], max(saved[names[0]], RECOMPILE_LIMIT))
        setattr(config, names[1], max(saved[names[1]], RECOMPILE_LIMIT * 16))
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


def set_regional_compile(resident: Resident, choice: CompileChoice | None) -> None:
    """Run the DiT's blocks through one compiled block function for ``choice``, or eagerly when None.

    ``resident.prepared`` is the DiT's :class:`~.fast.prepared.PreparedDit`. ``dynamic`` True marks the sequence
    dims dynamic (a new resolution or prompt length reuses the graph; batch 1 and batch 2 are two graphs); False
    specializes on every shape. ``cuda_graphs`` runs each CUDA forward through whole-forward CUDA graphs
    (``fast.graphs``), where they can work (``PreparedDit.cuda_graphs_capability``);
    ``resident.extra["cuda_graphs"]`` then says "on", or "off: <why>" for the run's summary.
    """
    prepared = resident.prepared
    if choice is None:
        prepared.uncompile_blocks()
        prepared.disable_cuda_graphs()
        resident.extra.pop("cuda_graphs", None)
        return
    mode = None if choice.mode == "default" else choice.mode
    prepared.compile_blocks(mode=mode, dynamic=None if choice.dynamic else False)
    capability = prepared.cuda_graphs_capability() if choice.cuda_graphs else None
    if capability is not None and capability.ok:
        prepared.enable_cuda_graphs()
        resident.extra["cuda_graphs"] = "on"
    else:
        prepared.disable_cuda_graphs()
        resident.extra["cuda_graphs"] = f"off: {capability.reason}" if capability else "off"
        if capability:
            logger.warning("CUDA graphs asked for but not used: %s", capability.reason)


def compiled_forward_context(choice: CompileChoice | None):
    """Context for running a forward of a compiled variant (dynamo settings scoped to it)."""
    return dynamo_settings() if choice is not None else contextlib.nullcontext()


def warmup_inputs(module: torch.nn.Module, width: int, height: int, text_tokens: int = 128,
                  device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16) -> dict:
    """Random DiT inputs for an edit at ``width`` x ``height`` with one reference image of the same size.

    Shapes: latents and reference (1, 16, H/8, W/8); prompt (1, text_tokens, text_dim).
    """
    generator = torch.Generator("cpu").manual_seed(0)
    text_dim = module.txt_in.in_features

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    return {
        "latents": randn(1, 16, height // 8, width // 8), "edit_latents": [randn(1, 16, height // 8, width // 8)],
        "prompt_emb": randn(1, text_tokens, text_dim),
        "prompt_emb_mask": torch.ones(1, text_tokens, dtype=torch.long, device=device),
        "timestep": torch.full((1,), 500.0, device=device, dtype=dtype), "height": height, "width": width,
    }


def compiled_graph_count() -> int:
    """Graphs dynamo has compiled in this process so far (a difference of two reads counts recompiles)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def inductor_cache_counters() -> dict[str, int]:
    """Hits and misses of Inductor's FX graph cache so far in this process."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {"fxgraph_cache_hit": int(inductor["fxgraph_cache_hit"]),
            "fxgraph_cache_miss": int(inductor["fxgraph_cache_miss"])}
