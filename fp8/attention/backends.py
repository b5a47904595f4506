"""Registry of attention backends for the DiT's joint attention, each with a capability check that gives a reason.

One entry point::

    out = attention(q, k, v, backend="sdpa_cudnn")   # q, k, v: (B, H, S, D) -> out: (B, S, H*D)

Backends (``BACKENDS``):

* ``sdpa``: ``F.scaled_dot_product_attention``, PyTorch chooses the kernel.
* ``sdpa_cudnn``, ``sdpa_flash``, ``sdpa_efficient``, ``sdpa_math``: the same call forced to one
  kernel through ``torch.nn.attention.sdpa_kernel`` (PyTorch raises if it cannot run it; nothing
  falls back). On CPU PyTorch 2.11 has ``math`` and ``flash`` kernels only.
* ``flash_attn``: FlashAttention-3 (``flash_attn_interface``) or FlashAttention-2 (``flash_attn``),
  when importable.
* ``triton_fp8``: this pack's 8-bit Triton kernel (:mod:`.triton_fp8`): int8/e4m3 QK^T, PV in
  bf16, int8 or e4m3 per :class:`.triton_fp8.Fp8AttentionConfig`; CUDA compute capability 9.0
  (Hopper) only, bf16 inputs, head dim 64 or 128. Wrapped as the custom op
  ``torch.ops.qwen_edit_hopper.fp8_attention`` so ``torch.compile`` traces around it.
* ``gluon_int8``: the same int8-QK / bf16-PV numerics in a Gluon kernel with FlashAttention-3's
  overlap of the softmax with the tensor cores (:mod:`.gluon_int8`); compute capability 9.0, bf16,
  head dim 128 only; the custom op ``torch.ops.qwen_edit_hopper.gluon_int8_attention``.

* ``cudnn_fp8``: cuDNN's FP8 fused attention through the optional ``nvidia-cudnn-frontend`` package
  (:mod:`.cudnn_fp8`): per-tensor e4m3 q/k/v/P/O, compute capability 9.0 or newer, bf16 inputs; the
  kernel is the custom op ``torch.ops.qwen_edit_hopper.cudnn_fp8_attention`` and the quantization
  around it stays in the compiled graph.
* ``cudnn_fp8_emulated``: the same quantization with the kernel replaced by its fp32 mirror
  (``cudnn_fp8.reference_kernel``): runs anywhere, no speed. The Load node picks it for
  ``cudnn_fp8`` only when ``QWEN_EDIT_FP8_EMULATE=1`` (tests on CPU machines) and says so.

``check_backend(name, device)`` returns ``(ok, reason)`` without running anything; an unavailable
backend passed to ``attention`` raises :class:`AttentionUnavailableError` with that reason. There
is no silent fallback anywhere. The SDPA backends add no graph breaks under ``torch.compile``
(checks are skipped while compiling: the forced kernel itself raises if it cannot run).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import Fp8UnavailableError

__all__ = [
    "BACKENDS",
    "AttentionUnavailableError",
    "attention",
    "available_backends",
    "check_backend",
    "fp8_attention_op",
]

logger = logging.getLogger(__name__)

BACKENDS = (
    "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math", "flash_attn", "triton_fp8", "gluon_int8",
    "cudnn_fp8", "cudnn_fp8_emulated",
)  # fmt: skip

_SDPA_FORCED = {
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_math": SDPBackend.MATH,
}
TRITON_FP8_HEAD_DIMS = (64, 128)
GLUON_INT8_HEAD_DIMS = (128,)


class AttentionUnavailableError(Fp8UnavailableError):
    """The requested attention backend cannot run here; the message carries the capability reason."""


def _as_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _cuda_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def _need_cuda(device: torch.device, what: str, min_cc: tuple[int, int] | None = None) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, f"{what} needs a CUDA device (got {device.type})"
    cc = _cuda_capability(device)
    if cc is None:
        return False, f"{what} needs a CUDA device, and torch.cuda.is_available() is False"
    if min_cc is not None and cc < min_cc:
        return False, f"{what} needs compute capability {min_cc[0]}.{min_cc[1]} or higher (found {cc[0]}.{cc[1]})"
    return True, ""


def _check_sdpa(device: torch.device) -> tuple[bool, str]:
    return True, "PyTorch chooses the kernel"


def _check_sdpa_math(device: torch.device) -> tuple[bool, str]:
    return True, "reference kernel: materializes the (S, S) score matrix; slow and memory-hungry at long S"


def _check_sdpa_flash(device: torch.device) -> tuple[bool, str]:
    if device.type == "cpu":
        return True, "PyTorch's CPU flash-attention kernel"
    ok, reason = _need_cuda(device, "SDPA flash attention", (8, 0))
    if not ok:
        return ok, reason
    if not torch.backends.cuda.is_flash_attention_available():
        return False, "this PyTorch build has no flash-attention kernel"
    return True, "PyTorch's FlashAttention-2 kernel (fp16/bf16, head dim <= 256)"


def _check_sdpa_efficient(device: torch.device) -> tuple[bool, str]:
    if device.type == "cpu":
        return False, "SDPA memory-efficient attention has no CPU kernel in PyTorch (CUDA only)"
    ok, reason = _need_cuda(device, "SDPA memory-efficient attention", (5, 0))
    return (ok, reason) if not ok else (True, "PyTorch's memory-efficient (CUTLASS) kernel")


def _check_sdpa_cudnn(device: torch.device) -> tuple[bool, str]:
    if device.type == "cpu":
        return False, "SDPA cuDNN attention needs a CUDA device (no CPU kernel)"
    ok, reason = _need_cuda(device, "SDPA cuDNN attention", (8, 0))
    if not ok:
        return ok, reason
    if not torch.backends.cudnn.is_available():
        return False, "cuDNN is not available in this PyTorch build"
    version = torch.backends.cudnn.version() or 0
    if version < 90000:
        return False, f"SDPA cuDNN attention needs cuDNN 9 or newer (found {version})"
    return True, f"cuDNN {version} fused attention"


@functools.cache
def _flash_attn_module() -> tuple[str | None, str]:
    """(module name, reason): flash_attn_interface (FA3) preferred over flash_attn (FA2)."""
    for name in ("flash_attn_interface", "flash_attn"):
        if importlib.util.find_spec(name) is not None:
            return name, f"{name} is importable"
    return None, "flash-attn is not installed: neither flash_attn_interface (FA3) nor flash_attn (FA2) can be imported"


def _check_flash_attn(device: torch.device) -> tuple[bool, str]:
    name, reason = _flash_attn_module()
    if name is None:
        return False, reason
    ok, why = _need_cuda(device, name, (9, 0) if name == "flash_attn_interface" else (8, 0))
    return (ok, why) if not ok else (True, reason)


def _check_triton_fp8(device: torch.device) -> tuple[bool, str]:
    cc = _cuda_capability(device)
    if cc is None:
        where = "torch.cuda.is_available() is False" if device.type == "cuda" else f"got {device.type}"
        return False, f"triton_fp8 needs a CUDA GPU with compute capability 9.0 (Hopper); {where}"
    if cc != (9, 0):
        return False, f"triton_fp8 needs a CUDA GPU with compute capability 9.0 (Hopper); found {cc[0]}.{cc[1]}"
    if importlib.util.find_spec("triton") is None:
        return False, "triton_fp8 needs the triton package, which is not installed"
    return True, "Triton 8-bit kernel (int8/e4m3 QK^T on Hopper tensor cores)"


def _check_gluon_int8(device: torch.device) -> tuple[bool, str]:
    ok, reason = _check_triton_fp8(device)
    if not ok:
        return False, reason.replace("triton_fp8", "gluon_int8")
    if importlib.util.find_spec("triton.experimental.gluon") is None:
        return False, "gluon_int8 needs Triton's Gluon language (triton >= 3.5), which this triton does not have"
    return True, "Gluon int8-QK / bf16-PV kernel with FlashAttention-3-style softmax/tensor-core overlap"


def _check_cudnn_fp8(device: torch.device) -> tuple[bool, str]:
    ok, reason = _need_cuda(device, "cudnn_fp8 (cuDNN FP8 attention)", (9, 0))
    if not ok:
        return ok, reason
    from .cudnn_fp8 import frontend_status

    return frontend_status()


# --------------------------------------------------------------------------------------------------
# Runners: (B, H, S, D) -> (B, S, H*D)
# --------------------------------------------------------------------------------------------------


def _to_bshd(out: torch.Tensor) -> torch.Tensor:
    b, h, s, d = out.shape
    return out.transpose(1, 2).reshape(b, s, h * d)


def _run_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _to_bshd(F.scaled_dot_product_attention(q, k, v))


def _sdpa_forced(kind: SDPBackend) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel([kind]):
            out = F.scaled_dot_product_attention(q, k, v)
        return _to_bshd(out)

    return run


def _run_flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    name, reason = _flash_attn_module()
    if name is None:
        raise AttentionUnavailableError(f"flash_attn: {reason}")
    module = importlib.import_module(name)
    b, h, s, d = q.shape
    out = module.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    if isinstance(out, tuple):  # some FA3 builds return (out, softmax_lse)
        out = out[0]
    return out.reshape(b, s, h * d)


def _interpreting() -> bool:
    from .triton_fp8 import interpreter_active

    return interpreter_active()


def _define_fp8_op():
    """Register ``torch.ops.qwen_edit_hopper.fp8_attention`` once per process (the pack may be imported twice)."""
    namespace = torch.ops.qwen_edit_hopper
    if hasattr(namespace, "fp8_attention"):
        return namespace.fp8_attention

    @torch.library.custom_op("qwen_edit_hopper::fp8_attention", mutates_args=())
    def fp8_attention_op(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        qk_format: str,
        pv_format: str,
        block_m: int,
        block_n: int,
        num_warps: int,
        num_stages: int,
        fast_math: bool,
        pipeline_qk: bool,
    ) -> torch.Tensor:
        from .triton_fp8 import Fp8AttentionConfig, fp8_attention

        # Checked here too, so that compiled graphs (which skip the Python-side check) fail loudly.
        ok, reason = check_backend("triton_fp8", q.device, head_dim=q.shape[-1], dtype=q.dtype)
        if not ok and not _interpreting():
            raise AttentionUnavailableError(f"attention backend 'triton_fp8' cannot run: {reason}")
        config = Fp8AttentionConfig(
            qk_format=qk_format, pv_format=pv_format, block_m=block_m, block_n=block_n, num_warps=num_warps,
            num_stages=num_stages, fast_math=fast_math, pipeline_qk=pipeline_qk,
        )  # fmt: skip
        return fp8_attention(q, k, v, config)

    @fp8_attention_op.register_fake
    def _(q, k, v, qk_format, pv_format, block_m, block_n, num_warps, num_stages, fast_math, pipeline_qk):
        b, h, s, d = q.shape
        return q.new_empty((b, s, h * d))

    return fp8_attention_op


fp8_attention_op = _define_fp8_op()


def _run_triton_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config=None) -> torch.Tensor:
    from .triton_fp8 import DEFAULT_CONFIG

    c = DEFAULT_CONFIG if config is None else config
    return fp8_attention_op(
        q, k, v, c.qk_format, c.pv_format, c.block_m, c.block_n, c.num_warps, c.num_stages, c.fast_math,
        c.pipeline_qk,
    )  # fmt: skip


def _define_gluon_op():
    """Register ``torch.ops.qwen_edit_hopper.gluon_int8_attention`` once per process."""
    namespace = torch.ops.qwen_edit_hopper
    if hasattr(namespace, "gluon_int8_attention"):
        return namespace.gluon_int8_attention

    @torch.library.custom_op("qwen_edit_hopper::gluon_int8_attention", mutates_args=())
    def gluon_int8_attention_op(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_warps: int, stages: int
    ) -> torch.Tensor:
        from .gluon_int8 import GluonAttentionConfig, gluon_int8_attention

        ok, reason = check_backend("gluon_int8", q.device, head_dim=q.shape[-1], dtype=q.dtype)
        if not ok:
            raise AttentionUnavailableError(f"attention backend 'gluon_int8' cannot run: {reason}")
        return gluon_int8_attention(q, k, v, GluonAttentionConfig(num_warps=num_warps, stages=stages))

    @gluon_int8_attention_op.register_fake
    def _(q, k, v, num_warps, stages):
        b, h, s, d = q.shape
        return q.new_empty((b, s, h * d))

    return gluon_int8_attention_op


gluon_int8_attention_op = _define_gluon_op()


def _run_gluon_int8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config=None) -> torch.Tensor:
    from .gluon_int8 import DEFAULT_GLUON_CONFIG

    c = DEFAULT_GLUON_CONFIG if config is None else config
    return gluon_int8_attention_op(q, k, v, c.num_warps, c.stages)


def _define_cudnn_fp8_op():
    """Register ``torch.ops.qwen_edit_hopper.cudnn_fp8_attention`` (the kernel only) once per process."""
    namespace = torch.ops.qwen_edit_hopper
    if hasattr(namespace, "cudnn_fp8_attention"):
        return namespace.cudnn_fp8_attention

    @torch.library.custom_op("qwen_edit_hopper::cudnn_fp8_attention", mutates_args=())
    def cudnn_fp8_attention_op(
        q8: torch.Tensor,
        k8: torch.Tensor,
        v8: torch.Tensor,
        descale_q: torch.Tensor,
        descale_k: torch.Tensor,
        descale_v: torch.Tensor,
        seq_len_kv: torch.Tensor,
        scale_o: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``seq_len_kv``: (B,) int32 keys per sample (cuDNN's padding mask), or empty for no padding;
        ``scale_o``: 1 / descale_v (1, 1, 1, 1) float32, or None to compute it here. k8 / v8 may hold more tokens
        than q8 (the first queries of a longer sequence)."""
        from .cudnn_fp8 import run_kernel

        ok, reason = check_backend("cudnn_fp8", q8.device)
        if not ok:
            raise AttentionUnavailableError(f"attention backend 'cudnn_fp8' cannot run: {reason}")
        lengths = seq_len_kv if seq_len_kv.numel() else None
        return run_kernel(q8, k8, v8, descale_q, descale_k, descale_v, lengths, scale_o)

    @cudnn_fp8_attention_op.register_fake
    def _(q8, k8, v8, descale_q, descale_k, descale_v, seq_len_kv, scale_o=None):
        b, h, s, d = q8.shape
        return q8.new_empty((b, s, h, d))

    return cudnn_fp8_attention_op


cudnn_fp8_kernel_op = _define_cudnn_fp8_op()


def _run_cudnn_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from .cudnn_fp8 import cudnn_fp8_attention

    return cudnn_fp8_attention(q, k, v)


def _check_cudnn_fp8_emulated(device: torch.device) -> tuple[bool, str]:
    return True, "fp32 mirror of cuDNN's FP8 attention numerics (emulation: no speed, materializes S x S per head)"


def _run_cudnn_fp8_emulated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from .cudnn_fp8 import cudnn_fp8_attention

    return cudnn_fp8_attention(q, k, v, emulate=True)


@dataclass(frozen=True)
class _Backend:
    name: str
    check: Callable[[torch.device], tuple[bool, str]]
    run: Callable[..., torch.Tensor]


_REGISTRY = {
    "sdpa": _Backend("sdpa", _check_sdpa, _run_sdpa),
    "sdpa_cudnn": _Backend("sdpa_cudnn", _check_sdpa_cudnn, _sdpa_forced(SDPBackend.CUDNN_ATTENTION)),
    "sdpa_flash": _Backend("sdpa_flash", _check_sdpa_flash, _sdpa_forced(SDPBackend.FLASH_ATTENTION)),
    "sdpa_efficient": _Backend("sdpa_efficient", _check_sdpa_efficient, _sdpa_forced(SDPBackend.EFFICIENT_ATTENTION)),
    "sdpa_math": _Backend("sdpa_math", _check_sdpa_math, _sdpa_forced(SDPBackend.MATH)),
    "flash_attn": _Backend("flash_attn", _check_flash_attn, _run_flash_attn),
    "triton_fp8": _Backend("triton_fp8", _check_triton_fp8, _run_triton_fp8),
    "gluon_int8": _Backend("gluon_int8", _check_gluon_int8, _run_gluon_int8),
    "cudnn_fp8": _Backend("cudnn_fp8", _check_cudnn_fp8, _run_cudnn_fp8),
    "cudnn_fp8_emulated": _Backend("cudnn_fp8_emulated", _check_cudnn_fp8_emulated, _run_cudnn_fp8_emulated),
}
_CONFIGURABLE = ("triton_fp8", "gluon_int8")


def _lookup(name: str) -> _Backend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known backends: {', '.join(BACKENDS)}") from None


def check_backend(
    name: str,
    device: torch.device | str | None = None,
    *,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[bool, str]:
    """Whether backend ``name`` can run on ``device`` (default: the current CUDA device, else CPU), and why.

    ``head_dim`` / ``dtype``, when given, are checked too (``triton_fp8``: head dim 64 or 128, bfloat16;
    ``sdpa_flash`` / ``flash_attn`` on CUDA: fp16 or bf16). Returns ``(ok, reason)``; never raises for
    a known name (ValueError for an unknown one).
    """
    backend = _lookup(name)
    dev = _as_device(device)
    ok, reason = backend.check(dev)
    if not ok:
        return ok, reason
    if name in _CONFIGURABLE:
        dims = TRITON_FP8_HEAD_DIMS if name == "triton_fp8" else GLUON_INT8_HEAD_DIMS
        if head_dim is not None and head_dim not in dims:
            return False, f"{name} supports head dim {' or '.join(map(str, dims))}, not {head_dim}"
        if dtype is not None and dtype != torch.bfloat16:
            return False, f"{name} takes bfloat16 q/k/v, not {dtype}"
    if name == "cudnn_fp8" and dtype is not None and dtype != torch.bfloat16:
        return False, f"cudnn_fp8 takes bfloat16 q/k/v, not {dtype}"
    fp16_only = name in ("sdpa_flash", "flash_attn") and dev.type == "cuda"
    if fp16_only and dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return False, f"{name} takes fp16 or bf16 on CUDA, not {dtype}"
    return ok, reason


def available_backends(device: torch.device | str | None = None) -> dict[str, tuple[bool, str]]:
    """``{name: (ok, reason)}`` for every backend in ``BACKENDS`` on ``device``."""
    return {name: check_backend(name, device) for name in BACKENDS}


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    backend: str = "sdpa",
    *,
    config=None,
) -> torch.Tensor:
    """Non-causal, unmasked attention ``softmax(q k^T / sqrt(D)) v`` through ``backend``.

    q, k, v: (B, H, S, D) of one dtype (bf16 for the model; ``triton_fp8`` needs bf16 and
    D in (64, 128)). Returns (B, S, H*D) in the input dtype. ``config`` (``triton_fp8`` only) is a
    :class:`.triton_fp8.Fp8AttentionConfig`; None means its default. Raises
    :class:`AttentionUnavailableError` with the reason when the backend cannot run here, ValueError
    for bad shapes. Never falls back to another backend.
    """
    impl = _lookup(backend)
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        shapes = f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        raise ValueError(f"q, k, v must share one (B, H, S, D) shape; got {shapes}")
    if config is not None and backend not in _CONFIGURABLE:
        raise ValueError(f"config applies to {' and '.join(_CONFIGURABLE)} only, not {backend!r}")
    if not torch.compiler.is_compiling():
        ok, reason = check_backend(backend, q.device, head_dim=q.shape[-1], dtype=q.dtype)
        if not ok:
            raise AttentionUnavailableError(f"attention backend {backend!r} cannot run: {reason}")
    if backend in _CONFIGURABLE:
        return impl.run(q, k, v, config)
    return impl.run(q, k, v)
