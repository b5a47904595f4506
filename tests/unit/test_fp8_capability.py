"""Capability reasons and diagnose() on a CPU machine (plus simulated GPUs for the reason logic)."""

from __future__ import annotations

import importlib

import pytest
import torch
from qwen_edit_hopper.fp8 import backend_checks as checks_mod
from qwen_edit_hopper.fp8.backend_checks import check_backend, require_backend, te_capability
from qwen_edit_hopper.fp8.capability import Capability
from qwen_edit_hopper.fp8.config import Fp8Config, TeRecipeConfig
from qwen_edit_hopper.fp8.diagnose import diagnose
from qwen_edit_hopper.fp8.errors import Fp8UnavailableError
from qwen_edit_hopper.fp8.te_backend import te_import_status

diag_mod = importlib.import_module("qwen_edit_hopper.fp8.diagnose")  # the package re-exports the function

CPU_REASON = "needs a CUDA GPU with compute capability >= 8.9 (found: CPU)"


@pytest.mark.parametrize("backend", ["te", "scaled_mm_rowwise", "scaled_mm_tensorwise"])
def test_fp8_compute_backends_report_no_gpu_on_cpu(backend):
    result = check_backend(backend, "cpu")
    assert result == Capability(False, CPU_REASON)
    with pytest.raises(Fp8UnavailableError, match=rf"fp8 backend {backend}: needs a CUDA GPU"):
        require_backend(backend, "cpu")


def test_weight_only_and_emulation_are_allowed_anywhere():
    assert check_backend("weight_only", "cpu").ok
    emulated = check_backend(Fp8Config(backend="scaled_mm_rowwise", emulate=True), "cpu")
    assert emulated.ok and "emulated" in emulated.reason


def test_capability_is_a_frozen_value():
    c = Capability(True, "fine")
    with pytest.raises(AttributeError):
        c.ok = False


@pytest.mark.skipif(te_import_status()[0], reason="Transformer Engine is installed here")
def test_missing_transformer_engine_is_a_reason_not_a_crash():
    ok, reason, version = te_import_status()
    assert not ok and version is None
    assert reason.startswith("Transformer Engine is not installed")


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend a CUDA device with a chosen compute capability exists (reason logic only; nothing runs on it)."""

    def install(cc: tuple[int, int], name: str = "NVIDIA Fake GPU"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)

    return install


def test_old_gpu_reason_names_the_gpu(fake_gpu):
    fake_gpu((8, 0), "NVIDIA A100-SXM4-80GB")
    result = check_backend("scaled_mm_rowwise")
    assert result == Capability(False, "needs a CUDA GPU with compute capability >= 8.9 "
                                       "(found: NVIDIA A100-SXM4-80GB, compute capability 8.0)")


def test_blackwell_recipes_on_hopper_say_so(fake_gpu):
    fake_gpu((9, 0), "NVIDIA H100 80GB HBM3")
    for name in ("mxfp8", "nvfp4"):
        result = te_capability(TeRecipeConfig(name=name))
        assert not result.ok
        assert result.reason.startswith(f"{name.upper()} needs a Blackwell GPU (compute capability >= 10.0")


@pytest.mark.skipif(te_import_status()[0], reason="Transformer Engine is installed here")
def test_te_on_hopper_without_te_reports_the_install(fake_gpu):
    fake_gpu((9, 0), "NVIDIA H100 80GB HBM3")
    result = check_backend(Fp8Config(backend="te"))
    assert not result.ok and "Transformer Engine is not installed" in result.reason


def test_rowwise_probe_failure_becomes_the_reason(fake_gpu, monkeypatch):
    fake_gpu((9, 0), "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(checks_mod, "_probe_scaled_mm", lambda index, granularity: (False, "RuntimeError: no kernel"))
    result = check_backend("scaled_mm_rowwise")
    assert not result.ok
    assert "cannot run rowwise torch._scaled_mm on NVIDIA H100 80GB HBM3" in result.reason
    assert result.reason.endswith("RuntimeError: no kernel")


def test_diagnose_on_cpu_reports_no_gpu_with_reasons():
    d = diagnose("cpu")
    names = [line.name for line in d.lines]
    for expected in ("gpu", "compute capability", "fp8 compute", "torch", "CUDA", "cuDNN", "cuDNN loaded",
                     "Transformer Engine", "flash-attn", "FlashAttention-3", "cuDNN FP8 attention",
                     "SDPA backend (Qwen-Image)", "recommendation"):
        assert expected in names
    assert d.value("gpu") == "no GPU"
    assert d.value("cuDNN FP8 attention") == "no"
    assert d.value("fp8 compute") == "unavailable"
    assert d.value("torch") == torch.__version__
    assert all(isinstance(line.reason, str) for line in d.lines)
    assert next(line for line in d.lines if line.name == "fp8 compute").reason == CPU_REASON
    assert (d.recommendation, d.recommended_config) == ("bf16", None)
    name, _value, reason = d.lines[0]  # lines are (name, value, reason) tuples
    assert name == "gpu" and reason
    text = d.to_text()
    assert "recommendation" in text and "no GPU" in text


def test_diagnose_never_raises_when_a_probe_breaks(monkeypatch):
    def broken():
        raise OSError("libtransformer_engine.so: cannot open shared object file")

    monkeypatch.setattr(diag_mod, "te_import_status", broken)
    d = diagnose("cpu")
    te_line = next(line for line in d.lines if line.name == "Transformer Engine")
    assert te_line.value == "error" and "cannot open shared object file" in te_line.reason
