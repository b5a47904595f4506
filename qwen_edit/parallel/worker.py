"""A parallel worker: one process per rank, one device each, serving edits the driver sends.

Started by :mod:`.engine` through ``worker_main.py``. It joins the ``torch.distributed`` group (NCCL on GPUs, gloo
on the CPU), builds the DiT from the plan with the same runtime as the one-process path (LoRAs, FP8, compile: the
model stays loaded between edits), and for each job runs :func:`.denoise.parallel_denoise`.

Messages (pickled, over a ``multiprocessing.connection`` to the driver):

* driver -> worker: ``("job", job dict)``, ``("interrupt",)`` (any time during a job), ``("stop",)``;
* worker -> driver: ``("ready", rank)``, ``("step", done, total, latents)`` (rank 0), ``("done", rank, latents or
  None, notes)``, ``("interrupted", rank)``, ``("error", rank, type name, message, traceback)``.

Interrupt: every rank polls its connection before each step and the ranks agree by an all-reduce (MAX) of the
flag, so all stop at the same step and none waits in a collective for another.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import traceback
from datetime import timedelta
from multiprocessing.connection import Client

import torch
import torch.distributed as dist

from ..plan import PipePlan
from ..sampling import Callbacks, Conditioning
from .denoise import RankGroups, parallel_denoise
from .layout import ParallelChoice
from .ulysses import SequenceShards, exchange_dtype_note

logger = logging.getLogger(__name__)

__all__ = ["WorkerInterruptedError", "serve"]


class WorkerInterruptedError(Exception):
    """The driver asked every rank to stop this job."""


def send(conn, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message))


def receive(conn) -> tuple:
    return pickle.loads(conn.recv_bytes())


def _groups(layout: ParallelChoice, rank: int) -> RankGroups:
    """Every rank creates every group in the same order (``new_group`` is collective)."""
    place = layout.place(rank)
    cfg = sequence = None
    for ranks in layout.cfg_groups():
        group = dist.new_group(ranks) if layout.cfg > 1 else None
        if rank in ranks:
            cfg = group
    for ranks in layout.sequence_groups():
        group = dist.new_group(ranks) if layout.ulysses > 1 else None
        if rank in ranks and group is not None:
            sequence = SequenceShards(group=group, degree=layout.ulysses, rank=place.sp_rank)
    return RankGroups(place=place, cfg=cfg, sequence=sequence)


class _Interrupts:
    """Polls the driver's connection and agrees with the other ranks whether to stop (one all-reduce per step)."""

    def __init__(self, conn, device: torch.device):
        self.conn, self.device, self.asked = conn, device, False

    def check(self) -> None:
        while not self.asked and self.conn.poll():
            message = receive(self.conn)
            if message[0] == "interrupt":
                self.asked = True
        flag = torch.tensor([1.0 if self.asked else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            raise WorkerInterruptedError()


def _run_job(job: dict, runtime, groups: RankGroups, conn, device: torch.device) -> tuple[torch.Tensor, list[str]]:
    from ..compile import compiled_forward_context

    plan: PipePlan = job["plan"]
    conditioning: Conditioning = job["conditioning"]
    conditioning = Conditioning(
        positive={k: v.to(device) for k, v in conditioning.positive.items()},
        negative=None if conditioning.negative is None else {k: v.to(device) for k, v in
                                                             conditioning.negative.items()},
        edit_latents=[t.to(device) for t in conditioning.edit_latents])
    dit = runtime.dit(plan)
    notes = []
    if groups.sequence is not None and dit.prepared.graphs is not None:
        dit.prepared.disable_cuda_graphs()
        notes.append("CUDA graphs: off under Ulysses sequence parallel (the all-to-alls run between the blocks)")
    if groups.sequence is not None:
        notes.append("Ulysses exchange: " + ("traced into the compiled block (functional all-to-alls)"
                                             if plan.forward.ulysses_traced_exchange else
                                             "eager between two graphs of each block") + "; " +
                     exchange_dtype_note(plan.forward.ulysses_fp8_exchange, plan.attention_backend))
    interrupts = _Interrupts(conn, device)
    rank = groups.place.rank

    def on_step(done: int, total: int, latents: torch.Tensor) -> None:
        if rank == 0:
            send(conn, ("step", done, total, latents.detach().to("cpu")))

    with compiled_forward_context(plan.compile):
        latents = parallel_denoise(job["request"], conditioning, dit=dit.prepared, variant=plan.variant,
                                   device=device, dtype=runtime.dtype,
                                   callbacks=Callbacks(on_step=on_step, check_interrupt=interrupts.check),
                                   groups=groups, attention=plan.attention_backend, options=plan.forward)
    if dit.prepared.last_plan is not None:
        notes.append(dit.prepared.last_plan.summary())
    return latents, notes


def serve(address: str, authkey: bytes, rank: int, layout: ParallelChoice, dist_init: str, device: str,
          dtype: str, timeout_s: float = 600.0) -> None:
    """Connect to the driver, join the process group, and serve jobs until ``("stop",)`` or the driver goes."""
    from ..runtime import PlanRuntime

    conn = Client(address, family="AF_UNIX", authkey=authkey)
    torch_device = torch.device(device)
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    backend = "nccl" if torch_device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=dist_init, rank=rank, world_size=layout.world,
                            timeout=timedelta(seconds=timeout_s),
                            **({"device_id": torch_device} if torch_device.type == "cuda" else {}))
    groups = _groups(layout, rank)
    runtime = PlanRuntime(torch_device, dtype=getattr(torch, dtype))
    send(conn, ("ready", rank))
    try:
        while True:
            try:
                message = receive(conn)
            except EOFError:
                return
            if message[0] == "stop":
                return
            if message[0] != "job":
                continue
            try:
                latents, notes = _run_job(message[1], runtime, groups, conn, torch_device)
                send(conn, ("done", rank, latents.to("cpu") if rank == 0 else None, notes))
            except WorkerInterruptedError:
                send(conn, ("interrupted", rank))
            except Exception as exc:  # every failure goes to the driver, which decides
                logger.exception("parallel worker rank %d failed", rank)
                send(conn, ("error", rank, type(exc).__name__, str(exc), traceback.format_exc()))
    finally:
        runtime.evict_all()
        if dist.is_initialized():
            dist.destroy_process_group()


def describe_job(job: dict) -> str:
    """One line for logs."""
    request = job["request"]
    return f"{request.width}x{request.height}, {request.steps} steps, cfg {request.cfg:g}"


def job(plan: PipePlan, request, conditioning: Conditioning) -> dict:
    """The job a driver sends: the plan, the request without its images (encoded already) and the conditioning on
    the CPU."""
    cpu = Conditioning(
        positive={k: v.to("cpu") for k, v in conditioning.positive.items()},
        negative=None if conditioning.negative is None else {k: v.to("cpu") for k, v in
                                                             conditioning.negative.items()},
        edit_latents=[t.to("cpu") for t in conditioning.edit_latents])
    return {"plan": plan, "request": dataclasses.replace(request, images=()), "conditioning": cpu}
