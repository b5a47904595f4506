"""The pack's workspace-free cuBLASLt GEMM on a real Hopper GPU: bit-identical to ``torch._scaled_mm``, no
memset in its CUDA graph, capturable, compiled as one opaque op, and the layer setting routes through it.

Run on the device machine: ``python3 -m pytest tests/gpu/test_cublaslt_gemm_gpu.py -m gpu -q``.
"""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.fp8 import cublaslt_gemm
from qwen_edit_hopper.fp8.linear import ScaledMMLinear
from qwen_edit_hopper.fp8.quant import relative_error
from torch import nn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def _needs_cublaslt():
    capability = cublaslt_gemm.cublaslt_capability()
    if not capability.ok:
        pytest.skip(capability.reason)


def _operands(m: int, k: int, n: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x8 = torch.randn(m, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
    w8 = torch.randn(n, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
    xs = torch.rand(m, 1, device="cuda", generator=g) + 0.5
    ws = torch.rand(n, 1, device="cuda", generator=g) + 0.5
    return x8, xs, w8, ws


def _torch_mm(x8, xs, w8, ws, fast_accum):
    return torch._scaled_mm(x8, w8.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accum)


@pytest.mark.parametrize("fast_accum", [True, False])
@pytest.mark.parametrize("m, k, n, exact", [(8192, 3072, 3072, True), (8192, 12288, 3072, True),
                                            (300, 3072, 12288, True), (1, 3072, 18432, False), (37, 64, 48, False)])
def test_same_numbers_as_torch_scaled_mm(m, k, n, exact, fast_accum):
    """Bit-identical at the forward's shapes (measured: the same kernel); elsewhere cuBLASLt may pick another
    workspace-free kernel than torch's, so within 1e-3 there."""
    x8, xs, w8, ws = _operands(m, k, n)
    got = cublaslt_gemm.cublaslt_rowwise_mm(x8, xs, w8, ws, fast_accum)
    want = _torch_mm(x8, xs, w8, ws, fast_accum)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    if exact and fast_accum:  # the forward's setting
        assert torch.equal(got, want)
    else:
        assert relative_error(got, want) < 1e-3
    plan = cublaslt_gemm.plans()[(x8.device.index, m, n, k, k, fast_accum, "none")]
    assert plan.config["id"] is not None and plan.candidates >= 1


def test_strided_rows_and_a_cuda_graph_without_memsets():
    """A row stride wider than K (a slice of a wider buffer) gives the same numbers; one graphed call has no
    memset node (``torch._scaled_mm`` at this shape has one before its stream-K kernel)."""
    x8, xs, w8, ws = _operands(8192, 3072, 3072, seed=1)
    wide = torch.zeros(8192, 3072 + 64, device="cuda").to(torch.float8_e4m3fn)
    wide[:, :3072] = x8
    assert torch.equal(cublaslt_gemm.cublaslt_rowwise_mm(wide[:, :3072], xs, w8, ws), _torch_mm(x8, xs, w8, ws, True))

    graph = torch.cuda.CUDAGraph()
    cublaslt_gemm.cublaslt_rowwise_mm(x8, xs, w8, ws)
    with torch.cuda.graph(graph):
        out = cublaslt_gemm.cublaslt_rowwise_mm(x8, xs, w8, ws)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert names and not [n for n in names if "memset" in n.lower()], names
    assert torch.equal(out, _torch_mm(x8, xs, w8, ws, True))


def test_layer_routes_through_it_compiled_and_matches_the_torch_kernel(monkeypatch):
    """A ``gemm_kernel='cublaslt'`` layer under torch.compile(fullgraph) calls the op (a spy counts) and gives
    what the same layer gives with ``gemm_kernel='torch'``."""
    from qwen_edit_hopper.fp8 import linear as linear_module

    torch.manual_seed(0)
    lin = nn.Linear(3072, 3072).to("cuda", torch.bfloat16)
    layer = ScaledMMLinear.from_linear(lin, "rowwise", fast_accum=True, gemm_kernel="cublaslt")
    x = torch.randn(2048, 3072, device="cuda", dtype=torch.bfloat16)
    calls = []
    real = linear_module.cublaslt_rowwise_mm
    monkeypatch.setattr(linear_module, "cublaslt_rowwise_mm", lambda *a: calls.append(1) or real(*a))
    torch._dynamo.reset()
    got = torch.compile(layer, fullgraph=True)(x)
    assert calls
    layer.gemm_kernel = "torch"
    want = layer(x)
    assert relative_error(got, want) < 1e-6


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("m, k, n", [(8192, 3072, 3072), (8192, 12288, 3072), (600, 12288, 3072)])
def test_residual_epilogue_matches_its_float32_statement(m, k, n, bias):
    """``residual + x_scale * col_scale * acc + bias`` in one call: within bf16 rounding of the float32
    reference (the epilogue rounds once), and C is read, not written."""
    x8, xs, w8, ws = _operands(m, k, n, seed=2)
    g = torch.Generator(device="cuda").manual_seed(3)
    residual = (torch.randn(m, n, device="cuda", generator=g) * 4).to(torch.bfloat16)
    before = residual.clone()
    gate = torch.randn(n, device="cuda", generator=g) * 0.1
    col_scale = ws.reshape(n) * gate
    vector = (torch.randn(n, device="cuda", generator=g) * 0.1).to(torch.bfloat16) if bias else None
    got = cublaslt_gemm.cublaslt_rowwise_mm_residual(x8, xs, w8, col_scale, vector, residual)
    want = cublaslt_gemm.reference_rowwise_residual(x8, xs, w8, col_scale, vector, residual)
    assert torch.equal(residual, before)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert relative_error(got, want) < 4e-3
    update = got.float() - residual.float()  # the GEMM part must be there, not only C
    assert relative_error(update, want.float() - residual.float()) < 2e-2
    epilogue = "residual+bias" if bias else "residual"
    assert cublaslt_gemm.plans()[(x8.device.index, m, n, k, k, True, epilogue)].algo is not None

