"""Tests on several gloo processes: start them, join them, and read rank 0's results."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp
from comfy_server import free_port


def init_rank(rank: int, port: int, world_size: int = 2) -> None:
    """Join the gloo group of ``world_size`` processes on 127.0.0.1:``port`` as ``rank``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))


def finish_rank(rank: int, results: dict, out_path: str) -> None:
    """Rank 0 writes ``results`` as JSON; every rank leaves the group."""
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def run_ranks(rank_fn: Callable[[int, int, str], None], tmp_path: Path, world_size: int = 2) -> dict:
    """``rank_fn(rank, port, out_path)`` on ``world_size`` spawned processes; rank 0's results."""
    out = tmp_path / "results.json"
    mp.spawn(rank_fn, args=(free_port(), str(out)), nprocs=world_size, join=True)
    return json.loads(out.read_text())
