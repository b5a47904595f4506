"""Pieces of the fast, batched Qwen-Image DiT forward (:mod:`..fast_forward` is the public entry).

* :mod:`.rope`: DiffSynth's complex RoPE turned into cached real cos/sin tables.
* :mod:`.block`: one transformer block as a plain function (QK-norm + RoPE in one pass,
  fused modulation, attention through ``fp8.attention``), written so Inductor fuses it.
* :mod:`.qkv`: :func:`.qkv.fuse_qkv`, one Q/K/V GEMM per stream.
* :mod:`.text`: text lengths and batching of prompts of different lengths.
* :mod:`.compile`: regional compilation of the block function.
"""
