"""Ulysses' exchange in e4m3 (``ForwardOptions.ulysses_fp8_exchange``), on two gloo processes with the emulated cuDNN
FP8 attention: the attention of the whole sequence equals one process's quantized attention (the same per-tensor
scales, so the same codes), eager and traced; another backend is refused; the whole tiny DiT forward stays close to
one process's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from pack import load_pack

load_pack()  # the spawned ranks import this module without the conftest

from gloo_ranks import finish_rank, init_rank, run_ranks  # noqa: E402
from qwen_edit_hopper.fp8.attention.cudnn_fp8 import attention_quantized, quantize_per_tensor  # noqa: E402
from qwen_edit_hopper.qwen_edit import fast_forward  # noqa: E402
from qwen_edit_hopper.qwen_edit.fast.block import length_carriers  # noqa: E402
from qwen_edit_hopper.qwen_edit.fast.options import SHIPPED  # noqa: E402
from qwen_edit_hopper.qwen_edit.fast_forward import PreparedDit  # noqa: E402
from qwen_edit_hopper.qwen_edit.parallel.ulysses import SequenceShards, exchange_dtype_note  # noqa: E402
from test_fast_forward import build_dit, make_inputs, rel  # noqa: E402

BACKEND = "cudnn_fp8_emulated"
BATCH, HEADS, HEAD_DIM, IMAGE, TEXT = 2, 4, 16, 8, 4
TEXT_LENS = (4, 3)  # the second sample's last text token is padding


def _full(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v of the whole joint sequence, (B, IMAGE + TEXT, H, Dh) bf16, image tokens first."""
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(BATCH, IMAGE + TEXT, HEADS, HEAD_DIM, generator=g) * scale).to(torch.bfloat16)
                 for scale in (1.0, 2.0, 0.5))


def _one_process(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The whole attention in one process: per-tensor e4m3 codes, each sample over its valid keys, padded rows 0."""
    (q8, dq), (k8, dk), (v8, dv) = (quantize_per_tensor(t.transpose(1, 2)) for t in (q, k, v))
    outs = []
    for i, n in enumerate(TEXT_LENS):
        keep = IMAGE + n
        out8 = attention_quantized(*(t[i:i + 1, :, :keep].contiguous() for t in (q8, k8, v8)), dq, dk, dv, True)
        outs.append(F.pad(out8.float() * dv.reshape(1, 1), (0, 0, 0, IMAGE + TEXT - keep)))
    return torch.cat(outs).to(q.dtype)


def _shard(x: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's rows: its slice of the image tokens, then its slice of the text tokens."""
    image, text = x[:, :IMAGE], x[:, IMAGE:]
    return torch.cat([image.chunk(2, dim=1)[rank], text.chunk(2, dim=1)[rank]], dim=1)


def _rank(rank: int, port: int, out_path: str) -> None:
    init_rank(rank, port)
    shards = SequenceShards(group=dist.group.WORLD, degree=2, rank=rank)
    q, k, v = _full()
    expected = _shard(_one_process(q, k, v), rank)
    carriers = length_carriers(TEXT_LENS, torch.device("cpu"))
    valid = torch.empty((IMAGE, 0))
    results = {}
    with torch.no_grad():
        for traced in (False, True):
            out = shards.attention(*(_shard(t, rank) for t in (q, k, v)), IMAGE // 2, valid, carriers, BACKEND,
                                   traced, fp8=True)
            plain = shards.attention(*(_shard(t, rank) for t in (q, k, v)), IMAGE // 2, valid, carriers, BACKEND,
                                     traced)
            results[f"traced={traced}"] = {"equal": bool(torch.equal(out, expected)), "rel": rel(out, expected),
                                           "rel_plain": rel(plain, expected), "dtype": str(out.dtype)}
        try:
            shards.attention(q, k, v, IMAGE // 2, valid, carriers, "sdpa", fp8=True)
            results["refused"] = ""
        except ValueError as exc:
            results["refused"] = str(exc)
        inputs = make_inputs(torch.float32)
        single = fast_forward.fast_model_fn(PreparedDit(build_dit(torch.float32, layers=2)), **inputs,
                                            attention_backend=BACKEND)
        for fp8 in (False, True):
            options = dataclasses.replace(SHIPPED, ulysses_fp8_exchange=fp8)
            out = fast_forward.fast_model_fn(PreparedDit(build_dit(torch.float32, layers=2)), **inputs,
                                             attention_backend=BACKEND, options=options, sequence_shards=shards)
            results[f"model fp8={fp8}"] = rel(out, single)
    finish_rank(rank, results, out_path)


def test_an_fp8_exchange_gives_one_process_codes(tmp_path):
    results = run_ranks(_rank, tmp_path)
    print(results)
    for traced in (False, True):
        row = results[f"traced={traced}"]
        assert row["equal"], results  # the same scales and codes as one process: the same output
        assert row["dtype"] == "torch.bfloat16", results
        assert 0 < row["rel_plain"] < 0.1, results  # per-rank scales in the compute-dtype exchange: close, not equal
    assert "ulysses_fp8_exchange off" in results["refused"] and "sdpa" in results["refused"], results
    # the whole forward: fp8 noise from one process's fused quantization, no more with the fp8 exchange
    assert results["model fp8=True"] < 0.1 and results["model fp8=False"] < 0.1, results
    assert results["model fp8=True"] <= 2 * results["model fp8=False"], results


@pytest.mark.parametrize("fp8, backend, words", [(False, "cudnn_fp8", "compute dtype"),
                                                  (True, "cudnn_fp8", "as e4m3"),
                                                  (True, "sdpa", "the attention here is sdpa")])
def test_the_runs_notes_say_what_the_exchange_carries(fp8, backend, words):
    assert words in exchange_dtype_note(fp8, backend)
