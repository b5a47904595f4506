"""Ulysses' exchange traced into the compiled block (``ForwardOptions.ulysses_traced_exchange``), on two gloo processes
with the tiny DiT (2 heads): the same prediction as the eager exchange and as one process, and the block with its
two all-to-alls one graph (the eager exchange: two graphs around it), none compiled again on the next call.

Graphs are counted, and their all-to-all nodes with them, by a backend that runs them eagerly (no code generation)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from pack import load_pack

load_pack()  # the spawned ranks import this module without the conftest

import test_fast_forward_compile  # noqa: E402
from gloo_ranks import finish_rank, init_rank, run_ranks  # noqa: E402
from qwen_edit_hopper.qwen_edit import fast_forward  # noqa: E402
from qwen_edit_hopper.qwen_edit.fast.options import SHIPPED  # noqa: E402
from qwen_edit_hopper.qwen_edit.fast_forward import PreparedDit  # noqa: E402
from qwen_edit_hopper.qwen_edit.parallel.ulysses import SequenceShards  # noqa: E402
from test_fast_forward import build_dit, make_inputs, rel  # noqa: E402


class CountingBackend(test_fast_forward_compile.CountingBackend):
    """The compile tests' graph-counting backend, counting the graphs' all-to-all nodes too."""

    def __init__(self):
        super().__init__()
        self.all_to_alls = 0

    def __call__(self, gm, example_inputs):
        self.all_to_alls += sum(1 for node in gm.graph.nodes if "all_to_all" in str(node.target))
        return super().__call__(gm, example_inputs)


def _rank(rank: int, port: int, out_path: str) -> None:
    init_rank(rank, port)
    shards = SequenceShards(group=dist.group.WORLD, degree=2, rank=rank)
    inputs = make_inputs(torch.float32)
    results = {}
    with torch.no_grad():
        single = fast_forward.fast_model_fn(PreparedDit(build_dit(torch.float32, layers=3)), **inputs)
        for traced in (False, True):
            torch._dynamo.reset()
            options = dataclasses.replace(SHIPPED, ulysses_traced_exchange=traced)
            dit = PreparedDit(build_dit(torch.float32, layers=3))
            counter = CountingBackend()
            dit.compile_blocks(backend=counter)
            out = fast_forward.fast_model_fn(dit, **inputs, options=options, sequence_shards=shards)
            first = counter.graphs
            again = fast_forward.fast_model_fn(dit, **inputs, options=options, sequence_shards=shards)
            results[str(traced)] = {"rel_single": rel(out, single), "graphs": first, "graphs_after": counter.graphs,
                                    "all_to_alls": counter.all_to_alls,
                                    "same_again": bool(torch.equal(out, again))}
    finish_rank(rank, results, out_path)


def test_traced_exchange_predicts_as_the_eager_one_with_its_section_in_the_graph(tmp_path):
    results = run_ranks(_rank, tmp_path)
    eager, traced = results["False"], results["True"]
    for variant in (eager, traced):
        assert variant["rel_single"] < 1e-5, results  # Ulysses' prediction is the one-process prediction
        assert variant["same_again"], results
        assert variant["graphs_after"] == variant["graphs"], results  # no recompile on the next call
    assert (eager["graphs"], eager["all_to_alls"]) == (2, 0), results  # two graphs around the eager exchange
    assert (traced["graphs"], traced["all_to_alls"]) == (1, 2), results  # one graph with both all-to-alls
