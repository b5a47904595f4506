"""A/B of the fast forward's options on one fp8 model: text-stream GEMM kernel, modulation launches, CUDA graphs.

Full-size Qwen-Image-Edit DiT, random weights, 1024x1024 edit with one reference image (8192 image +
300 text tokens), the fastest preset (row-wise fp8, fast accumulation, "attn+mlp+mod compute", compiled
blocks, ``cudnn_fp8`` attention). One fp8 model serves every variant; each variant's batch-1 forward and
batch-2 forward (true CFG: cond + uncond) are timed in alternating rounds (CUDA events, median), so clock
and power drift hit all variants alike. Variants:

* ``cuBLASLt text GEMMs``: every fp8 GEMM through ``torch._scaled_mm`` (the seventh session's forward);
* ``small-M text GEMMs``: the text stream's M = 300 GEMMs through :mod:`fp8.small_m_gemm` (batch 2's M = 600
  keep cuBLASLt);
* ``... + CUDA graphs``: the same through the pack's whole-forward graphs (:mod:`qwen_edit.fast.graphs`);
* with ``--modulation``, also shared-input modulation (:mod:`qwen_edit.fast.modulation`, off by default);
* with ``--scalars`` instead: 1 / descale (cuDNN's output scale) and the output projections' row scales
  written by the v cast kernel (``fp8_attention.V_KERNEL_SCALARS``, shipped) or by three small kernels per block;
* with ``--qk-bound`` instead: the q / k bounds by two small reductions per block, or inside the QK kernel
  (``fp8_attention.QK_KERNEL_BOUND``);
* with ``--gemm`` instead: the large GEMMs through ``torch._scaled_mm`` or through the pack's workspace-free
  cuBLASLt call (``ScaledMMLinear.gemm_kernel``, :mod:`fp8.cublaslt_gemm`);
* with ``--text`` instead: the text stream's Q/K/V as three GEMMs or as one fused GEMM
  (:func:`qwen_edit.fast.qkv.fuse_fp8_qkv`), and its MLP down-projection split over K in two
  (``fp8.small_m_gemm.SPLIT_K``);
* with ``--residual`` instead: the gated residual updates after the output projections unfused (the twelfth
  session's forward) or in the cuBLASLt epilogue (``fast.residual_gemm.SITES``), then also the image stream's
  Q/K/V as one GEMM (``qkv.USE_FUSED``), then also shared-input modulation;
* with ``--gelu-gemm`` instead: the image MLP's hidden state by cuBLASLt + ``fp8.gelu_quant`` or by the fused
  GELU GEMM (``fp8.gelu_gemm``, ``fast.mlp.FUSED_GELU_GEMM``);
* with ``--v-gemm`` instead: the image stream's v by cuBLASLt and ``fp8.v_quant``'s max and cast kernels, or by
  the joint v GEMM (``fp8.v_gemm``, ``fast.fp8_attention.JOINT_V_GEMM``);
* with ``--qk-kernel`` instead: the QK RMSNorm + RoPE + e4m3 kernel as the fourteenth session ran it (one program
  per token x 8 heads, ``bench/qk_rows_bench.py``'s ``v14_op`` put in the shipped op's place) or as shipped (one
  program per token);
* with ``--text-out`` instead: the text stream's output projection (M = 300, 3072 -> 3072, right after the
  attention kernel in the compiled block) through the small-M Triton GEMM or through cuBLASLt;
* with ``--norm-warps`` instead: the LayerNorm + modulate + quantize kernels at 4, 1 and 2 warps per row (one warp:
  every reduction in shuffles, no shared memory or barriers);
* with ``--modulation-stream`` instead: every block's modulation linear on its own, or the 120 as two shared-input
  launches with the kernels as before the sixteenth session (byte-wide weight loads) or with the 16-byte alignment
  hint (``fp8.shared_input_gemv``);
* with ``--alignment`` instead: cuDNN's output scale 4 bytes into the joint v GEMM's scalars (as before the
  sixteenth session: Inductor then marked the attention output and all after it unaligned) or 16 bytes in, with
  per-block or shared-input modulation;
* with ``--text-gelu-gemm`` instead: the text stream's MLP up-projection by the small-M GEMM + ``gelu_quant`` (as
  before the sixteenth session) or by the fused GELU GEMM (``fp8.gelu_gemm``, shipped);
* with ``--row-norms`` instead: the LayerNorm kernels' row norms (for the GELU GEMM's and the joint v GEMM's
  bounds) exact from the e4m3 codes, as before the sixteenth session, or as upper bounds (``fp8.norm_quant``);
* with ``--trim-last-block`` instead: the last block whole, or after its attention only the target image tokens
  (``qwen_edit.fast_forward.TRIM_LAST_BLOCK``: no reference-token rows in its output projection and MLP, no text
  stream, cuDNN's attention for the target query rows only; a first version that limited the query rows by cuDNN's
  padding mask instead gained less: docs/benchmarks.md, eighteenth session);
* with ``--norm`` instead: the LayerNorm + modulate + quantize kernels, one-row or multi-row
  (``fp8.norm_quant.DEFAULT_ROWS``), with small-M GEMMs and CUDA graphs. (Commit e9a0a48 of this bench also
  timed a cross-block residual update, since removed: docs/experiments/forward.md.)

Also the whole-forward relative error of each against bf16 eager. Run from the repo root on an H100 /
H200 (JSON in ``$OUT/forward_ab.json``)::

    source bench/device_env.sh && python3 bench/forward_ab_bench.py [--out DIR] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import harness_core as hc
import harness_models as hm
from pack import load_pack

SHIPPED = None
"""For the LayerNorm kernel's rows per program: the pack's default."""

VARIANTS = (  # label, shared-input modulation, CUDA graphs, small-M text GEMMs, LayerNorm rows per program,
    # attention scalars from the v kernel
    ("cuBLASLt text GEMMs", False, False, False, SHIPPED, SHIPPED),
    ("small-M text GEMMs", False, False, True, SHIPPED, SHIPPED),
    ("cuBLASLt text GEMMs + CUDA graphs", False, True, False, SHIPPED, SHIPPED),
    ("small-M text GEMMs + CUDA graphs", False, True, True, SHIPPED, SHIPPED),
)
MODULATION_VARIANTS = (
    ("small-M + shared-input modulation", True, False, True, SHIPPED, SHIPPED),
    ("small-M + shared-input modulation + CUDA graphs", True, True, True, SHIPPED, SHIPPED),
)
NORM_VARIANTS = (  # all with small-M GEMMs and CUDA graphs
    ("one-row LN kernel", False, True, True, 0, SHIPPED),
    ("multi-row LN kernel (1 row per program)", False, True, True, 1, SHIPPED),
)
SCALAR_VARIANTS = (  # all with small-M GEMMs and CUDA graphs
    ("attention scalars by small kernels", False, True, True, SHIPPED, False),
    ("attention scalars from the v kernel", False, True, True, SHIPPED, True),
)
QK_BOUND_VARIANTS = (  # all with small-M GEMMs and CUDA graphs; 8th field: fp8_attention.QK_KERNEL_BOUND
    ("q/k bounds by two reductions per block", False, True, True, SHIPPED, SHIPPED, SHIPPED, False),
    ("q/k bounds inside the QK kernel", False, True, True, SHIPPED, SHIPPED, SHIPPED, True),
)
TEXT_VARIANTS = (  # all with small-M GEMMs and CUDA graphs; 9th field: the text stream's fused Q/K/V layer
    # (qkv.USE_FUSED), 10th: the text MLP down-projection split over K (small_m_gemm.SPLIT_K)
    ("text Q/K/V: three GEMMs", False, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, False, False),
    ("text Q/K/V: one GEMM", False, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True, False),
    ("text Q/K/V: one GEMM; down-projection split-K", False, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True,
     True),
)
RESIDUAL_VARIANTS = (  # small-M GEMMs and CUDA graphs; 9th field: qkv.USE_FUSED, 11th: residual_gemm.SITES
    ("residual updates unfused", False, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, ("text",), SHIPPED, ()),
    ("residual updates in the GEMM epilogue", False, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, ("text",),
     SHIPPED, ("attention", "mlp")),
    ("epilogue + image Q/K/V one GEMM", False, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, ("image", "text"),
     SHIPPED, ("attention", "mlp")),
    ("epilogue + image Q/K/V + shared-input modulation", True, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED,
     ("image", "text"), SHIPPED, ("attention", "mlp")),
)
V_GEMM_VARIANTS = (  # small-M GEMMs and CUDA graphs, shipped residual sites and GELU GEMM; 13th: JOINT_V_GEMM
    ("v: cuBLASLt GEMM + max + cast kernels", False, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True, SHIPPED,
     SHIPPED, SHIPPED, False),
    ("v: joint v GEMM (bound scale)", False, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True, SHIPPED, SHIPPED,
     SHIPPED, True),
)
GELU_GEMM_VARIANTS = (  # small-M GEMMs and CUDA graphs, shipped residual sites; 12th field: mlp.FUSED_GELU_GEMM
    ("hidden state: cuBLASLt + gelu_quant", False, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True, SHIPPED,
     SHIPPED, False),
    ("hidden state: fused GELU GEMM", False, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True, SHIPPED, SHIPPED,
     True),
)
QK_KERNEL_VARIANTS = (  # small-M GEMMs and CUDA graphs, all else shipped; 14th field: the QK op
    ("QK kernel: 1 token x 8 heads per program", False, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True, SHIPPED,
     SHIPPED, SHIPPED, SHIPPED, "session 14"),
    ("QK kernel: 1 token per program", False, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True, SHIPPED, SHIPPED,
     SHIPPED, SHIPPED, SHIPPED),
)
TEXT_OUT_VARIANTS = (  # small-M GEMMs and CUDA graphs, all else shipped; 15th field: the text output projection's
    # (3072 -> 3072 at M = 300) small-M config kept (True) or dropped for cuBLASLt (False)
    ("text output projection: small-M Triton GEMM", False, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True,
     SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True),
    ("text output projection: cuBLASLt", False, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True, SHIPPED,
     SHIPPED, SHIPPED, SHIPPED, SHIPPED, False),
)
NORM_WARPS_VARIANTS = tuple(  # small-M GEMMs and CUDA graphs, all else shipped; 16th field: norm_quant.DEFAULT_WARPS
    (f"LayerNorm kernels: {w} warps per row", False, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True, SHIPPED,
     SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, w) for w in (4, 1, 2))
MODULATION_STREAM_VARIANTS = (  # small-M GEMMs and CUDA graphs, all else shipped; 17th field: the shared-input
    # kernels as before the sixteenth session ("before": no 16-byte alignment hint) or shipped
    ("modulation: per-block linears", False, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True, SHIPPED, SHIPPED,
     SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED),
    ("modulation: shared-input, kernels before session 16", True, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED,
     True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, "before"),
    ("modulation: shared-input, with the alignment hint", True, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED,
     True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED),
)
ALIGNMENT_VARIANTS = (  # small-M GEMMs and CUDA graphs, all else shipped; 18th field: where the joint v GEMM puts
    # cuDNN's output scale in its scalars (fp8.v_gemm._SCALE_O_SLOT: 1 = 4 bytes in, before the sixteenth session,
    # which made Inductor mark the attention output and everything after it unaligned; 4 = 16 bytes in)
    ("scale_o 4 bytes in, per-block modulation (session 15)", False, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED,
     True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, "before", 1),
    ("scale_o 16 bytes in, per-block modulation", False, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True,
     SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, 4),
    ("scale_o 16 bytes in, shared-input modulation (hint)", True, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True,
     SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, 4),
)
TEXT_GELU_GEMM_VARIANTS = (  # small-M GEMMs and CUDA graphs, all else shipped; 19th field: the text stream's MLP
    # up-projection by the fused GELU GEMM (shipped since the sixteenth session) or not (small-M GEMM + gelu_quant)
    ("text up-projection: small-M GEMM + gelu_quant", True, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True,
     SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, False),
    ("text up-projection: fused GELU GEMM", True, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True, SHIPPED,
     SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True),
)
ROW_NORMS_VARIANTS = (  # small-M GEMMs and CUDA graphs, all else shipped; 20th field: norm_quant.NORMS_FROM_CODES
    ("row norms from the e4m3 codes (exact)", True, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True, SHIPPED,
     SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True),
    ("row norm bounds (shipped)", True, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True, SHIPPED, SHIPPED,
     SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, False),
)
TRIM_VARIANTS = tuple(  # small-M GEMMs and CUDA graphs, all else shipped; 21st field: fast_forward.TRIM_LAST_BLOCK
    (label, True, True, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, True, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED,
     SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, SHIPPED, trim)
    for label, trim in (("last block whole", False), ("last block: the target tokens only after the attention", True)))

GEMM_VARIANTS = (  # all with small-M GEMMs and CUDA graphs; 7th field: ScaledMMLinear.gemm_kernel
    ("torch._scaled_mm GEMMs", False, True, True, SHIPPED, SHIPPED, "torch"),
    ("workspace-free cuBLASLt GEMMs", False, True, True, SHIPPED, SHIPPED, "cublaslt"),
)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--modulation", action="store_true", help="also the shared-input modulation variants")
    parser.add_argument("--scalars", action="store_true",
                        help="instead: attention scalars (1 / descale, output row scales) from the v cast kernel or "
                             "from small kernels, with small-M GEMMs and CUDA graphs")  # fmt: skip
    parser.add_argument("--qk-bound", action="store_true",
                        help="instead: the q / k bounds by small reductions or inside the QK kernel")
    parser.add_argument("--gemm", action="store_true",
                        help="instead: torch._scaled_mm against the workspace-free cuBLASLt GEMM")
    parser.add_argument("--text", action="store_true",
                        help="instead: the text stream's Q/K/V as three GEMMs or one, and its MLP down-projection "
                             "with or without a K split")  # fmt: skip
    parser.add_argument("--split-k-config", metavar="BM,BN,BK,WARPS,STAGES,SPLIT",
                        help="with --text: the down-projection's split-K tile config (default: the pack's)")
    parser.add_argument("--norm", action="store_true",
                        help="instead: the LayerNorm kernel, one-row or multi-row")
    parser.add_argument("--residual", action="store_true",
                        help="instead: residual updates unfused or in the GEMM epilogue, image Q/K/V fused, "
                             "shared-input modulation")  # fmt: skip
    parser.add_argument("--gelu-gemm", action="store_true",
                        help="instead: the image MLP's hidden state by cuBLASLt + gelu_quant or by the fused GELU GEMM")
    parser.add_argument("--v-gemm", action="store_true",
                        help="instead: v by cuBLASLt + the max and cast kernels, or by the joint v GEMM")
    parser.add_argument("--qk-kernel", action="store_true",
                        help="instead: the fourteenth session's QK kernel against the shipped one")
    parser.add_argument("--text-out", action="store_true",
                        help="instead: the text output projection through the small-M GEMM or cuBLASLt")
    parser.add_argument("--norm-warps", action="store_true",
                        help="instead: the LayerNorm kernels at 4, 1 and 2 warps per row")
    parser.add_argument("--modulation-stream", action="store_true",
                        help="instead: modulation per block, or shared-input with the old or the persistent kernel")
    parser.add_argument("--alignment", action="store_true",
                        help="instead: cuDNN's output scale 4 or 16 bytes into the joint v GEMM's scalars, with "
                             "per-block or shared-input modulation")
    parser.add_argument("--text-gelu-gemm", action="store_true",
                        help="instead: the text stream's MLP up-projection by small-M GEMM + gelu_quant or the fused "
                             "GELU GEMM")
    parser.add_argument("--row-norms", action="store_true",
                        help="instead: the LayerNorm kernels' row norms exact from the codes or as bounds (shipped)")
    parser.add_argument("--trim-last-block", action="store_true",
                        help="instead: the last block whole, or only its target image tokens after the attention")
    parser.add_argument("--zero-cond-t", action="store_true",
                        help="every forward with Qwen-Image-Edit-2511's zero_cond_t (reference tokens at timestep 0)")
    parser.add_argument("--only", metavar="I,J", help="run only these variants (0-based indices of the mode's list)")
    args = parser.parse_args()
    variants = (TRIM_VARIANTS if args.trim_last_block
                else NORM_VARIANTS if args.norm else SCALAR_VARIANTS if args.scalars else GEMM_VARIANTS if args.gemm
                else QK_BOUND_VARIANTS if args.qk_bound else TEXT_VARIANTS if args.text
                else RESIDUAL_VARIANTS if args.residual else GELU_GEMM_VARIANTS if args.gelu_gemm
                else V_GEMM_VARIANTS if args.v_gemm else QK_KERNEL_VARIANTS if args.qk_kernel
                else TEXT_OUT_VARIANTS if args.text_out else NORM_WARPS_VARIANTS if args.norm_warps
                else MODULATION_STREAM_VARIANTS if args.modulation_stream else ALIGNMENT_VARIANTS if args.alignment
                else TEXT_GELU_GEMM_VARIANTS if args.text_gelu_gemm else ROW_NORMS_VARIANTS if args.row_norms
                else VARIANTS + (MODULATION_VARIANTS if args.modulation else ()))  # fmt: skip
    if args.only:
        variants = tuple(variants[int(i)] for i in args.only.split(","))
    load_pack()
    from qwen_edit_hopper.fp8 import norm_quant, qk_norm_quant, small_m_gemm, v_gemm
    from qwen_edit_hopper.fp8.linear import ScaledMMLinear
    from qwen_edit_hopper.qwen_edit import fast_forward as ff
    from qwen_edit_hopper.qwen_edit.compile import dynamo_settings
    from qwen_edit_hopper.qwen_edit.fast import fp8_attention, graphs, mlp, modulation, qkv, residual_gemm

    shipped_rows, shipped_scalars = norm_quant.DEFAULT_ROWS, fp8_attention.V_KERNEL_SCALARS
    shipped_norm_warps = norm_quant.DEFAULT_WARPS
    shipped_qk_bound = fp8_attention.QK_KERNEL_BOUND
    shipped_split_k = small_m_gemm.SPLIT_K
    shipped_sites, shipped_fused = residual_gemm.SITES, qkv.USE_FUSED
    shipped_gelu_gemm, shipped_v_gemm = mlp.FUSED_GELU_GEMM, fp8_attention.JOINT_V_GEMM
    v_gemm_module = v_gemm
    shipped_norms_from_codes = norm_quant.NORMS_FROM_CODES
    shipped_trim = ff.TRIM_LAST_BLOCK
    from qwen_edit_hopper.qwen_edit.fast import block as fast_block

    shipped_uses_gelu_gemm = fast_block.uses_gelu_gemm

    def uses_gelu_gemm_unless_marked(mlp, x):  # the text MLPs off the fused GELU GEMM where a variant says so
        return shipped_uses_gelu_gemm(mlp, x) and not getattr(mlp, "bench_no_gelu_gemm", False)

    fast_block.uses_gelu_gemm = uses_gelu_gemm_unless_marked
    shipped_scale_o_slot = v_gemm._SCALE_O_SLOT
    qk_ops = {SHIPPED: qk_norm_quant._qk_norm_rope_quantize_op}
    text_out_config = small_m_gemm.OUTPUT_PROJECTION_CONFIG
    shipped_text_out_small_m = (3072, 3072) in small_m_gemm.CONFIGS
    if args.qk_kernel:
        import qk_rows_bench

        qk_ops["session 14"] = qk_rows_bench.v14_op
    if args.split_k_config:
        small_m_gemm.SPLIT_K_CONFIGS[(12288, 3072)] = tuple(int(v) for v in args.split_k_config.split(","))

    device = torch.device("cuda")
    base = hm.build_dit(hm.FULL, device)
    inputs = hm.ForwardInputs.make(1024, 1024, 300, 3584, device)
    reference = hm.fast_forward(ff, base, inputs, zero_cond_t=args.zero_cond_t).float()
    module = hm.fastest_fp8_dit(base, fused_qkv=() if args.text or args.residual else None)
    if args.text:  # both ways in one model: the three text projections and the fused layer beside them
        qkv.fuse_fp8_qkv(module, ("text",), keep_separate=True)
    if args.residual:  # the text stream fused (shipped), the image stream both ways
        qkv.fuse_fp8_qkv(module, ("text",))
        qkv.fuse_fp8_qkv(module, ("image",), keep_separate=True)
    del base
    torch.cuda.empty_cache()

    current = [None]

    layers = [m for m in module.modules() if isinstance(m, ScaledMMLinear)]
    shipped_gemm = layers[0].gemm_kernel

    def runner(fused: bool, graphed: bool, small_m: bool, rows: int | None, scalars: bool | None, *rest):
        *extra, batch = rest
        gemm = shipped_gemm if not extra or extra[0] is SHIPPED else extra[0]
        qk_bound = shipped_qk_bound if len(extra) < 2 or extra[1] is SHIPPED else extra[1]
        text_qkv = True if len(extra) < 3 else extra[2]
        use_fused = shipped_fused if text_qkv is True else () if text_qkv is False else text_qkv
        split_k = shipped_split_k if len(extra) < 4 or extra[3] is SHIPPED else extra[3]
        sites = shipped_sites if len(extra) < 5 or extra[4] is SHIPPED else extra[4]
        gelu_gemm = shipped_gelu_gemm if len(extra) < 6 or extra[5] is SHIPPED else extra[5]
        v_gemm = shipped_v_gemm if len(extra) < 7 or extra[6] is SHIPPED else extra[6]
        qk_op = qk_ops[SHIPPED if len(extra) < 8 else extra[7]]
        text_out_small_m = shipped_text_out_small_m if len(extra) < 9 or extra[8] is SHIPPED else extra[8]
        norm_warps = shipped_norm_warps if len(extra) < 10 or extra[9] is SHIPPED else extra[9]
        modulation_before = len(extra) > 10 and extra[10] == "before"
        scale_o_slot = shipped_scale_o_slot if len(extra) < 12 or extra[11] is SHIPPED else extra[11]
        text_gelu_gemm = True if len(extra) < 13 or extra[12] is SHIPPED else extra[12]
        norms_from_codes = shipped_norms_from_codes if len(extra) < 14 or extra[13] is SHIPPED else extra[13]
        trim = shipped_trim if len(extra) < 15 or extra[14] is SHIPPED else extra[14]
        signature = (fused, graphed, small_m, rows, scalars, gemm, qk_bound, use_fused, split_k, sites, gelu_gemm,
                     v_gemm, qk_op, text_out_small_m, norm_warps, modulation_before, scale_o_slot, text_gelu_gemm,
                     norms_from_codes, trim)

        def call():
            if current[0] != signature:  # not in a graph's signature
                graphs.disable_cuda_graphs(module)
                current[0] = signature
                fp8_attention.QK_KERNEL_BOUND = qk_bound
                qkv.USE_FUSED = use_fused
                residual_gemm.SITES = sites
                mlp.FUSED_GELU_GEMM = gelu_gemm
                fp8_attention.JOINT_V_GEMM = v_gemm
                qk_norm_quant._qk_norm_rope_quantize_op = qk_op  # read by _checked_call (Dynamo guards on it)
                v_gemm_module._SCALE_O_SLOT = scale_o_slot  # read by joint_v_gemm (Dynamo guards on it)
                norm_quant.NORMS_FROM_CODES = norms_from_codes  # read by the traced wrappers (Dynamo guards on it)
                for block in module.transformer_blocks:  # read by uses_gelu_gemm_unless_marked below
                    block.txt_mlp.bench_no_gelu_gemm = not text_gelu_gemm
                if text_out_small_m:
                    small_m_gemm.CONFIGS[(3072, 3072)] = text_out_config
                else:
                    small_m_gemm.CONFIGS.pop((3072, 3072), None)
                small_m_gemm.SPLIT_K = split_k
                for layer in layers:
                    layer.gemm_kernel = gemm
            modulation.FUSED_MODULATION = fused
            groups = modulation._groups(module) if fused else None
            for group in groups or ():
                group.aligned = not modulation_before  # the model's addresses are all 16-byte aligned
            small_m_gemm.ENABLED = small_m
            norm_quant.DEFAULT_ROWS = shipped_rows if rows is SHIPPED else rows
            norm_quant.DEFAULT_WARPS = norm_warps
            ff.TRIM_LAST_BLOCK = trim  # read by fast_model_fn on each call (not in a CUDA graph's signature)
            fp8_attention.V_KERNEL_SCALARS = shipped_scalars if scalars is SHIPPED else scalars
            if graphed:
                graphs.enable_cuda_graphs(module)
            else:
                graphs.disable_cuda_graphs(module)
            return hm.fast_forward(ff, module, inputs, batch=batch, attention="cudnn_fp8", zero_cond_t=args.zero_cond_t)

        return call

    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "zero_cond_t": args.zero_cond_t,
               "variants": {}}
    times: dict[tuple[str, int], list[float]] = {}
    with dynamo_settings():
        for label, *switches in variants:
            for batch in (1, 2):
                out = runner(*switches, batch)()
                if batch == 1:
                    results["variants"][label] = {"rel_err": rel_err(out, reference)}
                times[(label, batch)] = []
        for _ in range(args.rounds):
            for label, *switches in variants:
                for batch in (1, 2):
                    # only the graphed variants keep graphs: switching variants drops them, so re-capture first
                    call = runner(*switches, batch)
                    call()
                    times[(label, batch)].append(hc.time_calls(call, device, warmup=1, reps=args.reps)["ms"])
    for label, *_ in variants:
        one, two = (statistics.median(times[(label, b)]) for b in (1, 2))
        results["variants"][label].update({"batch1_ms": round(one, 2), "batch2_ms": round(two, 2),
                                           "ratio": round(two / one, 3),
                                           "rounds_batch1": [round(t, 2) for t in times[(label, 1)]]})  # fmt: skip
    from qwen_edit_hopper.fp8 import cublaslt_gemm

    results["split_k_configs"] = {f"{k}x{n}": list(c) for (k, n), c in small_m_gemm.SPLIT_K_CONFIGS.items()}
    results["cublaslt_plans"] = [{"key": list(k), "config": p.config, "candidate_us": p.timings_us}
                                 for k, p in cublaslt_gemm.plans().items()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "forward_ab.json").write_text(json.dumps(results, indent=1))
    print(f"\n{'variant':48s} {'batch 1 ms':>10s} {'batch 2 ms':>10s} {'b2 / b1':>8s} {'rel. error':>10s}")
    for label, v in results["variants"].items():
        print(f"{label:48s} {v['batch1_ms']:10.2f} {v['batch2_ms']:10.2f} {v['ratio']:8.3f} {v['rel_err']:10.2e}")
    print(f"cuBLASLt plans made: {len(results['cublaslt_plans'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
