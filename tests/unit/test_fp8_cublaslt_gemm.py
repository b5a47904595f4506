"""The workspace-free cuBLASLt GEMM's config, capability reasons, operand checks and layer dispatch (CPU).

Its numbers are checked on a GPU (tests/gpu/test_fp8_backends.py): bit-identical to ``torch._scaled_mm``.
"""

from __future__ import annotations

import pytest
import torch
from qwen_edit_hopper.fp8 import backend_checks as checks_mod
from qwen_edit_hopper.fp8 import cublaslt_gemm
from qwen_edit_hopper.fp8 import linear as linear_mod
from qwen_edit_hopper.fp8.backend_checks import check_backend
from qwen_edit_hopper.fp8.capability import Capability
from qwen_edit_hopper.fp8.config import Fp8Config
from qwen_edit_hopper.fp8.errors import Fp8UnavailableError
from qwen_edit_hopper.fp8.linear import ScaledMMLinear
from qwen_edit_hopper.fp8.swap import quantize_linears
from torch import nn


def test_config_takes_gemm_kernel_for_rowwise_only():
    cfg = Fp8Config(backend="scaled_mm_rowwise", fast_accum=True, gemm_kernel="cublaslt")
    assert cfg.describe().endswith("fast accumulation, GEMM cublaslt")
    assert Fp8Config().gemm_kernel == "torch"
    with pytest.raises(ValueError, match="gemm_kernel='cublas' is not allowed; allowed values: torch, cublaslt"):
        Fp8Config(gemm_kernel="cublas")
    with pytest.raises(ValueError, match="gemm_kernel='cublaslt' is not allowed with backend='te'"):
        Fp8Config(backend="te", gemm_kernel="cublaslt")
    emulated = Fp8Config(emulate=True, gemm_kernel="cublaslt")
    assert "GEMM cublaslt (not used: emulated)" in emulated.describe()


def test_layers_get_the_kernel_and_tensorwise_refuses_it():
    model = nn.Sequential(nn.Linear(32, 48))
    quantize_linears(model, Fp8Config(preset=_all_linears(), emulate=True, gemm_kernel="cublaslt"))
    assert model[0].gemm_kernel == "cublaslt"
    assert "gemm_kernel=cublaslt" in repr(model[0])
    with pytest.raises(ValueError, match="gemm_kernel='cublaslt' takes row-wise scales only"):
        ScaledMMLinear.from_linear(nn.Linear(32, 48), "tensorwise", gemm_kernel="cublaslt")
    with pytest.raises(ValueError, match="gemm_kernel='x' is not allowed"):
        ScaledMMLinear.from_linear(nn.Linear(32, 48), gemm_kernel="x")


def _all_linears():
    from qwen_edit_hopper.fp8.presets import LayerPreset

    return LayerPreset(name="all", description="every linear", compute=(r".+",))


def test_gemm_dispatches_to_cublaslt_and_emulation_wins(monkeypatch):
    layer = ScaledMMLinear.from_linear(nn.Linear(32, 48), gemm_kernel="cublaslt")
    calls = []

    def fake(x8, x_scale, w8, w_scale, fast_accum):
        calls.append((tuple(x8.shape), tuple(w8.shape), fast_accum))
        return torch.zeros(x8.shape[0], w8.shape[0], dtype=torch.bfloat16)

    monkeypatch.setattr(linear_mod, "cublaslt_rowwise_mm", fake)
    x8, scale = layer.quantize_input(torch.randn(5, 32, dtype=torch.bfloat16))
    assert layer.gemm(x8, scale, torch.bfloat16).shape == (5, 48)
    assert calls == [((5, 32), (48, 32), False)]
    with pytest.raises(TypeError, match="gemm_kernel='cublaslt' writes bf16 only"):
        layer.gemm(x8, scale, torch.float16)
    layer.emulate = True
    layer.gemm(x8, scale, torch.bfloat16)
    assert len(calls) == 1


def test_cpu_reason_and_capability():
    no_gpu = Capability(False, "needs a CUDA GPU (torch.cuda.is_available() is False)")
    assert cublaslt_gemm.cublaslt_capability() == no_gpu
    assert check_backend(Fp8Config(emulate=True, gemm_kernel="cublaslt"), "cpu").ok


def test_pre_hopper_and_old_library_reasons(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert cublaslt_gemm.cublaslt_capability().reason.startswith("needs compute capability >= 9.0 (Hopper)")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    class OldLibrary:
        version, path = 120800, "libcublasLt.so.12"

    monkeypatch.setattr(cublaslt_gemm, "_library", lambda: OldLibrary())
    assert cublaslt_gemm.cublaslt_capability() == Capability(
        False, "needs cuBLASLt >= 12.9 for outer-vector fp8 scaling, libcublasLt.so.12 is version 120800")

    def missing():
        raise Fp8UnavailableError("cuBLASLt GEMM: libcublasLt could not be loaded (x: not found)")

    monkeypatch.setattr(cublaslt_gemm, "_library", missing)
    monkeypatch.setattr(checks_mod, "scaled_mm_capability", lambda granularity, device: Capability(True, "ok"))
    result = check_backend(Fp8Config(gemm_kernel="cublaslt"))
    assert not result.ok
    assert result.reason == ("gemm_kernel cublaslt cuBLASLt GEMM: libcublasLt could not be loaded (x: not found); "
                             "choose gemm_kernel torch")


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "dtype", "message"),
    [
        ((8, 32), (48, 32), torch.bfloat16, "x8 and w8 must be 2-D torch.float8_e4m3fn"),
        ((8, 32), (48, 16), torch.float8_e4m3fn, "need a shared K and K, N divisible by 16"),
        ((8, 24), (40, 24), torch.float8_e4m3fn, "need a shared K and K, N divisible by 16"),
    ],
)
def test_operand_errors_name_the_problem(x_shape, w_shape, dtype, message, monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    x8 = torch.zeros(x_shape).to(dtype)
    w8 = torch.zeros(w_shape).to(torch.float8_e4m3fn if dtype == torch.float8_e4m3fn else dtype)
    with pytest.raises(ValueError, match=message):
        cublaslt_gemm._check_operands(x8, torch.ones(x_shape[0], 1), w8, torch.ones(w_shape[0], 1))


def test_operand_errors_on_strides_and_scales(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    w8 = torch.zeros(48, 32).to(torch.float8_e4m3fn)
    ws = torch.ones(48, 1)
    x8 = torch.zeros(8, 32).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="x8 needs unit column stride"):
        cublaslt_gemm._check_operands(torch.zeros(32, 8).to(torch.float8_e4m3fn).t(), torch.ones(8, 1), w8, ws)
    with pytest.raises(ValueError, match=r"x_scale must be 8 contiguous float32 values \(\[8, 1\]\)"):
        cublaslt_gemm._check_operands(x8, torch.ones(8, 1, dtype=torch.float64), w8, ws)
    with pytest.raises(ValueError, match=r"w_scale must be 48 contiguous float32 values"):
        cublaslt_gemm._check_operands(x8, torch.ones(8, 1), w8, torch.ones(48, 2)[:, :1])
    cublaslt_gemm._check_operands(x8, torch.ones(8, 1), w8, ws)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="every operand must be a CUDA tensor"):
        cublaslt_gemm._check_operands(x8, torch.ones(8, 1), w8, ws)
