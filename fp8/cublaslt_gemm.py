"""Row-wise fp8 GEMM through the pack's own cuBLASLt call: no workspace, the algorithm timed per shape (CUDA).

``torch._scaled_mm`` hands cuBLASLt PyTorch's workspace, so for the image stream's GEMMs (M = 8192 tokens)
cuBLASLt's heuristic picks a stream-K kernel that needs a zeroed slice of that workspace: a memset before
every such GEMM, 360 per forward, each followed by a gap of about 3 us before the GEMM starts (profile,
docs/decisions/0002-own-cublaslt-call.md). PyTorch sizes the workspace once per process from
``CUBLASLT_WORKSPACE_SIZE``; setting that would change every cuBLASLt call of the ComfyUI process.

This module calls cuBLASLt itself (ctypes, the ``libcublasLt`` PyTorch already loaded) with the same problem
``torch._scaled_mm`` poses for row-wise scales, but asks the heuristic only for algorithms that need no
workspace, and on the first call of each shape times up to :data:`CANDIDATES` of them on the real operands
and keeps the fastest (CUDA events; not while a CUDA graph is being captured, where it takes the
heuristic's first). Calls are capturable: no workspace, no host synchronization after the plan exists.

Problem (cuBLASLt is column-major; the row-major operands are read transposed, as PyTorch does):
``out[M, N] = bf16(x_scale[m] * w_scale[n] * sum_k x8[m, k] * w8[n, k])`` with A = w8 (``TRANSA=T``,
[K, N], ld K), B = x8 ([K, M], ld = x8's row stride), D = out ([N, M], ld N), scale mode
``OUTER_VEC_32F`` on both, compute fp32, fast accumulation when asked.

:func:`cublaslt_rowwise_mm_residual` poses the same problem with a bf16 residual C added (``beta = 1``) and an
optional bf16 bias in cuBLASLt's epilogue: ``out = bf16(residual + x_scale[m] * col_scale[n] * acc + bias[n])``.
With ``col_scale = w_scale * gate`` and ``bias = gate * layer bias`` that is a DiT block's gated residual update
``x + gate * linear(h)`` in the GEMM's epilogue, without a pass of its own over the (M, N) output (one gate row
for all M rows: the gate must not vary per token).

Limits: CUDA, a cuBLASLt with outer-vector fp8 scaling (CUDA 12.9 or newer) on compute capability 9.0 or
newer; x8 [M, K] float8_e4m3fn with unit column stride and a row stride that is a multiple of 16, x_scale
[M, 1] float32, w8 [N, K] float8_e4m3fn contiguous, w_scale [N, 1] float32; K and N multiples of 16;
bf16 output. Registered as ``qwen_edit_hopper::cublaslt_rowwise_mm`` (``torch.library.custom_op``), so
``torch.compile`` keeps it in the graph as one opaque call. Not thread-safe across concurrent callers of one
shape (the plan's descriptor takes each call's scale pointers); ComfyUI runs one prompt at a time.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass

import torch

from .capability import Capability
from .errors import Fp8UnavailableError
from .quant import FP8_DTYPE

__all__ = ["CANDIDATES", "OP_NAME", "RESIDUAL_OP_NAME", "LtPlan", "cublaslt_capability", "cublaslt_rowwise_mm",
           "cublaslt_rowwise_mm_residual", "plan_for", "plans", "reference_rowwise_residual"]

logger = logging.getLogger(__name__)

OP_NAME = "qwen_edit_hopper::cublaslt_rowwise_mm"
RESIDUAL_OP_NAME = "qwen_edit_hopper::cublaslt_rowwise_mm_residual"

CANDIDATES = 8
"""Heuristic results (workspace-free) timed per shape on its first call."""

TIMING_REPS = 10

# cublasLt.h / cublas_api.h / library_types.h (CUDA 13.x; stable values)
_CUBLAS_COMPUTE_32F = 68
_CUDA_R_32F = 0
_CUDA_R_16BF = 14
_CUDA_R_8F_E4M3 = 28
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_EPILOGUE, _DESC_BIAS_POINTER = 7, 8
_EPILOGUE_BIAS = 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_FAST_ACCUM = 25
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32
_SCALE_OUTER_VEC_32F = 3
_PREF_MAX_WORKSPACE_BYTES = 1
_ALGO_CONFIG = {"id": (0, ctypes.c_int32), "tile": (1, ctypes.c_uint32), "splitk": (2, ctypes.c_int32),
                "reduction": (3, ctypes.c_uint32), "swizzle": (4, ctypes.c_uint32), "stages": (6, ctypes.c_uint32),
                "cluster": (8, ctypes.c_uint16)}


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _loaded_library_path() -> str | None:
    """Path of the libcublasLt PyTorch loaded into this process (from /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if os.path.basename(path).startswith("libcublasLt.so"):
                    return path
    except OSError:
        return None
    return None


class _Library:
    """ctypes view of libcublasLt: the functions this module calls, with their argument types."""

    def __init__(self) -> None:
        path = _loaded_library_path()
        names = [path] if path else ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]
        errors = []
        for name in names:
            try:
                self.lib = ctypes.CDLL(name)
                self.path = name
                break
            except OSError as exc:
                errors.append(f"{name}: {exc}")
        else:
            raise Fp8UnavailableError("cuBLASLt GEMM: libcublasLt could not be loaded (" + "; ".join(errors) + ")")
        p, vp, sz = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t
        lib = self.lib
        lib.cublasLtGetVersion.restype = sz
        for fn, args in {
            "cublasLtCreate": [vp],
            "cublasLtMatmulDescCreate": [vp, ctypes.c_int, ctypes.c_int],
            "cublasLtMatmulDescSetAttribute": [p, ctypes.c_int, p, sz],
            "cublasLtMatrixLayoutCreate": [vp, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
            "cublasLtMatmulPreferenceCreate": [vp],
            "cublasLtMatmulPreferenceSetAttribute": [p, ctypes.c_int, p, sz],
            "cublasLtMatmulPreferenceDestroy": [p],
            "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, ctypes.c_int, ctypes.POINTER(_HeuristicResult),
                                               ctypes.POINTER(ctypes.c_int)],
            "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(_Algo), ctypes.c_int, p, sz,
                                                     ctypes.POINTER(sz)],
            "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, ctypes.POINTER(_Algo), p, sz, p],
        }.items():
            getattr(lib, fn).argtypes = args
            getattr(lib, fn).restype = ctypes.c_int
        self.version = int(lib.cublasLtGetVersion())
        handle = ctypes.c_void_p()
        self.check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
        self.handle = handle

    @staticmethod
    def check(status: int, what: str) -> None:
        if status != 0:
            raise Fp8UnavailableError(f"cuBLASLt GEMM: {what} failed with cublasStatus {status}")


_LIBRARY: _Library | None = None
_LOCK = threading.RLock()


def _library() -> _Library:
    global _LIBRARY
    with _LOCK:
        if _LIBRARY is None:
            _LIBRARY = _Library()
        return _LIBRARY


def cublaslt_capability(device: torch.device | None = None) -> Capability:
    """Whether this module's GEMM can run on ``device`` (default: the current CUDA device).

    Needs CUDA, compute capability >= 9.0, a loadable libcublasLt of version >= 12.9 (outer-vector fp8
    scaling) and a successful cuBLASLt handle.
    """
    if not torch.cuda.is_available():
        return Capability.no("needs a CUDA GPU (torch.cuda.is_available() is False)")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        return Capability.no(f"needs a CUDA device, got {device}")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return Capability.no(f"needs compute capability >= 9.0 (Hopper) for outer-vector fp8 scaling, got "
                             f"{major}.{minor}")
    try:
        lib = _library()
    except Fp8UnavailableError as exc:
        return Capability.no(str(exc))
    if lib.version < 120900:
        return Capability.no(f"needs cuBLASLt >= 12.9 for outer-vector fp8 scaling, {lib.path} is version "
                             f"{lib.version}")
    return Capability.yes(f"cuBLASLt {lib.version} ({lib.path})")


@dataclass
class LtPlan:
    """One shape's descriptors and chosen algorithm (held for the life of the process)."""

    key: tuple
    desc: ctypes.c_void_p
    layouts: tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    algo: _Algo | None = None
    config: dict | None = None
    timings_us: tuple[float, ...] = ()
    candidates: int = 0


_PLANS: dict[tuple, LtPlan] = {}


def plans() -> dict[tuple, LtPlan]:
    """Every plan made so far: key (device index, M, N, K, x row stride, fast_accum, epilogue) -> :class:`LtPlan`."""
    return dict(_PLANS)


def _set(lib: _Library, setter, obj, attr: int, value: ctypes._SimpleCData, what: str) -> None:
    lib.check(setter(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), what)


def _new_plan(lib: _Library, key: tuple) -> LtPlan:
    _, m, n, k, ldb, fast_accum, epilogue = key
    desc = ctypes.c_void_p()
    lib.check(lib.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _CUBLAS_COMPUTE_32F, _CUDA_R_32F),
              "cublasLtMatmulDescCreate")
    set_desc = lib.lib.cublasLtMatmulDescSetAttribute
    _set(lib, set_desc, desc, _DESC_TRANSA, ctypes.c_int32(_OP_T), "TRANSA")
    _set(lib, set_desc, desc, _DESC_TRANSB, ctypes.c_int32(_OP_N), "TRANSB")
    _set(lib, set_desc, desc, _DESC_FAST_ACCUM, ctypes.c_int8(1 if fast_accum else 0), "FAST_ACCUM")
    _set(lib, set_desc, desc, _DESC_A_SCALE_MODE, ctypes.c_int32(_SCALE_OUTER_VEC_32F), "A_SCALE_MODE")
    _set(lib, set_desc, desc, _DESC_B_SCALE_MODE, ctypes.c_int32(_SCALE_OUTER_VEC_32F), "B_SCALE_MODE")
    if epilogue == "residual+bias":
        _set(lib, set_desc, desc, _DESC_EPILOGUE, ctypes.c_uint32(_EPILOGUE_BIAS), "EPILOGUE")
    layouts = []
    for dtype, rows, cols, ld in ((_CUDA_R_8F_E4M3, k, n, k), (_CUDA_R_8F_E4M3, k, m, ldb), (_CUDA_R_16BF, n, m, n)):
        layout = ctypes.c_void_p()
        lib.check(lib.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld),
                  "cublasLtMatrixLayoutCreate")
        layouts.append(layout)
    return LtPlan(key=key, desc=desc, layouts=tuple(layouts))


def _heuristics(lib: _Library, plan: LtPlan, count: int) -> list[_Algo]:
    pref = ctypes.c_void_p()
    lib.check(lib.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
    try:
        _set(lib, lib.lib.cublasLtMatmulPreferenceSetAttribute, pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(0),
             "MAX_WORKSPACE_BYTES")
        results = (_HeuristicResult * count)()
        returned = ctypes.c_int(0)
        a, b, d = plan.layouts
        lib.check(lib.lib.cublasLtMatmulAlgoGetHeuristic(lib.handle, plan.desc, a, b, d, d, pref, count, results,
                                                         ctypes.byref(returned)), "cublasLtMatmulAlgoGetHeuristic")
    finally:
        lib.lib.cublasLtMatmulPreferenceDestroy(pref)
    algos = [results[i].algo for i in range(returned.value) if results[i].state == 0]
    if not algos:
        _, m, n, k, _, _, epilogue = plan.key
        raise Fp8UnavailableError(f"cuBLASLt GEMM: no workspace-free algorithm for M={m}, N={n}, K={k} "
                                  f"(row-wise e4m3 -> bf16, epilogue {epilogue}); "
                                  f"use gemm_kernel='torch' for this model")
    return algos


def algo_config(algo: _Algo) -> dict:
    """The algorithm's id, tile id, split-K count, reduction scheme, swizzle, stages id and cluster shape id."""
    lib = _library()
    out = {}
    for name, (attr, ctype) in _ALGO_CONFIG.items():
        value, written = ctype(0), ctypes.c_size_t(0)
        status = lib.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value),
                                                              ctypes.sizeof(value), ctypes.byref(written))
        out[name] = int(value.value) if status == 0 else None
    return out


def _set_scales(lib: _Library, plan: LtPlan, x_scale: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> None:
    """Point the descriptor at this call's scale vectors and bias (the heuristic also wants them set)."""
    set_desc = lib.lib.cublasLtMatmulDescSetAttribute
    _set(lib, set_desc, plan.desc, _DESC_A_SCALE_POINTER, ctypes.c_void_p(w_scale.data_ptr()), "A_SCALE_POINTER")
    _set(lib, set_desc, plan.desc, _DESC_B_SCALE_POINTER, ctypes.c_void_p(x_scale.data_ptr()), "B_SCALE_POINTER")
    if bias is not None:
        _set(lib, set_desc, plan.desc, _DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()), "BIAS_POINTER")


def _launch(lib: _Library, plan: LtPlan, algo: _Algo, x8, x_scale, w8, w_scale, out, residual=None,
            bias=None) -> None:
    _set_scales(lib, plan, x_scale, w_scale, bias)
    a, b, d = plan.layouts
    stream = torch.cuda.current_stream(out.device).cuda_stream
    c, beta = (out, _ZERO) if residual is None else (residual, _ONE)
    lib.check(lib.lib.cublasLtMatmul(lib.handle, plan.desc, ctypes.byref(_ONE), ctypes.c_void_p(w8.data_ptr()), a,
                                     ctypes.c_void_p(x8.data_ptr()), b, ctypes.byref(beta),
                                     ctypes.c_void_p(c.data_ptr()), d, ctypes.c_void_p(out.data_ptr()), d,
                                     ctypes.byref(algo), None, 0, ctypes.c_void_p(stream)), "cublasLtMatmul")


_ONE, _ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)


def _choose(lib: _Library, plan: LtPlan, algos: list[_Algo], x8, x_scale, w8, w_scale, out, residual=None,
            bias=None) -> None:
    """Time each candidate on the real operands (``out`` is overwritten) and keep the fastest."""
    timings = []
    for algo in algos:
        try:
            _launch(lib, plan, algo, x8, x_scale, w8, w_scale, out, residual, bias)
        except Fp8UnavailableError:
            timings.append(float("inf"))
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(TIMING_REPS):
            _launch(lib, plan, algo, x8, x_scale, w8, w_scale, out, residual, bias)
        end.record()
        end.synchronize()
        timings.append(start.elapsed_time(end) * 1000.0 / TIMING_REPS)
    best = min(range(len(algos)), key=timings.__getitem__)
    plan.algo, plan.timings_us = algos[best], tuple(round(t, 2) for t in timings)


def plan_for(x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, fast_accum: bool,
             out: torch.Tensor, residual: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> LtPlan:
    """The shape's plan, made (and, outside CUDA-graph capture, timed on these operands) on its first call.

    ``residual`` / ``bias``: the epilogue's C matrix and bias vector (their presence is part of the plan's key).
    """
    m, k = x8.shape
    n = w8.shape[0]
    # the plan's epilogue: D = AB (scaled), D = AB + C, or D = AB + C + bias
    epilogue = "none" if residual is None else "residual" if bias is None else "residual+bias"
    key = (x8.device.index, m, n, k, x8.stride(0), bool(fast_accum), epilogue)
    plan = _PLANS.get(key)  # only finished plans are stored
    if plan is not None:
        return plan
    lib = _library()
    with _LOCK:
        plan = _PLANS.get(key)
        if plan is not None:  # another caller finished it meanwhile
            return plan
        plan = _new_plan(lib, key)
        _set_scales(lib, plan, x_scale, w_scale, bias)
        algos = _heuristics(lib, plan, CANDIDATES)
        plan.candidates = len(algos)
        if torch.cuda.is_current_stream_capturing() or len(algos) == 1:
            plan.algo = algos[0]
        else:
            _choose(lib, plan, algos, x8, x_scale, w8, w_scale, out, residual, bias)
        plan.config = algo_config(plan.algo)
        _PLANS[key] = plan
    logger.info("cuBLASLt GEMM M=%d N=%d K=%d (epilogue %s): algorithm %s of %d candidates (us: %s)", m, n, k,
                epilogue, plan.config, plan.candidates, plan.timings_us)
    return plan


def _check_operands(x8, x_scale, w8, w_scale) -> None:
    if not (x8.is_cuda and w8.is_cuda and x_scale.is_cuda and w_scale.is_cuda):
        raise ValueError("cublaslt_rowwise_mm: every operand must be a CUDA tensor")
    if x8.dtype != FP8_DTYPE or w8.dtype != FP8_DTYPE or x8.dim() != 2 or w8.dim() != 2:
        raise ValueError(f"cublaslt_rowwise_mm: x8 and w8 must be 2-D {FP8_DTYPE}, got {x8.dtype} {tuple(x8.shape)} "
                         f"and {w8.dtype} {tuple(w8.shape)}")
    m, k = x8.shape
    n = w8.shape[0]
    if w8.shape[1] != k or k % 16 or n % 16:
        raise ValueError(f"cublaslt_rowwise_mm: x8 {tuple(x8.shape)} and w8 {tuple(w8.shape)} need a shared K and "
                         f"K, N divisible by 16")
    if x8.stride(1) != 1 or x8.stride(0) % 16 or not w8.is_contiguous():
        raise ValueError(f"cublaslt_rowwise_mm: x8 needs unit column stride and a row stride divisible by 16 "
                         f"(strides {x8.stride()}); w8 must be contiguous")
    for name, scale, rows in (("x_scale", x_scale, m), ("w_scale", w_scale, n)):
        if scale.dtype != torch.float32 or scale.numel() != rows or (rows > 1 and scale.stride(0) != 1):
            raise ValueError(f"cublaslt_rowwise_mm: {name} must be {rows} contiguous float32 values ([{rows}, 1]), "
                             f"got {scale.dtype} {tuple(scale.shape)} strides {scale.stride()}")


@torch.library.custom_op(OP_NAME, mutates_args=())
def _cublaslt_rowwise_mm_op(x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                            fast_accum: bool) -> torch.Tensor:
    out = torch.empty((x8.shape[0], w8.shape[0]), dtype=torch.bfloat16, device=x8.device)
    if out.numel() == 0:
        return out
    lib = _library()
    plan = plan_for(x8, x_scale, w8, w_scale, fast_accum, out)
    _launch(lib, plan, plan.algo, x8, x_scale, w8, w_scale, out)
    return out


@_cublaslt_rowwise_mm_op.register_fake
def _(x8, x_scale, w8, w_scale, fast_accum):
    return x8.new_empty((x8.shape[0], w8.shape[0]), dtype=torch.bfloat16)


def cublaslt_rowwise_mm(x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                        fast_accum: bool = True) -> torch.Tensor:
    """x8 [M, K] e4m3, x_scale [M, 1] float32, w8 [N, K] e4m3, w_scale [N, 1] float32 -> [M, N] bf16.

    The row-wise problem ``torch._scaled_mm(x8, w8.t(), x_scale, w_scale.t(), out_dtype=bfloat16)`` poses,
    through a workspace-free cuBLASLt algorithm timed per shape (module docstring). Raises ValueError on
    operands outside the limits, :class:`~.errors.Fp8UnavailableError` when cuBLASLt cannot run it.
    """
    _check_operands(x8, x_scale, w8, w_scale)
    return _cublaslt_rowwise_mm_op(x8, x_scale, w8, w_scale, bool(fast_accum))


def _check_residual_operands(x8, w8, bias, residual) -> None:
    m, n = x8.shape[0], w8.shape[0]
    if not residual.is_cuda or residual.dtype != torch.bfloat16 or tuple(residual.shape) != (m, n) \
            or not residual.is_contiguous():
        raise ValueError(f"cublaslt_rowwise_mm_residual: residual must be a contiguous CUDA bf16 [{m}, {n}] tensor, "
                         f"got {residual.dtype} {tuple(residual.shape)} strides {residual.stride()}")
    if bias is not None and (not bias.is_cuda or bias.dtype != torch.bfloat16 or bias.numel() != n
                             or not bias.is_contiguous()):
        raise ValueError(f"cublaslt_rowwise_mm_residual: bias must be {n} contiguous bf16 CUDA values, "
                         f"got {bias.dtype} {tuple(bias.shape)}")


@torch.library.custom_op(RESIDUAL_OP_NAME, mutates_args=())
def _cublaslt_rowwise_mm_residual_op(x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor,
                                     col_scale: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                                     fast_accum: bool) -> torch.Tensor:
    out = torch.empty_like(residual)
    if out.numel() == 0:
        return out
    lib = _library()
    plan = plan_for(x8, x_scale, w8, col_scale, fast_accum, out, residual, bias)
    _launch(lib, plan, plan.algo, x8, x_scale, w8, col_scale, out, residual, bias)
    return out


@_cublaslt_rowwise_mm_residual_op.register_fake
def _(x8, x_scale, w8, col_scale, bias, residual, fast_accum):
    return torch.empty_like(residual)


def cublaslt_rowwise_mm_residual(x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, col_scale: torch.Tensor,
                                 bias: torch.Tensor | None, residual: torch.Tensor,
                                 fast_accum: bool = True) -> torch.Tensor:
    """``residual + x_scale * col_scale * (x8 . w8^T) + bias`` in one cuBLASLt call -> [M, N] bf16.

    x8 [M, K] e4m3, x_scale [M, 1] float32, w8 [N, K] e4m3, col_scale [N] or [N, 1] float32 (a weight scale,
    possibly times a gate), bias None or [N] bf16, residual [M, N] bf16 contiguous (C, read once; not modified).
    Products and sums in float32, one rounding to bf16 at the end. Raises ValueError on operands outside the
    limits, :class:`~.errors.Fp8UnavailableError` when cuBLASLt cannot run it.
    """
    _check_operands(x8, x_scale, w8, col_scale)
    _check_residual_operands(x8, w8, bias, residual)
    return _cublaslt_rowwise_mm_residual_op(x8, x_scale, w8, col_scale, bias, residual, bool(fast_accum))


def reference_rowwise_residual(x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, col_scale: torch.Tensor,
                               bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
    """What :func:`cublaslt_rowwise_mm_residual` computes, in float32 on any device (for tests)."""
    acc = x8.float() @ w8.float().t()
    out = residual.float() + acc * x_scale.float().reshape(-1, 1) * col_scale.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float().reshape(1, -1)
    return out.to(torch.bfloat16)
