"""Shared-input fp8 linears (fp8/shared_input_gemv.py) on CPU: refusals, the reference, the default configs, and
both kernels under Triton's interpreter. The GPU comparison with the layers themselves is in
tests/gpu/test_graphs_and_modulation_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.fp8.capability import Capability
from qwen_edit_hopper.fp8.linear import ScaledMMLinear, WeightOnlyLinear
from qwen_edit_hopper.fp8.shared_input_gemv import (
    DOT_CONFIG,
    FMA_CONFIG,
    ONE_ROW_CONFIG,
    SharedInputLinears,
    default_config,
    reference_shared_input,
    shared_input_capability,
)
from triton_interpreter import run_probe


def _linears(count=3, k=256, n=96, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        linear = torch.nn.Linear(k, n, bias=bias).to(torch.bfloat16)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(n, k, generator=g) * (i + 1))
            if bias:
                linear.bias.copy_(torch.randn(n, generator=g))
        out.append(linear)
    return out


def test_refusals_name_the_reason():
    rowwise = [ScaledMMLinear.from_linear(lin, "rowwise") for lin in _linears()]
    assert "CUDA" in shared_input_capability(rowwise).reason
    with pytest.raises(ValueError, match="CUDA"):
        SharedInputLinears(rowwise)
    mixed = [*rowwise[:2], WeightOnlyLinear.from_linear(_linears(1)[0])]
    assert "all be row-wise" in shared_input_capability(mixed).reason
    assert "divisible by 256" in shared_input_capability([ScaledMMLinear.from_linear(lin, "rowwise")
                                                       for lin in _linears(k=128)]).reason  # fmt: skip
    emulated = [ScaledMMLinear.from_linear(lin, "rowwise", emulate=True) for lin in _linears()]
    assert "not emulated" in shared_input_capability(emulated).reason
    assert shared_input_capability([]) == Capability(False, "no layers")


@pytest.mark.parametrize("rows", [1, 2])
def test_reference_is_what_the_layers_compute(rows):
    linears = _linears()
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    rowwise = [ScaledMMLinear.from_linear(lin, "rowwise") for lin in linears]
    emulated = [ScaledMMLinear.from_linear(lin, "rowwise", emulate=True) for lin in linears]
    want = torch.stack([layer(x) for layer in emulated]).float()
    got = reference_shared_input(rowwise, x).float()
    assert got.shape == (3, rows, 96)
    # the layers round the GEMM output to bf16 before adding the bias; the reference rounds once
    assert ((got - want).norm() / want.norm()).item() < 4e-3
    weight_only = [WeightOnlyLinear.from_linear(lin) for lin in linears]
    want = torch.stack([layer(x) for layer in weight_only]).float()
    got = reference_shared_input(weight_only, x).float()
    assert ((got - want).norm() / want.norm()).item() < 1e-2


_PROBE = """
import json, torch
from qwen_edit_hopper.fp8.capability import Capability
from qwen_edit_hopper.fp8.linear import ScaledMMLinear, WeightOnlyLinear
from qwen_edit_hopper.fp8.shared_input_gemv import SharedInputLinears, reference_shared_input

def truncate_bf16(x):  # the interpreter's fp32 -> bf16 cast
    return (x.float().view(torch.int32) & -65536).view(torch.float32)

g = torch.Generator().manual_seed(0)
rows_out = []
for kind, rows, bias, config in (("rowwise", 1, True, None), ("rowwise", 2, False, None),
                                 ("rowwise", 2, True, (64, 128, 4, 4)), ("weight_only", 1, True, None),
                                 ("rowwise", 1, True, (4, 128, 2, 2, "rowsum")),
                                 ("rowwise", 2, False, (4, 128, 2, 2, "rowsum")),
                                 ("weight_only", 1, True, (4, 128, 2, 2, "rowsum")),
                                 ("weight_only", 3, True, None)):  # the last group and x: the refusals below
    layers = []
    for i in range(3):
        lin = torch.nn.Linear(256, 96, bias=bias).to(torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(96, 256, generator=g) * (i + 1))
            if bias:
                lin.bias.copy_(torch.randn(96, generator=g))
        make = ScaledMMLinear.from_linear if kind == "rowwise" else WeightOnlyLinear.from_linear
        layers.append(make(lin, "rowwise") if kind == "rowwise" else make(lin))
    x = torch.randn(rows, 256, generator=g).bfloat16()
    group = SharedInputLinears(layers)
    group.config = config
    got = group(x).float()
    exact = reference_shared_input(layers, x).float()
    # float32 sums in another order, then a truncating cast: within one bf16 step of the reference
    step = exact.abs().clamp_min(1e-30) * 2.0 ** -7
    rows_out.append([kind, rows, list(got.shape), bool(((got - exact).abs() <= step * 1.01).all())])
refusals = []
for bad in (x.float(), x[:, :128], torch.randn(5, 256).bfloat16(), x[:0]):
    try:
        group(bad)
        refusals.append("accepted")
    except ValueError as exc:
        refusals.append(str(exc))
group.config = (4, 1024, 2, 2, "rowsum")  # steps of 1024 through K = 256: refused, not read out of bounds
try:
    group(x)
    refusals.append("accepted")
except ValueError as exc:
    refusals.append(str(exc))
print(json.dumps({"rows": rows_out, "refusals": refusals}))
"""


def test_kernels_under_the_interpreter_match_the_reference():
    probe = run_probe(_PROBE)
    result = probe["rows"]
    assert [r[2] for r in result] == [[3, 1, 96], [3, 2, 96], [3, 2, 96], [3, 1, 96], [3, 1, 96], [3, 2, 96],
                                      [3, 1, 96], [3, 3, 96]]
    assert all(r[3] for r in result), result
    # float32 input, the wrong K, more rows than the kernel takes, no rows: each refused with what it takes
    refusals = probe["refusals"]
    assert len(refusals) == 5 and "accepted" not in refusals, refusals
    assert all("(R <= 4, 256) bf16 input" in r for r in refusals[:4]), refusals
    assert "does not divide in_features=256" in refusals[4]
    assert "torch.float32 (3, 256)" in refusals[0] and "(3, 128)" in refusals[1]
    assert "(5, 256)" in refusals[2] and "(0, 256)" in refusals[3]


def test_default_config_by_rows_and_k():
    assert default_config(1, 3072) == ONE_ROW_CONFIG
    assert default_config(1, 256) == FMA_CONFIG  # K not a multiple of the one-row kernel's 1024-wide step
    assert default_config(2, 256) == DOT_CONFIG and default_config(4, 3072) == DOT_CONFIG
