"""LayerNorm + adaptive modulation + row-wise fp8 quantization in one pass (Triton, CUDA).

A DiT block feeds its fp8 linears with ``LayerNorm(x) * (1 + scale) + shift`` (no affine LayerNorm;
shift and scale are per sample, or per token with Qwen-Image-Edit-2511's ``zero_cond_t``). When every
consumer of that value is a row-wise :class:`.linear.ScaledMMLinear`, only its fp8 form is needed.
Inductor computes it as a reduction kernel that reads each row several times; on an H200 the two
image-stream instances took 11.9 ms of a 237 ms forward, ~6x their bandwidth floor
(docs/benchmarks.md). This kernel keeps one row in registers: one read of ``x`` and of the two
modulation vectors, one write of the e4m3 row and its float32 scale.

Numerics: mean and variance in float32 (biased variance, as ``F.layer_norm``), normalized value
rounded to bf16 (``F.layer_norm``'s output), modulation in float32 rounded once to bf16 (as Inductor
computes the bf16 ``addcmul``), then :func:`.gelu_quant`'s quantization (scale ``max(amax, EPS) / 448``,
multiply by its reciprocal, clamp, round to nearest even).

Modulation layout (what a DiT's modulation GEMM produces): ``mod`` [R, C] bf16 with rows of
``n_params`` vectors of width D; ``shift`` and ``scale`` are the vectors at ``shift_index`` and
``scale_index``. Token row ``r`` of sample ``b = r // tokens`` uses modulation row ``b % sets``, or,
with a ``selector`` [tokens] bool, ``b % sets`` where the selector is True and ``sets + b % sets``
where it is False (then ``R == 2 * sets``).

Limits: CUDA tensors only, bf16 ``x`` with contiguous rows, D <= :data:`.gelu_quant.MAX_COLUMNS`. Callers check
:func:`norm_quant_problem` and use the plain-torch path when it returns a reason.
"""

from __future__ import annotations

import torch

from .gelu_quant import gelu_quant_problem
from .quant import E4M3_MAX, EPS, FP8_DTYPE, quantize_rowwise

__all__ = ["OP_NAME", "modulate_quantize_rowwise", "norm_quant_problem", "reference_modulate_quantize"]

OP_NAME = "qwen_edit_hopper::modulate_quantize_rowwise"

DEFAULT_WARPS = 4
"""Warps per row of 3072 (bench/gelu_quant_bench.py measures 4 / 8 / 16)."""

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:  # pragma: no cover - depends on the torch build; gelu_quant_problem reports it
    triton = None


def norm_quant_problem(device: torch.device, n_columns: int) -> str | None:
    """Why the kernel cannot run for rows of ``n_columns`` on ``device``, or None when it can."""
    return gelu_quant_problem(device, n_columns)


def _modulation_rows(tokens_total: int, tokens: int, sets: int, selector: torch.Tensor | None,
                     device: torch.device) -> torch.Tensor:
    row = torch.arange(tokens_total, device=device)
    prow = (row // tokens) % sets
    if selector is not None:
        prow = torch.where(selector.reshape(-1)[row % tokens].bool(), prow, prow + sets)
    return prow


def reference_modulate_quantize(x: torch.Tensor, eps: float, mod: torch.Tensor, n_params: int, shift_index: int,
                                scale_index: int, selector: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, in plain torch (any device).

    x: [B, S, D] bf16; mod: [R, n_params * D]; selector: [S] (or [1, S, 1]) bool or None.
    Returns (x8 [B * S, D] float8_e4m3fn, scale [B * S, 1] float32).
    """
    b, s, d = x.shape
    sets = mod.shape[0] // 2 if selector is not None else mod.shape[0]
    params = mod.unflatten(-1, (n_params, d))[_modulation_rows(b * s, s, sets, selector, x.device)]
    ln = torch.nn.functional.layer_norm(x.reshape(-1, d).float(), (d,), eps=eps).to(x.dtype).float()
    modulated = (ln * (1 + params[:, scale_index].float()) + params[:, shift_index].float()).to(x.dtype)
    return quantize_rowwise(modulated)


if triton is not None:
    from .attention.triton_fp8 import _to_e4m3, interpreter_active

    _EPS = tl.constexpr(EPS)
    _E4M3_MAX = tl.constexpr(E4M3_MAX)

    @triton.jit
    def _modulate_quant_kernel(x_ptr, mod_ptr, sel_ptr, out_ptr, scale_ptr, n_cols, tokens, sets, stride_x,
                               stride_mod, shift_off, scale_off, eps,
                               HAS_SELECTOR: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):  # noqa: N803
        row = tl.program_id(0).to(tl.int64)
        token = row % tokens
        prow = (row // tokens) % sets
        if HAS_SELECTOR:
            keep = tl.load(sel_ptr + token)
            prow = tl.where(keep != 0, prow, prow + sets)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / n_cols
        centered = tl.where(mask, x - mean, 0.0)
        var = tl.sum(centered * centered, axis=0) / n_cols
        ln = (centered * tl.rsqrt(var + eps)).to(tl.bfloat16).to(tl.float32)
        shift = tl.load(mod_ptr + prow * stride_mod + shift_off + cols, mask=mask, other=0.0).to(tl.float32)
        scale_m = tl.load(mod_ptr + prow * stride_mod + scale_off + cols, mask=mask, other=0.0).to(tl.float32)
        m = (ln * (1.0 + scale_m) + shift).to(tl.bfloat16).to(tl.float32)
        amax = tl.max(tl.abs(m), axis=0)
        qscale = tl.maximum(amax, _EPS) / _E4M3_MAX
        q = tl.clamp(m * (1.0 / qscale), -_E4M3_MAX, _E4M3_MAX)
        tl.store(out_ptr + row * n_cols + cols, _to_e4m3(q, INTERPRET), mask=mask)
        tl.store(scale_ptr + row, qscale)

    @triton_op(OP_NAME, mutates_args={})
    def _modulate_quantize_op(x2d: torch.Tensor, tokens: int, eps: float, mod: torch.Tensor, n_params: int,
                              shift_index: int, scale_index: int, selector: torch.Tensor | None,
                              num_warps: int = DEFAULT_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = x2d.shape
        out = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x2d.device)
        scale = torch.empty((rows, 1), dtype=torch.float32, device=x2d.device)
        sets = mod.shape[0] // 2 if selector is not None else mod.shape[0]
        wrap_triton(_modulate_quant_kernel)[(rows,)](
            x2d, mod, selector if selector is not None else x2d, out, scale, cols, tokens, sets, x2d.stride(0),
            mod.stride(0), shift_index * cols, scale_index * cols, eps,
            HAS_SELECTOR=selector is not None, BLOCK=triton.next_power_of_2(cols), INTERPRET=interpreter_active(),
            num_warps=num_warps,
        )
        return out, scale


def modulate_quantize_rowwise(x: torch.Tensor, eps: float, mod: torch.Tensor, n_params: int, shift_index: int,
                              scale_index: int, selector: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``quantize_rowwise(LayerNorm(x) * (1 + scale) + shift)`` (layout: module docstring).

    x: [B, S, D] bf16 CUDA; mod: [R, n_params * D] with contiguous rows; selector: None, or a bool
    tensor of S elements ([S] or [1, S, 1]). Returns (x8 [B * S, D] float8_e4m3fn, scale [B * S, 1]
    float32). Raises ValueError with the reason where the kernel cannot run.
    """
    problem = norm_quant_problem(x.device, x.shape[-1])
    if problem is not None:
        raise ValueError(problem)
    if x.dtype != torch.bfloat16 or x.dim() != 3 or mod.dim() != 2 or mod.stride(-1) != 1:
        raise ValueError(f"modulate_quantize_rowwise takes x [B, S, D] bf16 and mod [R, C] with contiguous rows, "
                         f"got x {x.dtype} {tuple(x.shape)}, mod {tuple(mod.shape)} strides {mod.stride()}")
    sel = None if selector is None else selector.reshape(-1).to(torch.uint8)
    return _modulate_quantize_op(x.reshape(-1, x.shape[-1]).contiguous(), x.shape[1], float(eps), mod, n_params,
                                 shift_index, scale_index, sel)
