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
* ``cudnn_fp8``: cuDNN's FP8 fused attention through the optional ``nvidia-cudnn-frontend`` package
  (:mod:`.cudnn_fp8`): per-tensor e4m3 q/k/v/P/O, compute capability 9.0 or newer, bf16 inputs; the
  kernel is the custom op ``torch.ops.qwen_edit_hopper.cudnn_fp8_attention`` and the quantization
  around it stays in the compiled graph.
* ``cudnn_fp8_emulated``: the same quantization with the kernel replaced by its fp32 mirror
  (``cudnn_fp8.reference_kernel``): runs anywhere, no speed. The Load node picks it for
  ``cudnn_fp8`` only when the Load node's ``where_unsupported`` is emulate, and says so.

``attention_capability(name, device)`` returns a :class:`~..capability.Capability` without running anything; an
unavailable backend passed to ``attention`` raises :class:`~..errors.AttentionUnavailableError` with that reason.
There is no silent fallback anywhere. The SDPA backends add no graph breaks under ``torch.compile`` (checks are
skipped while compiling: the forced kernel itself raises if it cannot run).
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

from ..capability import Capability, cuda_capability, resolve_device
from ..errors import AttentionUnavailableError
from .cudnn_fp8 import cudnn_fp8_attention, cudnn_fp8_capability

__all__ = [
    "BACKENDS",
    "AttentionUnavailableError",
    "attention",
    "attention_capability",
    "available_backends",
    "fp8_attention_op",
]

logger = logging.getLogger(__name__)

BACKENDS = (
    "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math", "flash_attn", "triton_fp8", "cudnn_fp8",
    "cudnn_fp8_emulated",
)  # fmt: skip

_SDPA_FORCED = {
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_math": SDPBackend.MATH,
}
TRITON_FP8_HEAD_DIMS = (64, 128)


def _need_cuda(device: torch.device, what: str, min_cc: tuple[int, int] | None = None) -> Capability:
    if device.type != "cuda":
        return Capability.no(f"{what} needs a CUDA device (got {device.type})")
    cc = cuda_capability(device)
    if cc is None:
        return Capability.no(f"{what} needs a CUDA device, and torch.cuda.is_available() is False")
    if min_cc is not None and cc < min_cc:
        return Capability.no(f"{what} needs compute capability {min_cc[0]}.{min_cc[1]} or higher (found "
                             f"{cc[0]}.{cc[1]})")
    return Capability.yes(f"{what} on compute capability {cc[0]}.{cc[1]}")


def _check_sdpa(device: torch.device) -> Capability:
    return Capability.yes("PyTorch chooses the kernel")


def _check_sdpa_math(device: torch.device) -> Capability:
    return Capability.yes("reference kernel: materializes the (S, S) score matrix; slow and memory-hungry at long S")


def _check_sdpa_flash(device: torch.device) -> Capability:
    if device.type == "cpu":
        return Capability.yes("PyTorch's CPU flash-attention kernel")
    cuda = _need_cuda(device, "SDPA flash attention", (8, 0))
    if not cuda.ok:
        return cuda
    if not torch.backends.cuda.is_flash_attention_available():
        return Capability.no("this PyTorch build has no flash-attention kernel")
    return Capability.yes("PyTorch's FlashAttention-2 kernel (fp16/bf16, head dim <= 256)")


def _check_sdpa_efficient(device: torch.device) -> Capability:
    if device.type == "cpu":
        return Capability.no("SDPA memory-efficient attention has no CPU kernel in PyTorch (CUDA only)")
    cuda = _need_cuda(device, "SDPA memory-efficient attention", (5, 0))
    return cuda if not cuda.ok else Capability.yes("PyTorch's memory-efficient (CUTLASS) kernel")


def _check_sdpa_cudnn(device: torch.device) -> Capability:
    if device.type == "cpu":
        return Capability.no("SDPA cuDNN attention needs a CUDA device (no CPU kernel)")
    cuda = _need_cuda(device, "SDPA cuDNN attention", (8, 0))
    if not cuda.ok:
        return cuda
    if not torch.backends.cudnn.is_available():
        return Capability.no("cuDNN is not available in this PyTorch build")
    version = torch.backends.cudnn.version() or 0
    if version < 90000:
        return Capability.no(f"SDPA cuDNN attention needs cuDNN 9 or newer (found {version})")
    return Capability.yes(f"cuDNN {version} fused attention")


@functools.cache
def _flash_attn_module() -> tuple[str | None, str]:
    """(module name, reason): flash_attn_interface (FA3) preferred over flash_attn (FA2)."""
    for name in ("flash_attn_interface", "flash_attn"):
        if importlib.util.find_spec(name) is not None:
            return name, f"{name} is importable"
    return None, "flash-attn is not installed: neither flash_attn_interface (FA3) nor flash_attn (FA2) can be imported"


def _check_flash_attn(device: torch.device) -> Capability:
    name, reason = _flash_attn_module()
    if name is None:
        return Capability.no(reason)
    cuda = _need_cuda(device, name, (9, 0) if name == "flash_attn_interface" else (8, 0))
    return cuda if not cuda.ok else Capability.yes(reason)


def _check_triton_fp8(device: torch.device) -> Capability:
    cc = cuda_capability(device)
    if cc is None:
        where = "torch.cuda.is_available() is False" if device.type == "cuda" else f"got {device.type}"
        return Capability.no(f"triton_fp8 needs a CUDA GPU with compute capability 9.0 (Hopper); {where}")
    if cc != (9, 0):
        return Capability.no(f"triton_fp8 needs a CUDA GPU with compute capability 9.0 (Hopper); found "
                             f"{cc[0]}.{cc[1]}")
    if importlib.util.find_spec("triton") is None:
        return Capability.no("triton_fp8 needs the triton package, which is not installed")
    return Capability.yes("Triton 8-bit kernel (int8/e4m3 QK^T on Hopper tensor cores)")


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
        capability = attention_capability("triton_fp8", q.device, head_dim=q.shape[-1], dtype=q.dtype)
        if not capability.ok and not _interpreting():
            raise AttentionUnavailableError(f"attention backend 'triton_fp8' cannot run: {capability.reason}")
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


def _run_cudnn_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return cudnn_fp8_attention(q, k, v)


def _check_cudnn_fp8_emulated(device: torch.device) -> Capability:
    return Capability.yes("fp32 mirror of cuDNN's FP8 attention numerics (emulation: no speed, materializes S x S "
                          "per head)")


def _run_cudnn_fp8_emulated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return cudnn_fp8_attention(q, k, v, emulate=True)


@dataclass(frozen=True)
class _Backend:
    name: str
    check: Callable[[torch.device], Capability]
    run: Callable[..., torch.Tensor]


_REGISTRY = {
    "sdpa": _Backend("sdpa", _check_sdpa, _run_sdpa),
    "sdpa_cudnn": _Backend("sdpa_cudnn", _check_sdpa_cudnn, _sdpa_forced(SDPBackend.CUDNN_ATTENTION)),
    "sdpa_flash": _Backend("sdpa_flash", _check_sdpa_flash, _sdpa_forced(SDPBackend.FLASH_ATTENTION)),
    "sdpa_efficient": _Backend("sdpa_efficient", _check_sdpa_efficient, _sdpa_forced(SDPBackend.EFFICIENT_ATTENTION)),
    "sdpa_math": _Backend("sdpa_math", _check_sdpa_math, _sdpa_forced(SDPBackend.MATH)),
    "flash_attn": _Backend("flash_attn", _check_flash_attn, _run_flash_attn),
    "triton_fp8": _Backend("triton_fp8", _check_triton_fp8, _run_triton_fp8),
    "cudnn_fp8": _Backend("cudnn_fp8", cudnn_fp8_capability, _run_cudnn_fp8),
    "cudnn_fp8_emulated": _Backend("cudnn_fp8_emulated", _check_cudnn_fp8_emulated, _run_cudnn_fp8_emulated),
}
_CONFIGURABLE = ("triton_fp8",)


def _lookup(name: str) -> _Backend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known backends: {', '.join(BACKENDS)}") from None


def attention_capability(
    name: str,
    device: torch.device | str | None = None,
    *,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
) -> Capability:
    """Whether backend ``name`` can run on ``device`` (default: the current CUDA device, else CPU), and why.

    ``head_dim`` / ``dtype``, when given, are checked too (``triton_fp8``: head dim 64 or 128, bfloat16;
    ``cudnn_fp8``: bfloat16; ``sdpa_flash`` / ``flash_attn`` on CUDA: fp16 or bf16). Never raises for a known
    name (ValueError for an unknown one).
    """
    backend = _lookup(name)
    dev = resolve_device(device)
    capability = backend.check(dev)
    if not capability.ok:
        return capability
    if name in _CONFIGURABLE:
        if head_dim is not None and head_dim not in TRITON_FP8_HEAD_DIMS:
            return Capability.no(f"{name} supports head dim {' or '.join(map(str, TRITON_FP8_HEAD_DIMS))}, not "
                                 f"{head_dim}")
        if dtype is not None and dtype != torch.bfloat16:
            return Capability.no(f"{name} takes bfloat16 q/k/v, not {dtype}")
    if name == "cudnn_fp8" and dtype is not None and dtype != torch.bfloat16:
        return Capability.no(f"cudnn_fp8 takes bfloat16 q/k/v, not {dtype}")
    fp16_only = name in ("sdpa_flash", "flash_attn") and dev.type == "cuda"
    if fp16_only and dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return Capability.no(f"{name} takes fp16 or bf16 on CUDA, not {dtype}")
    return capability


def available_backends(device: torch.device | str | None = None) -> dict[str, Capability]:
    """``{name: Capability}`` for every backend in ``BACKENDS`` on ``device``."""
    return {name: attention_capability(name, device) for name in BACKENDS}


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
        capability = attention_capability(backend, q.device, head_dim=q.shape[-1], dtype=q.dtype)
        if not capability.ok:
            raise AttentionUnavailableError(f"attention backend {backend!r} cannot run: {capability.reason}")
    if backend in _CONFIGURABLE:
        return impl.run(q, k, v, config)
    return impl.run(q, k, v)
