"""The linear benchmark's accuracy code, checked against a known quantization error on CPU.

Per-tensor ``torch._scaled_mm`` runs on the CPU in torch 2.11, so the whole measuring path
(``harness_linear.measure``) can be checked on numbers worked out by hand: an identity input and a
weight whose entries are 448 (which sets the per-tensor scale to exactly 1) and 1.0625 (halfway
between the e4m3 neighbours 1.0 and 1.125, so round-to-nearest-even stores 1.0: an error of exactly
-0.0625 per entry).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import harness_core as core
import harness_linear as hl

CPU = torch.device("cpu")


def _known_case() -> hl.Case:
    n = 16
    weight = torch.full((n, n), 1.0625)
    weight[0, 0] = 448.0
    with torch.device("meta"):
        linear = nn.Linear(n, n, bias=False)
    linear.weight = nn.Parameter(weight.to(torch.bfloat16), requires_grad=False)
    layer = hl.make_layer("scaled-mm-tensorwise", linear)
    x = torch.eye(n, dtype=torch.bfloat16)
    grad = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    return hl.Case(hl.Shape(n, n, n, "known"), [linear], [layer], [x], [grad])


def test_accuracy_matches_a_known_tensorwise_quantization_error():
    case = _known_case()
    figures = hl.measure(hl.Caller(case), CPU, warmup=1, reps=2)

    err = 0.0625
    wrong = 16 * 16 - 1
    assert figures["forward_mse"] == pytest.approx(wrong * err**2 / 256, rel=1e-12)
    assert figures["forward_mse_row_max"] == pytest.approx(err**2, rel=1e-12)
    total = math.sqrt(wrong * err**2) / math.sqrt(448.0**2 + wrong * 1.0625**2)
    assert figures["forward_rel_err"] == pytest.approx(total, rel=1e-12)
    row0 = math.sqrt(15 * err**2) / math.sqrt(448.0**2 + 15 * 1.0625**2)
    assert figures["forward_rel_err_row_max"] == pytest.approx(1 / 17, rel=1e-12)
    assert figures["forward_rel_err_row_mean"] == pytest.approx((15 / 17 + row0) / 16, rel=1e-12)
    assert figures["backward"].startswith("no backward: RuntimeError")
    assert "forward_backward_ms" not in figures
    assert figures["forward_ms"] > 0 and figures["weight_mib"] > 0


def test_accuracy_per_row_figures():
    ref = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]], dtype=torch.float64)
    out = ref.clone()
    out[0, 1] = 0.5  # row 0: |d| = 0.5, |ref| = 1
    out[1, 0] = 0.2  # row 1: |d| = 0.2, |ref| = 2
    figures = hl.accuracy(out, ref)
    assert figures["rel_err_row_max"] == pytest.approx(0.5)
    assert figures["rel_err_row_mean"] == pytest.approx((0.5 + 0.1 + 0.0) / 3)
    assert figures["mse"] == pytest.approx((0.25 + 0.04) / 6)
    assert figures["mse_row_max"] == pytest.approx(0.125)
    assert figures["rel_err"] == pytest.approx(math.sqrt(0.29) / math.sqrt(5))
    out[2, 0] = 1.0  # a row whose reference is zero: relative error inf
    assert hl.accuracy(out, ref)["rel_err_row_max"] == math.inf
    out[2, 0] = float("nan")
    assert math.isnan(hl.accuracy(out, ref)["rel_err"])


def test_bf16_and_weight_only_have_a_backward_with_gradient_accuracy():
    (shape,) = [hl.Shape(16, 32, 48, "small")]
    linears, inputs, grads = hl.make_inputs(shape, CPU, seed=3, sets=2)
    for backend, bound in (("bf16", 1e-2), ("weight-only", 6e-2)):
        layers = [hl.make_layer(backend, lin) for lin in linears]
        figures = hl.measure(hl.Caller(hl.Case(shape, linears, layers, inputs, grads)), CPU, warmup=1, reps=2)
        assert figures["backward"].startswith("bf16 gradients")
        assert 0 < figures["grad_rel_err"] < bound
        assert 0 < figures["forward_rel_err"] < bound
        assert figures["backward_ms"] > 0


def test_run_linear_records_every_backend_and_continues_past_failures(tmp_path):
    store = core.ResultStore(tmp_path, {"started": "t0"})
    runner = core.Runner(store, core.Selection.parse("linear"), core.Budget(0))
    shapes = (hl.Shape(16, 32, 32, "tiny"),)
    hl.run_linear(runner, CPU, shapes, warmup=1, reps=2, no_compile=True)
    records = {r.id: r for r in store.records.values()}
    assert set(records) == set(hl.linear_measurement_ids(shapes))
    assert records["linear/16x32x32/bf16-eager"].status == core.OK
    assert records["linear/16x32x32/weight-only-eager"].status == core.OK
    assert records["linear/16x32x32/scaled-mm-tensorwise-eager"].status == core.OK
    # row-wise scaled-mm has no CPU kernel: its own error is the result, and the run went on
    assert records["linear/16x32x32/scaled-mm-rowwise-eager"].status == core.ERROR
    assert records["linear/16x32x32/bf16-compiled"].status == core.NOT_RUN
    te = records["linear/16x32x32/te-current-eager"]
    assert te.status == core.ERROR
    assert "Transformer Engine" in te.error or "CUDA" in te.error
    assert "eager under torch.compile" in records["linear/16x32x32/te-block-compiled"].error
    # results.json was written as it went and reloads
    again = core.ResultStore(tmp_path)
    assert again.has_ok("linear/16x32x32/bf16-eager")
    assert hl.draw_linear_chart(store.records.values(), tmp_path / "linear.png")
    assert (tmp_path / "linear.png").stat().st_size > 1000
