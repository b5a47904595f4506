"""Which fused kernels one transformer block runs: the part of the kernel plan the block function reads.

:func:`.kernel_plan.select_kernels` fills it once per model, shape, device and attention backend; the block
function takes it as an argument. It is a frozen value that compares by value, so under ``torch.compile`` Dynamo
guards on its fields' values: two shapes with the same choice share one compiled graph, a different choice is a
different graph.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NO_FUSED_KERNELS", "BlockKernels"]


@dataclass(frozen=True)
class BlockKernels:
    """Each field: the kernel may run here (device, dtype, backend, shape and options allow it); the block still runs
    it only where its layers are the kind the kernel is written for (row-wise fp8 GEMM layers, see each use).

    Attributes:
        norm_quant: LayerNorm + modulation (+ residual update) + e4m3 cast (``fp8.norm_quant``).
        gelu_quant: bias + GELU + e4m3 cast of the MLP hidden state (``fp8.gelu_quant``).
        gelu_gemm: streams ("image", "text") whose MLP up-projection is the fused GELU GEMM (``fp8.gelu_gemm``).
        qk_quant: QK norm + RoPE + e4m3 cast into the joint q / k (``qwen_edit.kernels.qk_norm_rope_quant``).
        v_quant: the joint e4m3 v by the max and cast kernels (``qwen_edit.kernels.joint_v_quant``).
        joint_v_gemm: the joint e4m3 v by the image stream's v GEMM (``qwen_edit.kernels.joint_v_gemm``).
        residual_epilogue: sites ("attention", "mlp") whose gated residual update runs in the GEMM's epilogue.
        small_m_gemm: row-wise fp8 GEMMs may take the small-M Triton kernel (``fp8.small_m_gemm``).
        traced_exchange: under Ulysses, the exchange around the attention, its all-to-alls included, is traced
            with the block (``ForwardOptions.ulysses_traced_exchange``).
        fp8_exchange: under Ulysses with cuDNN FP8 attention, q, k, v and the attention's output travel as e4m3
            (``ForwardOptions.ulysses_fp8_exchange``).
    """

    norm_quant: bool = False
    gelu_quant: bool = False
    gelu_gemm: tuple[str, ...] = ()
    qk_quant: bool = False
    v_quant: bool = False
    joint_v_gemm: bool = False
    residual_epilogue: tuple[str, ...] = ()
    small_m_gemm: bool = False
    traced_exchange: bool = False
    fp8_exchange: bool = False


NO_FUSED_KERNELS = BlockKernels()
"""Every layer on its own, Inductor's code (or eager torch ops) in between."""
