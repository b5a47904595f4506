"""Triton kernels written for Qwen-Image's joint attention (CUDA; the fp8 toolkit's generic kernels live in ``fp8``).

* :mod:`.qk_norm_rope_quant`: QK RMSNorm + RoPE of both streams into the joint e4m3 q / k (cuDNN FP8 attention);
* :mod:`.joint_v_quant`: both streams' v, biases added, into the joint e4m3 v (max pass, then the cast);
* :mod:`.joint_v_gemm`: the image stream's v projection written straight into the joint e4m3 v, scale from a bound.

Each module checks what it needs (:func:`...fp8.capability.Capability`) and has a torch reference of its math.
"""
