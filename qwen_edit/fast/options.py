"""What the fast forward may run: one frozen options value, the shipped choice as its default.

Each field allows (True, or the streams / sites named) one fused kernel of the forward. Whether it then runs is
decided per model, shape, device and attention backend by :func:`.kernel_plan.select_kernels`, which reports every
kernel it leaves out and why. Variants of a run are ``dataclasses.replace(SHIPPED, field=...)``; nothing else
(no environment variable, no module global) changes what the forward runs::

    from dataclasses import replace
    unfused_mlp = replace(SHIPPED, gelu_gemm=(), fused_gelu_quant=False)

The value is hashable and compares by value: it lives in the :class:`~..plan.PipePlan` (part of ComfyUI's cached
node outputs and of the runtime's keys) and, through the kernel plan, reaches the compiled block as an argument
that Dynamo guards by value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["RESIDUAL_SITES", "SHIPPED", "STREAMS", "UNFUSED", "ForwardOptions"]

STREAMS = ("image", "text")
"""The joint attention's two token streams."""

RESIDUAL_SITES = ("attention", "mlp")
"""The block's two gated residual updates: after the attention's output projection, after the MLP."""


def _names(field: str, value: object, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """``value`` as a tuple in ``allowed``'s order; ValueError naming the field for anything else."""
    if isinstance(value, str) or not isinstance(value, (tuple, list, frozenset, set)):
        raise ValueError(f"ForwardOptions.{field} must be a tuple of {', '.join(map(repr, allowed))}, got {value!r}")
    unknown = [v for v in value if v not in allowed]
    if unknown:
        raise ValueError(f"ForwardOptions.{field}: {', '.join(map(repr, unknown))} not allowed; allowed values: "
                         f"{', '.join(map(repr, allowed))}")
    if len(set(value)) != len(tuple(value)):
        raise ValueError(f"ForwardOptions.{field} names a value twice: {value!r}")
    return tuple(v for v in allowed if v in value)


@dataclass(frozen=True)
class ForwardOptions:
    """The fused kernels the fast forward may use (each also needs the hardware, layers and shapes it is made for).

    Attributes:
        trim_last_block: the last block computes, after its attention, only what the forward returns (the target
            image tokens; no reference tokens, no text stream; cuDNN FP8 attention for the target query rows only).
            Exact for the returned rows; any device.
        shared_modulation: all blocks' ``img_mod`` / ``txt_mod`` linears in two shared-input launches before the
            first block (``fp8.shared_input_gemv``: fp8 modulation weights, CUDA, Triton).
        fused_norm_quant: LayerNorm + modulation (+ the gated residual update) + row-wise e4m3 cast of each stream's
            attention and MLP input in one Triton kernel (``fp8.norm_quant``), for row-wise fp8 consumers.
        fused_gelu_quant: bias + GELU + row-wise e4m3 cast of the MLP hidden state in one Triton kernel
            (``fp8.gelu_quant``), for a row-wise fp8 down-projection.
        gelu_gemm: streams whose MLP up-projection, bias, GELU and e4m3 cast run as one Triton GEMM
            (``fp8.gelu_gemm``; Hopper, fast-accumulation layers; needs the two kernels above for its inputs).
        fused_qk_quant: QK RMSNorm + RoPE + e4m3 cast of both streams into the joint q / k in one Triton kernel
            (``qwen_edit.kernels.qk_norm_rope_quant``; attention ``cudnn_fp8``).
        fused_v_quant: both streams' v into the joint e4m3 v in two Triton kernels, max then cast
            (``qwen_edit.kernels.joint_v_quant``; attention ``cudnn_fp8``).
        joint_v_gemm: the image stream's v GEMM writes the joint e4m3 v itself, scale from a bound
            (``qwen_edit.kernels.joint_v_gemm``; attention ``cudnn_fp8``, Hopper, whole 128-row tiles).
        residual_epilogue: sites whose gated residual update ``x + gate * linear(h)`` runs in the linear's cuBLASLt
            epilogue (``fp8.cublaslt_gemm``; row-wise fp8 layers with ``gemm_kernel="cublaslt"``, one gate row).
        small_m_gemm: a Triton GEMM for row-wise fp8 GEMMs of 17 to 384 rows at the shapes it was tuned for (the
            text stream at batch 1; ``fp8.small_m_gemm``; Hopper), where cuBLASLt's pick is slow.
        ulysses_traced_exchange: under Ulysses sequence parallel, the exchange around the attention (layout
            changes, two all-to-alls as functional collectives, the attention's quantization and call) is traced
            into the compiled block: one graph per block; off, that section runs eagerly between two graphs. On
            in the shipped options: on two H200s one Ulysses 2 rank's forward takes 147 ms traced against 329 ms
            eager (decision 0014).
        ulysses_fp8_exchange: under Ulysses sequence parallel with cuDNN FP8 attention, q, k and v are quantized
            before the exchange (one scale per tensor over all ranks, agreed by an all-reduce of three maxima: one
            process's scales) and travel as e4m3, and so does the attention's e4m3 output: half the bytes of each
            all-to-all. Other attention backends run the exchange in the compute dtype (said in the run's notes).
            On in the shipped options: on two H200s a 40-step 1024x1024 edit under Ulysses 2 denoises in 12.61 s
            against 15.31 s with the bf16 exchange, the same distance from one GPU's latents (decision 0014).
    """

    trim_last_block: bool = True
    shared_modulation: bool = True
    fused_norm_quant: bool = True
    fused_gelu_quant: bool = True
    gelu_gemm: tuple[str, ...] = STREAMS
    fused_qk_quant: bool = True
    fused_v_quant: bool = True
    joint_v_gemm: bool = True
    residual_epilogue: tuple[str, ...] = RESIDUAL_SITES
    small_m_gemm: bool = True
    ulysses_traced_exchange: bool = True
    ulysses_fp8_exchange: bool = True

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "gelu_gemm":
                object.__setattr__(self, field.name, _names(field.name, value, STREAMS))
            elif field.name == "residual_epilogue":
                object.__setattr__(self, field.name, _names(field.name, value, RESIDUAL_SITES))
            elif not isinstance(value, bool):
                raise ValueError(f"ForwardOptions.{field.name} must be True or False, got {value!r}")

    def differences(self, other: ForwardOptions | None = None) -> tuple[str, ...]:
        """``field=value`` for every field that differs from ``other`` (default: :data:`SHIPPED`)."""
        other = SHIPPED if other is None else other
        return tuple(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                     if getattr(self, f.name) != getattr(other, f.name))  # fmt: skip

    def describe(self) -> str:
        """``shipped``, or ``shipped except field=value, ...``."""
        changed = self.differences()
        return "shipped" if not changed else "shipped except " + ", ".join(changed)


SHIPPED = ForwardOptions()
"""The options every preset runs."""

UNFUSED = ForwardOptions(trim_last_block=False, shared_modulation=False, fused_norm_quant=False,
                         fused_gelu_quant=False, gelu_gemm=(), fused_qk_quant=False, fused_v_quant=False,
                         joint_v_gemm=False, residual_epilogue=(), small_m_gemm=False)
"""No fused kernel: every layer on its own and Inductor's code in between (the baseline of A/B benches)."""
