"""The kernel categories of bench/profile_forward.py, on kernel names seen in H200 profiles."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from profile_forward import category


@pytest.mark.parametrize(("name", "expected"), [
    ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_ssched_bz_ovscale_TNT", "fp8 GEMM"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT", "bf16 GEMM"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f8_knob_32_64x256x128_4x1x1_cga1x1x1_kernel0_0",
     "attention"),
    ("triton_red_fused__to_copy_abs_add_amax_clamp_cublaslt_rowwise_mm_div_gelu_view_18", "Triton fused elementwise"),
    ("triton_poi_fused__to_copy_add_addcmul_cat_clamp_min_cudnn_fp8_attention_mul_reciprocal_select_transpose_view_1",
     "Triton fused elementwise"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::addcmul", "other"),
])
def test_kernel_names_fall_in_their_category(name, expected):
    assert category(name) == expected
