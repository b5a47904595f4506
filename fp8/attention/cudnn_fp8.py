"""cuDNN's FP8 fused attention (cudnn-frontend ``sdpa_fp8``) with per-tensor e4m3 scales.

``cudnn_fp8_attention(q, k, v)`` computes softmax(q k^T / sqrt(D)) v for q, k, v of shape
(B, H, S, D) bfloat16 (any strides with D contiguous; the DiT passes (B, S, H, D) memory seen as
(B, H, S, D)), no mask, not causal, and returns (B, S, H*D) bfloat16.

Steps, and where they run:

1. ``quantize_per_tensor``: amax of q, k and v each, scale to e4m3's 448, cast. Plain torch ops,
   so under ``torch.compile`` Inductor fuses them with the producers (QK RMSNorm, RoPE, the joint
   concatenation).
2. ``torch.ops.qwen_edit_hopper.cudnn_fp8_attention``: the cuDNN kernel (e4m3 Q K^T, P rounded to
   e4m3 with scale 448, e4m3 P V, fp32 accumulation and softmax), output e4m3 (B, S, H, D). On
   Hopper cuDNN writes an fp8 output only (a bf16 output is refused). ``scale_o`` is 1 / the
   descale of V: |O| <= max |v| because every output row is a convex combination of V rows, so
   the output never overflows.
3. Dequantize to bf16: a plain torch op that Inductor fuses into the next consumer (the row-wise
   quantization of the output projection's input).

Inside the DiT, ``qwen_edit/fast/fp8_attention.py`` skips both passes that need a max: static q/k
scales from the RMSNorm weights (:func:`rms_norm_bound`), and the e4m3 output handed to the fp8
output projections. The generic path above measured no faster than bf16 SDPA in the model (H200).

Numerics (H200, docs/decisions/0003-cudnn-fp8-attention.md, Gaussian q/k with logit std ~1): 5.8-5.9e-2
relative error against float64 per call (bf16 SDPA: 2.3e-3; int8-QK ``triton_fp8``: 1.1e-2),
4.7-4.8e-2 with outlier channels; K smoothing changes nothing (e4m3 is a float format). Speed: the
kernel alone 1.10 ms at S = 8492, B = 1 against SDPA cuDNN bf16's 1.45 ms (1.32x), 1.46x at B = 2.

Needs: a CUDA GPU with compute capability 9.0 or newer (measured on Hopper only), the
``nvidia-cudnn-frontend`` package (``import cudnn``; in requirements.txt on Linux) and cuDNN 9
(PyTorch's). Graphs are built once per (device, shape, strides) and cached
(``_GRAPH_CACHE_SIZE``). Errors from cuDNN (an unsupported head dim, for one) are raised as they
come, never replaced by another kernel.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging

import torch

from ..capability import Capability, cuda_capability, resolve_device
from ..errors import AttentionUnavailableError

__all__ = [
    "E4M3_MAX",
    "attention_quantized",
    "cudnn_fp8_attention",
    "cudnn_fp8_capability",
    "frontend_capability",
    "quantize_per_tensor",
    "quantize_with_bound",
    "reference_kernel",
    "rms_norm_bound",
]

logger = logging.getLogger(__name__)

E4M3_MAX = 448.0
_GRAPH_CACHE_SIZE = 64


@functools.cache
def frontend_capability() -> Capability:
    """Whether cudnn-frontend's Python package ``cudnn`` (pip: nvidia-cudnn-frontend) loads a cuDNN 9."""
    if importlib.util.find_spec("cudnn") is None:
        return Capability.no("the cuDNN frontend is not installed: pip install nvidia-cudnn-frontend (import name: "
                             "cudnn)")
    try:
        module = importlib.import_module("cudnn")
        version = int(module.backend_version())
    except Exception as exc:  # a broken install or no loadable libcudnn: say what happened
        return Capability.no(f"the cuDNN frontend could not load cuDNN: {type(exc).__name__}: {exc}")
    if version < 90000:
        return Capability.no(f"cuDNN FP8 attention needs cuDNN 9 or newer; the frontend loaded {version}")
    return Capability.yes(f"cuDNN {version} FP8 fused attention through nvidia-cudnn-frontend")


def cudnn_fp8_capability(device: torch.device | str | None = None) -> Capability:
    """Whether cuDNN's FP8 attention can run on ``device``: a CUDA GPU of compute capability 9.0 or newer and
    :func:`frontend_capability`."""
    dev = resolve_device(device)
    what = "cudnn_fp8 (cuDNN FP8 attention)"
    if dev.type != "cuda":
        return Capability.no(f"{what} needs a CUDA device (got {dev.type})")
    cc = cuda_capability(dev)
    if cc is None:
        return Capability.no(f"{what} needs a CUDA device, and torch.cuda.is_available() is False")
    if cc < (9, 0):
        return Capability.no(f"{what} needs compute capability 9.0 or higher (found {cc[0]}.{cc[1]})")
    return frontend_capability()


def _memory_order(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(x or x.transpose(1, 2), whether transposed): a (B, H, S, D) view of (B, S, H, D) memory is read in
    memory order, so that Inductor's reduction and cast read it coalesced."""
    if x.dim() == 4 and not x.is_contiguous() and x.transpose(1, 2).is_contiguous():
        return x.transpose(1, 2), True
    return x, False


def quantize_with_bound(x: torch.Tensor, bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (e4m3 of x's shape, float32 descale (1, 1, 1, 1)) with ``bound`` (a float32 scalar tensor,
    >= max |x|) mapped to 448. No pass over x is needed to find the scale: Inductor fuses the scale and
    cast into whatever produces x."""
    xm, transposed = _memory_order(x)
    x8 = (xm.float() * (E4M3_MAX / bound)).to(torch.float8_e4m3fn)
    return (x8.transpose(1, 2) if transposed else x8), (bound / E4M3_MAX).reshape(1, 1, 1, 1)


def quantize_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape, bf16/fp32) -> (e4m3 tensor of x's shape, float32 descale of shape (1, 1, 1, 1)).

    One scale for the whole tensor, amax mapped to 448; ``x8.float() * descale`` approximates x.
    Plain torch ops (traceable, fused by Inductor): a row-wise max, then the max of the rows.
    """
    xm, _ = _memory_order(x)
    amax = xm.abs().amax(dim=-1).amax().float().clamp_min(1e-12)
    return quantize_with_bound(x, amax)


def rms_norm_bound(weight: torch.Tensor | None, head_dim: int) -> torch.Tensor | float:
    """An upper bound of |y| for y = RMSNorm(x) * weight over ``head_dim`` channels, also after RoPE.

    |x_i| / rms(x) <= sqrt(head_dim) for every i, and RoPE rotates channel pairs, which cannot make
    an element larger than its pair's norm, itself <= sqrt(head_dim) in units of rms(x). So
    |y| <= sqrt(head_dim) * max |weight|; 2% covers the bf16 roundings between the steps.
    Returns a float32 0-dim tensor (a float when ``weight`` is None).
    """
    factor = head_dim**0.5 * 1.02
    if weight is None:
        return factor
    return weight.detach().abs().amax().float() * factor


@functools.cache
def _handle(device_index: int):
    cudnn = importlib.import_module("cudnn")
    with torch.cuda.device(device_index):
        return cudnn.create_handle()


def operation_graph(device_index: int, shape: tuple, q_stride: tuple, k_stride: tuple, v_stride: tuple,
                    padded: bool, kv_tokens: int | None = None):
    """(graph, ports): the validated cuDNN operation graph for e4m3 q (B, H, S, D) and k/v (B, H, S_kv, D) with these
    strides (``kv_tokens`` S_kv, default S), output e4m3 (B, S, H, D) memory, before any execution plan.
    ``padded``: per-sample query / key lengths (int32 (B, 1, 1, 1)) through cuDNN's padding mask. Ports: q, k, v,
    the six scales, o [, seq_len_q, seq_len_kv]. The amax of P and of O, which ``sdpa_fp8`` also defines, are
    described but not outputs: nothing reads them (H200: same kernel, same output, 1.028 vs 1.031 ms alone)."""
    cudnn = importlib.import_module("cudnn")
    e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    handle = _handle(device_index)
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    kv_shape = list(shape) if kv_tokens is None else [shape[0], shape[1], kv_tokens, shape[3]]
    q, k, v = (
        graph.tensor(name=n, dim=dims, stride=list(st), data_type=e4m3)
        for n, dims, st in (("q", list(shape), q_stride), ("k", kv_shape, k_stride), ("v", kv_shape, v_stride))
    )
    scalars = [
        graph.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
        for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
    ]
    lengths, mask = [], {}
    if padded:
        lengths = [graph.tensor(name=n, dim=[shape[0], 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
                   for n in ("seq_len_q", "seq_len_kv")]  # fmt: skip
        mask = {"use_padding_mask": True, "seq_len_q": lengths[0], "seq_len_kv": lengths[1]}
    o, _, amax_s, amax_o = graph.sdpa_fp8(
        q, k, v, *scalars, is_inference=True, attn_scale=shape[-1] ** -0.5, use_causal_mask=False, name="sdpa_fp8",
        **mask,
    )  # fmt: skip
    _, h, s, d = shape
    o.set_output(True).set_dim(list(shape)).set_stride([s * h * d, d, h * d, 1]).set_data_type(e4m3)
    for amax in (amax_s, amax_o):  # described (cuDNN needs the dims), not outputs
        amax.set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    graph.validate()
    graph.build_operation_graph()
    return graph, (q, k, v, *scalars, o, *lengths)


@functools.lru_cache(maxsize=_GRAPH_CACHE_SIZE)
def _graph(device_index: int, shape: tuple, q_stride: tuple, k_stride: tuple, v_stride: tuple, kv_tokens: int):
    """(graph, ports, workspace bytes): the padding-mask :func:`operation_graph` with cuDNN's heuristic first
    plan built. Always the padding-mask graph: cuDNN runs it faster than the unmasked one at the DiT's shape
    (H200, S = 8492: 0.98 vs 1.10 ms at B = 1, 1.85 vs 2.12 ms at B = 2; same output)."""
    cudnn = importlib.import_module("cudnn")
    graph, ports = operation_graph(device_index, shape, q_stride, k_stride, v_stride, True, kv_tokens)
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    logger.info("built a cuDNN FP8 attention graph for shape %s on cuda:%d", shape, device_index)
    return graph, ports, graph.get_workspace_size()


@functools.lru_cache(maxsize=_GRAPH_CACHE_SIZE)
def _full_lengths(device_index: int, batch: int, tokens: int) -> torch.Tensor:
    """(batch, 1, 1, 1) int32 filled with ``tokens``: every query row, and every key when there is no padding."""
    return torch.full((batch, 1, 1, 1), tokens, dtype=torch.int32, device=torch.device("cuda", device_index))


@functools.cache
def _p_scales(device_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale_s, descale_s): P in [0, 1] is stored as e4m3 times 448."""
    dev = torch.device("cuda", device_index)
    return torch.full((1, 1, 1, 1), E4M3_MAX, device=dev), torch.full((1, 1, 1, 1), 1 / E4M3_MAX, device=dev)


def run_kernel(
    q8: torch.Tensor,
    k8: torch.Tensor,
    v8: torch.Tensor,
    descale_q: torch.Tensor,
    descale_k: torch.Tensor,
    descale_v: torch.Tensor,
    seq_len_kv: torch.Tensor | None = None,
    scale_o: torch.Tensor | None = None,
) -> torch.Tensor:
    """The cuDNN kernel on e4m3 (B, H, S, D) inputs -> e4m3 (B, S, H, D), in units of ``descale_v``.

    The output equals attention(q, k, v) / descale_v (``scale_o = 1 / descale_v``), so
    ``out.float() * descale_v`` is the attention output. k8 and v8 may hold more tokens than q8 (S_kv >= S: the
    first S queries of a longer sequence). ``seq_len_kv`` (B,) int32: sample i attends to its first
    ``seq_len_kv[i]`` keys only (right padding); every query row is computed. ``scale_o``: 1 / descale_v as a
    (1, 1, 1, 1) float32 tensor when the caller has it (the block's v kernels write it), else computed here.
    Runs on the current CUDA stream (CUDA-graph capturable). Raises cuDNN's own error when it cannot run the
    shape.
    """
    for name, t in (("q", q8), ("k", k8), ("v", v8)):
        if t.stride(-1) != 1:
            raise ValueError(f"cudnn_fp8: {name} must have a contiguous head dim (stride {tuple(t.stride())})")
    cudnn = importlib.import_module("cudnn")
    index = q8.device.index
    graph, ports, workspace_size = _graph(index, tuple(q8.shape), tuple(q8.stride()), tuple(k8.stride()),
                                          tuple(v8.stride()), k8.shape[2])  # fmt: skip
    b, h, s, d = q8.shape
    out = torch.empty((b, s, h, d), dtype=torch.float8_e4m3fn, device=q8.device)
    workspace = torch.empty(max(workspace_size, 1), dtype=torch.uint8, device=q8.device)
    scale_s, descale_s = _p_scales(index)
    if scale_o is None:
        scale_o = descale_v.reciprocal()
    tensors = [q8, k8, v8, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o, out.transpose(1, 2)]
    keys = (_full_lengths(index, b, k8.shape[2]) if seq_len_kv is None
            else seq_len_kv.to(torch.int32).reshape(b, 1, 1, 1).contiguous())
    tensors += [_full_lengths(index, b, s), keys]
    handle = _handle(index)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q8.device).cuda_stream)
    graph.execute(dict(zip(ports, tensors, strict=True)), workspace, handle=handle)
    return out


def reference_kernel(
    q8: torch.Tensor,
    k8: torch.Tensor,
    v8: torch.Tensor,
    descale_q: torch.Tensor,
    descale_k: torch.Tensor,
    descale_v: torch.Tensor,
    seq_len_kv: torch.Tensor | None = None,
) -> torch.Tensor:
    """What :func:`run_kernel` computes, in fp32 torch ops on any device: e4m3 q (B, H, S, D), k / v (B, H, S_kv, D)
    -> e4m3 (B, S, H, D) in units of ``descale_v``.

    Mirrors cuDNN's numerics up to its blocking: fp32 scores, P = exp(s - rowmax) in [0, 1] rounded to
    e4m3 after scaling by 448, P V with fp32 accumulation, division by the fp32 row sum, output scaled by
    1 / descale_v and rounded to e4m3 (cuDNN rounds P against a running per-block max, so codes can differ).
    For CPU machines (``cudnn_fp8_emulated``) and for checking the kernel; materializes (S, S) per head.
    """
    b, h, _, d = q8.shape
    scale = d**-0.5
    samples = []
    for bi in range(b):
        heads = []
        for hi in range(h):
            q = q8[bi, hi].float() * descale_q.reshape(())
            k = k8[bi, hi].float() * descale_k.reshape(())
            scores = (q @ k.T) * scale
            if seq_len_kv is not None:
                padding = torch.arange(k.shape[0], device=scores.device) >= seq_len_kv[bi]
                scores = scores.masked_fill(padding, float("-inf"))
            p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
            p8 = (p * E4M3_MAX).to(torch.float8_e4m3fn).float() / E4M3_MAX
            heads.append((p8 @ v8[bi, hi].float()) / p.sum(dim=-1, keepdim=True))
        samples.append(torch.stack(heads, dim=1))
    # One cast at the end: Inductor (CPU) cannot lower stores into an e4m3 buffer (bool/e4m3 promotion).
    return torch.stack(samples).to(torch.float8_e4m3fn)


def _define_kernel_op():
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
        capability = cudnn_fp8_capability(q8.device)
        if not capability.ok:
            raise AttentionUnavailableError(f"attention backend 'cudnn_fp8' cannot run: {capability.reason}")
        lengths = seq_len_kv if seq_len_kv.numel() else None
        return run_kernel(q8, k8, v8, descale_q, descale_k, descale_v, lengths, scale_o)

    @cudnn_fp8_attention_op.register_fake
    def _(q8, k8, v8, descale_q, descale_k, descale_v, seq_len_kv, scale_o=None):
        b, h, s, d = q8.shape
        return q8.new_empty((b, s, h, d))

    return cudnn_fp8_attention_op


cudnn_fp8_kernel_op = _define_kernel_op()


def attention_quantized(
    q8: torch.Tensor,
    k8: torch.Tensor,
    v8: torch.Tensor,
    descale_q: torch.Tensor,
    descale_k: torch.Tensor,
    descale_v: torch.Tensor,
    emulate: bool = False,
    seq_len_kv: torch.Tensor | None = None,
    scale_o: torch.Tensor | None = None,
) -> torch.Tensor:
    """e4m3 (B, H, S, D) q8/k8/v8 and their (1, 1, 1, 1) float32 descales -> e4m3 (B, S, H*D) in units of
    ``descale_v`` (the attention output is ``out.float() * descale_v``). The cuDNN kernel is the custom op
    ``torch.ops.qwen_edit_hopper.cudnn_fp8_attention``, so ``torch.compile`` traces around it; ``emulate``
    runs :func:`reference_kernel` instead (no GPU needed, no speed). ``seq_len_kv`` (B,) int: keys per
    sample (right padding; every query row is still computed). k8 / v8 may hold more tokens than q8 (the first
    queries of a longer sequence). ``scale_o``: 1 / descale_v, (1, 1, 1, 1) float32, when the caller has it (see
    :func:`run_kernel`)."""
    if emulate:
        out8 = reference_kernel(q8, k8, v8, descale_q, descale_k, descale_v, seq_len_kv)
    else:
        lengths = q8.new_empty((0,), dtype=torch.int32) if seq_len_kv is None else seq_len_kv
        out8 = cudnn_fp8_kernel_op(q8, k8, v8, descale_q, descale_k, descale_v, lengths, scale_o)
    b, s, h, d = out8.shape
    return out8.reshape(b, s, h * d)


def cudnn_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, emulate: bool = False) -> torch.Tensor:
    """(B, H, S, D) bf16 q, k, v -> (B, S, H*D) bf16 through cuDNN's FP8 kernel (see the module doc);
    ``emulate``: through :func:`reference_kernel`."""
    (q8, dq), (k8, dk), (v8, dv) = quantize_per_tensor(q), quantize_per_tensor(k), quantize_per_tensor(v)
    out8 = attention_quantized(q8, k8, v8, dq, dk, dv, emulate)
    return (out8.float() * dv.reshape(1, 1)).to(q.dtype)
