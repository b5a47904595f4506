"""bench/profile_forward.py: its kernel categories on kernel names seen in H200 profiles, and its --options specs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from profile_forward import category, options_named


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


def test_options_specs_turn_fields_on_and_off_and_bad_ones_name_the_input():
    assert options_named("shipped-without:ulysses_traced_exchange").ulysses_traced_exchange is False
    assert options_named("shipped-with:ulysses_traced_exchange").ulysses_traced_exchange is True
    assert options_named("shipped-without:trim_last_block+gelu_gemm").describe() == \
        "shipped except trim_last_block=False, gelu_gemm=()"
    for spec, message in (("fastest", "--options 'fastest': use shipped, unfused"),
                          ("shipped-with:no_such_field", "no option 'no_such_field'; options: trim_last_block"),
                          ("shipped-with:gelu_gemm", "gelu_gemm is not a True/False option")):
        with pytest.raises(SystemExit, match=message):
            options_named(spec)
