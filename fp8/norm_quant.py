"""LayerNorm + adaptive modulation + row-wise fp8 quantization in one pass (Triton, CUDA).

A DiT block feeds its fp8 linears with ``LayerNorm(x) * (1 + scale) + shift`` (no affine LayerNorm;
shift and scale are per sample, or per token with Qwen-Image-Edit-2511's ``zero_cond_t``). When every
consumer of that value is a row-wise :class:`.linear.ScaledMMLinear`, only its fp8 form is needed.
Inductor computes it as a reduction kernel that reads each row several times; on an H200 the two
image-stream instances took 11.9 ms of a 237 ms forward, ~6x their bandwidth floor
(docs/decisions/0008-fused-quantization-kernels.md).
This kernel keeps one row in registers: one read of ``x`` and of the two
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

:func:`residual_modulate_quantize_rowwise` also applies the gated residual update that precedes the
norm (``x + gate * (y + bias)``, ``y`` a linear's output) and returns the updated stream: Inductor had
fused that update into its norm kernel, so without it the fused path would add a pass.

Row norms (``with_norms``, for the bounds of :mod:`.gelu_gemm` and of the joint v GEMM in ``qwen_edit.kernels``):
an upper bound of each quantized row's L2 norm ``||codes * scale||``, not the exact value. With ``v = m / scale``
the row before rounding (``|v| <= 448``), rounding to nearest moves each element by at most ``2^-4 |v|`` (normal
range) or ``2^-10`` (subnormals), so ``||codes|| <= (1 + 2^-4) ||v|| + 2^-10 sqrt(D)``; times ``scale``:
``(1 + 2^-4) ||m|| + 2^-10 sqrt(D) scale``. ``||m||`` comes from a sum of squares that rides along in the amax
reduction. The rounding errors average out over a row, so the bound is about 6% above the exact norm (at most
(1 + 2^-4) / (1 - 2^-4), 13%, plus the subnormal term). Exact norms from the codes (an e4m3 -> float conversion
and one more reduction per row) measured 31.30 us against the bound's 29.46 for 8192 x 3072 on an H200 (no norms:
29.06), and no difference in the whole forward; the consumers' bounds are loose by about 15x anyway. The one-row
kernel (widths other than 3 * 2^k) returns the exact norms (:func:`quantized_row_norms`).

Limits: CUDA tensors only, bf16 ``x`` with contiguous rows, D <= :data:`.gelu_quant.MAX_COLUMNS`. Callers check
:func:`norm_quant_capability` and use the plain-torch path when it says no.
"""

from __future__ import annotations

import torch

from .capability import Capability
from .gelu_quant import gelu_quant_capability, row_chunks
from .quant import FP8_DTYPE, quantize_rowwise

__all__ = [
    "OP_NAME",
    "RESIDUAL_OP_NAME",
    "modulate_quantize_rowwise",
    "norm_quant_capability",
    "quantized_row_norms",
    "reference_modulate_quantize",
    "reference_residual_modulate_quantize",
    "residual_modulate_quantize_rowwise",
]

OP_NAME = "qwen_edit_hopper::modulate_quantize_rowwise"
RESIDUAL_OP_NAME = "qwen_edit_hopper::residual_modulate_quantize_rowwise"

DEFAULT_WARPS = 4
"""Warps per program: the fastest of 1 / 2 / 4 / 8 / 16 at 8192 x 3072 on an H200."""

DEFAULT_ROWS = 1
"""Rows per program for rows of 3 * 2^k columns (3072 at full size): 0 runs the one-row kernel (one cross-warp
reduction per chunk and statistic), 1 or more the multi-row kernel (``_modulate_quant_rows_kernel``: the chunks
combined in registers, one reduction per statistic). H200: 1 row at 4 warps
28.1 / 50.1 us against the one-row kernel's 31.2 / 51.5 us (plain / residual, 8192 x 3072), and 187.8 against
188.8 ms per forward; more rows per program were slower."""

E4M3_REL_ROUNDING = 2.0**-4
"""Largest relative error of rounding a value in e4m3's normal range (|v| >= 2^-6) to nearest: half of 2^-3."""
E4M3_SUBNORMAL_ROUNDING = 2.0**-10
"""Largest absolute error of rounding a subnormal value (|v| < 2^-6) to nearest: half of the 2^-9 step."""

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:  # pragma: no cover - depends on the torch build; gelu_quant_capability reports it
    triton = None


def norm_quant_capability(device: torch.device, n_columns: int) -> Capability:
    """Whether the kernels can run for rows of ``n_columns`` on ``device`` (CUDA, Triton, at most
    :data:`.gelu_quant.MAX_COLUMNS` columns)."""
    capability = gelu_quant_capability(device, n_columns)
    if not capability.ok:
        return capability
    return Capability.yes(f"Triton LayerNorm + modulation + quantize kernel on {device}")


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


def reference_residual_modulate_quantize(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, eps: float,
                                         mod: torch.Tensor, n_params: int, gate_index: int, shift_index: int,
                                         scale_index: int, selector: torch.Tensor | None = None
                                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the residual kernel computes, in plain torch: ``x + gate * (y + bias)``, then as above.

    x: [B, S, D] bf16 (the residual stream); y: [B * S, D] (a linear's output before its bias); bias: [D] or
    None. Returns (new residual [B, S, D] bf16, x8 [B * S, D] float8_e4m3fn, scale [B * S, 1] float32).
    """
    b, s, d = x.shape
    sets = mod.shape[0] // 2 if selector is not None else mod.shape[0]
    rows = _modulation_rows(b * s, s, sets, selector, x.device)
    gate = mod.unflatten(-1, (n_params, d))[rows][:, gate_index]
    update = y.float() if bias is None else (y.float() + bias.float()).to(x.dtype).float()
    new = (x.reshape(-1, d).float() + gate.float() * update).to(x.dtype).reshape(b, s, d)
    return (new, *reference_modulate_quantize(new, eps, mod, n_params, shift_index, scale_index, selector))


if triton is not None:
    from .attention.triton_fp8 import _to_e4m3, interpreter_active
    from .gelu_quant import _E4M3_MAX, _EPS, _quantize_store_row

    _E4M3_REL_ROUNDING = tl.constexpr(E4M3_REL_ROUNDING)
    _E4M3_SUBNORMAL_ROUNDING = tl.constexpr(E4M3_SUBNORMAL_ROUNDING)

    @triton.jit
    def _max_and_sum(a_max, a_sum, b_max, b_sum):
        return tl.maximum(a_max, b_max), a_sum + b_sum

    @triton.jit
    def _residual_chunk(x_ptr, y_ptr, bias_ptr, gate_ptr, new_ptr, cols, mask, RESIDUAL: tl.constexpr,  # noqa: N803
                        HAS_BIAS: tl.constexpr, MASKED: tl.constexpr):  # noqa: N803
        """One chunk of the row as float32: x, or (RESIDUAL) x + gate * (y + bias) rounded to bf16 and stored."""
        x = (tl.load(x_ptr + cols, mask=mask, other=0.0) if MASKED else tl.load(x_ptr + cols)).to(tl.float32)
        if RESIDUAL:  # x <- x + gate * (y + bias), written back as the new residual stream
            update = (tl.load(y_ptr + cols, mask=mask, other=0.0) if MASKED else tl.load(y_ptr + cols)).to(tl.float32)
            if HAS_BIAS:
                b = tl.load(bias_ptr + cols, mask=mask, other=0.0) if MASKED else tl.load(bias_ptr + cols)
                update = (update + b.to(tl.float32)).to(tl.bfloat16).to(tl.float32)
            gate = (tl.load(gate_ptr + cols, mask=mask, other=0.0) if MASKED else tl.load(gate_ptr + cols))
            x = (x + gate.to(tl.float32) * update).to(tl.bfloat16)
            if MASKED:
                tl.store(new_ptr + cols, x, mask=mask)
            else:
                tl.store(new_ptr + cols, x)
            x = x.to(tl.float32)
        return x

    @triton.jit
    def _modulated_chunk(x, mean, rstd, shift_ptr, scale_ptr, cols, mask, MASKED: tl.constexpr):  # noqa: N803
        """LayerNorm (rounded to bf16) * (1 + scale) + shift of one chunk, rounded to bf16, as float32."""
        ln = ((x - mean) * rstd).to(tl.bfloat16).to(tl.float32)
        shift = (tl.load(shift_ptr + cols, mask=mask, other=0.0) if MASKED else tl.load(shift_ptr + cols))
        scale_m = (tl.load(scale_ptr + cols, mask=mask, other=0.0) if MASKED else tl.load(scale_ptr + cols))
        m = (ln * (1.0 + scale_m.to(tl.float32)) + shift.to(tl.float32)).to(tl.bfloat16).to(tl.float32)
        return tl.where(mask, m, 0.0) if MASKED else m

    @triton.jit
    def _modulate_quant_kernel(x_ptr, mod_ptr, sel_ptr, out_ptr, scale_ptr, y_ptr, bias_ptr, new_ptr, n_cols, tokens,
                               sets, stride_x, stride_y, stride_mod, gate_off, shift_off, scale_off, eps,
                               HAS_SELECTOR: tl.constexpr, RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,  # noqa: N803
                               BLOCK: tl.constexpr, CHUNKS: tl.constexpr, INTERPRET: tl.constexpr):  # noqa: N803
        """One row per program. CHUNKS 1: the row in one BLOCK >= n_cols, masked. CHUNKS 3: n_cols == 3 * BLOCK,
        three unmasked chunks (no idle lanes where the width is 3 * 2^k, e.g. 3072)."""
        row = tl.program_id(0).to(tl.int64)
        token = row % tokens
        prow = (row // tokens) % sets
        if HAS_SELECTOR:
            keep = tl.load(sel_ptr + token)
            prow = tl.where(keep != 0, prow, prow + sets)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        mod_row = mod_ptr + prow * stride_mod
        x_row, y_row, new_row = x_ptr + row * stride_x, y_ptr + row * stride_y, new_ptr + row * n_cols
        gate_row, shift_row, scale_row = mod_row + gate_off, mod_row + shift_off, mod_row + scale_off
        out_row = out_ptr + row * n_cols
        if CHUNKS == 3:
            x0 = _residual_chunk(x_row, y_row, bias_ptr, gate_row, new_row, cols, mask, RESIDUAL, HAS_BIAS, False)
            x1 = _residual_chunk(x_row + BLOCK, y_row + BLOCK, bias_ptr + BLOCK, gate_row + BLOCK, new_row + BLOCK,
                                 cols, mask, RESIDUAL, HAS_BIAS, False)
            x2 = _residual_chunk(x_row + 2 * BLOCK, y_row + 2 * BLOCK, bias_ptr + 2 * BLOCK, gate_row + 2 * BLOCK,
                                 new_row + 2 * BLOCK, cols, mask, RESIDUAL, HAS_BIAS, False)
            mean = (tl.sum(x0, axis=0) + tl.sum(x1, axis=0) + tl.sum(x2, axis=0)) / n_cols
            var = (tl.sum((x0 - mean) * (x0 - mean), axis=0) + tl.sum((x1 - mean) * (x1 - mean), axis=0)
                   + tl.sum((x2 - mean) * (x2 - mean), axis=0)) / n_cols
            rstd = tl.rsqrt(var + eps)
            m0 = _modulated_chunk(x0, mean, rstd, shift_row, scale_row, cols, mask, False)
            m1 = _modulated_chunk(x1, mean, rstd, shift_row + BLOCK, scale_row + BLOCK, cols, mask, False)
            m2 = _modulated_chunk(x2, mean, rstd, shift_row + 2 * BLOCK, scale_row + 2 * BLOCK, cols, mask, False)
        else:
            x0 = _residual_chunk(x_row, y_row, bias_ptr, gate_row, new_row, cols, mask, RESIDUAL, HAS_BIAS, True)
            mean = tl.sum(x0, axis=0) / n_cols
            centered = tl.where(mask, x0 - mean, 0.0)
            rstd = tl.rsqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)
            m0 = _modulated_chunk(x0, mean, rstd, shift_row, scale_row, cols, mask, True)
            m1, m2 = m0, m0
        _quantize_store_row(out_row, scale_ptr + row, m0, m1, m2, cols, mask, BLOCK, CHUNKS, INTERPRET)

    @triton.jit
    def _modulate_quant_rows_kernel(x_ptr, mod_ptr, sel_ptr, out_ptr, scale_ptr, y_ptr, bias_ptr, new_ptr, norm_ptr,
                                    n_rows, tokens, sets, stride_x, stride_y, stride_mod, gate_off, shift_off,
                                    scale_off, eps, HAS_SELECTOR: tl.constexpr,  # noqa: N803
                                    RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,  # noqa: N803
                                    BLOCK: tl.constexpr, NORMS: tl.constexpr, INTERPRET: tl.constexpr):  # noqa: N803
        """ROWS rows per program as a (ROWS, BLOCK) tile per chunk, rows of exactly 3 * BLOCK columns.

        Each reduction (mean, variance, amax) is one cross-warp reduction for all ROWS rows: the three
        chunks are combined in registers first. Rows past ``n_rows`` take the last row's modulation row,
        load zeros and store nothing. NORMS: also an upper bound of the L2 norm of each quantized row as the GEMM
        reads it, ``||codes|| * scale`` (module docstring, "Row norms").
        """
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        live = rows < n_rows
        rows = tl.where(live, rows, n_rows - 1)
        token = rows % tokens
        prow = (rows // tokens) % sets
        if HAS_SELECTOR:
            keep = tl.load(sel_ptr + token)
            prow = tl.where(keep != 0, prow, prow + sets)
        cols = tl.arange(0, BLOCK)[None, :]
        live2 = live[:, None]
        r2, p2 = rows[:, None], prow[:, None]
        x_row, y_row, new_row = x_ptr + r2 * stride_x, y_ptr + r2 * stride_y, new_ptr + r2 * (3 * BLOCK)
        mod_row = mod_ptr + p2 * stride_mod
        gate_row, shift_row, scale_row = mod_row + gate_off, mod_row + shift_off, mod_row + scale_off
        # masked by row: a program's rows past n_rows load zeros and store nothing
        x0 = _residual_chunk(x_row, y_row, bias_ptr, gate_row, new_row, cols, live2, RESIDUAL, HAS_BIAS, True)
        x1 = _residual_chunk(x_row + BLOCK, y_row + BLOCK, bias_ptr + BLOCK, gate_row + BLOCK, new_row + BLOCK, cols,
                             live2, RESIDUAL, HAS_BIAS, True)
        x2 = _residual_chunk(x_row + 2 * BLOCK, y_row + 2 * BLOCK, bias_ptr + 2 * BLOCK, gate_row + 2 * BLOCK,
                             new_row + 2 * BLOCK, cols, live2, RESIDUAL, HAS_BIAS, True)
        n_cols = 3 * BLOCK
        mean = (tl.sum(x0 + x1 + x2, axis=1) / n_cols)[:, None]
        d0, d1, d2 = x0 - mean, x1 - mean, x2 - mean
        rstd = tl.rsqrt(tl.sum(d0 * d0 + d1 * d1 + d2 * d2, axis=1) / n_cols + eps)[:, None]
        m0 = _modulated_chunk(x0, mean, rstd, shift_row, scale_row, cols, live2, False)
        m1 = _modulated_chunk(x1, mean, rstd, shift_row + BLOCK, scale_row + BLOCK, cols, live2, False)
        m2 = _modulated_chunk(x2, mean, rstd, shift_row + 2 * BLOCK, scale_row + 2 * BLOCK, cols, live2, False)
        peak = tl.maximum(tl.maximum(tl.abs(m0), tl.abs(m1)), tl.abs(m2))
        if NORMS:  # the row's sum of squares rides along in the amax reduction (one round)
            amax, sum_sq = tl.reduce((peak, m0 * m0 + m1 * m1 + m2 * m2), 1, _max_and_sum)
        else:
            amax = tl.max(peak, axis=1)
        scale = tl.maximum(amax, _EPS) / _E4M3_MAX
        inv = (1.0 / scale)[:, None]
        out_row = out_ptr + r2 * n_cols
        c0 = _to_e4m3(tl.clamp(m0 * inv, -_E4M3_MAX, _E4M3_MAX), INTERPRET)
        c1 = _to_e4m3(tl.clamp(m1 * inv, -_E4M3_MAX, _E4M3_MAX), INTERPRET)
        c2 = _to_e4m3(tl.clamp(m2 * inv, -_E4M3_MAX, _E4M3_MAX), INTERPRET)
        tl.store(out_row + cols, c0, mask=live2)
        tl.store(out_row + BLOCK + cols, c1, mask=live2)
        tl.store(out_row + 2 * BLOCK + cols, c2, mask=live2)
        tl.store(scale_ptr + rows, scale, mask=live)
        if NORMS:  # an upper bound of ||codes|| * scale (module docstring, "Row norms")
            subnormal = _E4M3_SUBNORMAL_ROUNDING * tl.sqrt(n_cols * 1.0) * scale
            bound = (1.0 + _E4M3_REL_ROUNDING) * tl.sqrt(sum_sq) + subnormal
            tl.store(norm_ptr + rows, bound, mask=live)

    def _launch(x2d, tokens, eps, mod, shift_index, scale_index, selector, residual, num_warps, rows_per_program,
                with_norms=False):
        """residual: None or (y2d, bias or None, gate_index, new2d). Returns (x8, scale, norms): norms (rows, 1)
        float32 with ``with_norms`` (upper bounds of :func:`quantized_row_norms`' values from the multi-row kernel,
        those values from the one-row kernel), else (0, 1)."""
        rows, cols = x2d.shape
        out = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x2d.device)
        scale = torch.empty((rows, 1), dtype=torch.float32, device=x2d.device)
        norms = torch.empty((rows if with_norms else 0, 1), dtype=torch.float32, device=x2d.device)
        sets = mod.shape[0] // 2 if selector is not None else mod.shape[0]
        y2d, bias, gate_index, new2d = residual if residual is not None else (x2d, None, 0, x2d)
        chunks, block = row_chunks(cols)
        common = {"HAS_SELECTOR": selector is not None, "RESIDUAL": residual is not None,
                  "HAS_BIAS": bias is not None, "BLOCK": block, "INTERPRET": interpreter_active(),
                  "num_warps": num_warps}
        args = (x2d, mod, selector if selector is not None else x2d, out, scale, y2d, bias if bias is not None else x2d,
                new2d)
        if rows_per_program > 0 and chunks == 3:
            wrap_triton(_modulate_quant_rows_kernel)[(triton.cdiv(rows, rows_per_program),)](
                *args, norms if with_norms else scale, rows, tokens, sets, x2d.stride(0), y2d.stride(0),
                mod.stride(0), gate_index * cols, shift_index * cols, scale_index * cols, eps, ROWS=rows_per_program,
                NORMS=with_norms, **common)
        else:
            wrap_triton(_modulate_quant_kernel)[(rows,)](
                *args, cols, tokens, sets, x2d.stride(0), y2d.stride(0), mod.stride(0), gate_index * cols,
                shift_index * cols, scale_index * cols, eps, CHUNKS=chunks, **common)
            if with_norms:  # the one-row kernel has no norms output: the same values from its codes
                norms.copy_(quantized_row_norms(out, scale))
        return out, scale, norms

    @triton_op(OP_NAME, mutates_args={})
    def _modulate_quantize_op(x2d: torch.Tensor, tokens: int, eps: float, mod: torch.Tensor, n_params: int,
                              shift_index: int, scale_index: int, selector: torch.Tensor | None,
                              num_warps: int = DEFAULT_WARPS, rows_per_program: int = DEFAULT_ROWS,
                              with_norms: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _launch(x2d, tokens, eps, mod, shift_index, scale_index, selector, None, num_warps, rows_per_program,
                       with_norms)

    @triton_op(RESIDUAL_OP_NAME, mutates_args={})
    def _residual_modulate_quantize_op(x2d: torch.Tensor, y2d: torch.Tensor, bias: torch.Tensor | None, tokens: int,
                                       eps: float, mod: torch.Tensor, n_params: int, gate_index: int,
                                       shift_index: int, scale_index: int, selector: torch.Tensor | None,
                                       num_warps: int = DEFAULT_WARPS, rows_per_program: int = DEFAULT_ROWS,
                                       with_norms: bool = False
                                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        new2d = torch.empty_like(x2d)
        out, scale, norms = _launch(x2d, tokens, eps, mod, shift_index, scale_index, selector,
                                    (y2d, bias, gate_index, new2d), num_warps, rows_per_program, with_norms)
        return new2d, out, scale, norms


def quantized_row_norms(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(M, 1) float32 L2 norms of the dequantized rows ``x8[t] * scale[t]`` (x8 (M, K) e4m3, scale (M, 1))."""
    return x8.float().pow(2).sum(-1, keepdim=True).sqrt() * scale.reshape(-1, 1).float()


def modulate_quantize_rowwise(x: torch.Tensor, eps: float, mod: torch.Tensor, n_params: int, shift_index: int,
                              scale_index: int, selector: torch.Tensor | None = None, with_norms: bool = False, *,
                              num_warps: int = DEFAULT_WARPS, rows_per_program: int = DEFAULT_ROWS
                              ) -> tuple[torch.Tensor, ...]:
    """Fused ``quantize_rowwise(LayerNorm(x) * (1 + scale) + shift)`` (layout: module docstring).

    x: [B, S, D] bf16 CUDA; mod: [R, n_params * D] with contiguous rows; selector: None, or a bool
    tensor of S elements ([S] or [1, S, 1]). Returns (x8 [B * S, D] float8_e4m3fn, scale [B * S, 1]
    float32), and with ``with_norms`` also norms [B * S, 1] float32 (upper bounds of :func:`quantized_row_norms`:
    module docstring, "Row norms"). ``num_warps`` / ``rows_per_program``: the launch (:data:`DEFAULT_WARPS`,
    :data:`DEFAULT_ROWS`; ``rows_per_program`` 0 runs the one-row kernel). Raises ValueError with the reason where
    the kernel cannot run.
    """
    capability = norm_quant_capability(x.device, x.shape[-1])
    if not capability.ok:
        raise ValueError(capability.reason)
    if x.dtype != torch.bfloat16 or x.dim() != 3 or mod.dim() != 2 or mod.stride(-1) != 1:
        raise ValueError(f"modulate_quantize_rowwise takes x [B, S, D] bf16 and mod [R, C] with contiguous rows, "
                         f"got x {x.dtype} {tuple(x.shape)}, mod {tuple(mod.shape)} strides {mod.stride()}")
    sel = None if selector is None else selector.reshape(-1).to(torch.uint8)
    x8, scale, norms = _modulate_quantize_op(x.reshape(-1, x.shape[-1]).contiguous(), x.shape[1], float(eps), mod,
                                             n_params, shift_index, scale_index, sel, num_warps, rows_per_program,
                                             with_norms)
    return (x8, scale, norms) if with_norms else (x8, scale)


def residual_modulate_quantize_rowwise(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, eps: float,
                                       mod: torch.Tensor, n_params: int, gate_index: int, shift_index: int,
                                       scale_index: int, selector: torch.Tensor | None = None,
                                       with_norms: bool = False, *, num_warps: int = DEFAULT_WARPS,
                                       rows_per_program: int = DEFAULT_ROWS) -> tuple[torch.Tensor, ...]:
    """Fused gated residual update, then :func:`modulate_quantize_rowwise` of the updated stream.

    ``new = x + gate * (y + bias)`` (bf16 roundings as eager's bias add and ``addcmul``; ``gate`` the
    modulation vector at ``gate_index``, chosen per token as shift and scale are), then the quantized
    ``LayerNorm(new) * (1 + scale) + shift``. x: [B, S, D] bf16 CUDA; y: [B * S, D] bf16 with contiguous rows;
    bias: [D] or None. Returns (new [B, S, D] bf16, x8 [B * S, D] float8_e4m3fn, scale [B * S, 1] float32), and
    with ``with_norms`` also norms [B * S, 1] float32 (upper bounds of :func:`quantized_row_norms`). ``num_warps``
    / ``rows_per_program`` as :func:`modulate_quantize_rowwise`'s.
    """
    capability = norm_quant_capability(x.device, x.shape[-1])
    if not capability.ok:
        raise ValueError(capability.reason)
    if x.dtype != torch.bfloat16 or x.dim() != 3 or y.dtype != torch.bfloat16 or y.dim() != 2 or y.stride(-1) != 1:
        raise ValueError(f"residual_modulate_quantize_rowwise takes x [B, S, D] and y [B * S, D] bf16 with contiguous "
                         f"rows, got x {x.dtype} {tuple(x.shape)}, y {y.dtype} {tuple(y.shape)}")
    sel = None if selector is None else selector.reshape(-1).to(torch.uint8)
    new, x8, scale, norms = _residual_modulate_quantize_op(
        x.reshape(-1, x.shape[-1]).contiguous(), y, bias.to(y.dtype).contiguous() if bias is not None else None,
        x.shape[1], float(eps), mod, n_params, gate_index, shift_index, scale_index, sel, num_warps, rows_per_program,
        with_norms)
    return (new.reshape(x.shape), x8, scale, norms) if with_norms else (new.reshape(x.shape), x8, scale)
