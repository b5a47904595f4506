"""Pieces of the fast, batched Qwen-Image DiT forward (:mod:`..fast_forward` is the public entry).

* :mod:`.options`: :class:`~.options.ForwardOptions`, the fused kernels the forward may use (a frozen value).
* :mod:`.kernel_plan`: :func:`~.kernel_plan.select_kernels`, which of them run for a model, shape, device and
  attention backend, and why the others do not.
* :mod:`.prepared`: :class:`~.prepared.PreparedDit`, what the forward keeps for one model (compiled blocks, CUDA
  graphs, kernel plans, modulation groups, RoPE tables).
* :mod:`.block`: one transformer block as a plain function, written so Inductor fuses it; :mod:`.prequant`,
  :mod:`.mlp`, :mod:`.fp8_attention`, :mod:`.residual_gemm` its fused-kernel paths.
* :mod:`.rope`: DiffSynth's complex RoPE as real cos/sin tables, and the QK norm + rotation.
* :mod:`.qkv`: :func:`.qkv.fuse_qkv`, one Q/K/V GEMM per stream.
* :mod:`.modulation`: every block's modulation linear in two launches.
* :mod:`.text`: text lengths and batching of prompts of different lengths.
* :mod:`.compile`, :mod:`.graphs`: regional compilation of the block function, whole-forward CUDA graphs.
"""
