"""The Gluon int8 attention kernel without a GPU: its config, its custom op's fake kernel, and its machine code.

The kernel cannot run on CPU (Gluon has no interpreter), so these tests compile it for sm_90a with
Triton's bundled ptxas and read the SASS: what would make it wrong or slow on an H100 shows there
(no int8 / bf16 wgmma, spills, or ptxas serializing the asynchronous wgmma that the whole design
rests on). Its numerics run on the GPU (tests/gpu/test_attention_fp8.py).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

from qwen_edit_hopper.fp8.attention import gluon_int8 as gi  # noqa: E402
from qwen_edit_hopper.fp8.attention.backends import gluon_int8_attention_op  # noqa: E402


def _bin(name: str) -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def _compile_sm90(config: gi.GluonAttentionConfig, tmp_path: Path) -> tuple[str, str]:
    """(ptxas -v report, SASS) of the attention kernel for ``config``, compiled for sm_90a without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    bm, bn, d = config.block_m, config.block_n, gi.GLUON_HEAD_DIM
    layouts = {
        "q": gl.NVMMASharedLayout.get_default_for([bm, d], gl.int8),
        "k": gl.NVMMASharedLayout.get_default_for([bn, d], gl.int8),
        "v": gl.NVMMASharedLayout.get_default_for([bn, d], gl.bfloat16),
    }
    sig = {
        "q_desc": f"tensordesc<i8[{bm}, {d}],{layouts['q']!r}>", "qs_ptr": "*fp32",
        "k_desc": f"tensordesc<i8[{bn}, {d}],{layouts['k']!r}>", "ks_ptr": "*fp32",
        "v_desc": f"tensordesc<bf16[{bn}, {d}],{layouts['v']!r}>", "o_ptr": "*bf16",
        "S": "i32", "S_pad": "i32", "H": "i32", "v_row_b": "i32", "v_row_h": "i32", "v_col_h": "i32",
        "STAGES": "constexpr", "num_warps": "constexpr",
    }  # fmt: skip
    const = {"STAGES": config.stages, "num_warps": config.num_warps}
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(sig) if sig[k].startswith("*") or k == "S_pad"}
    src = GluonASTSource(fn=gi._attn_kernel, signature=sig, constexprs=const, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": config.num_warps})
    ptx, cubin = tmp_path / "k.ptx", tmp_path / "k.cubin"
    ptx.write_text(kernel.asm["ptx"])
    cubin.write_bytes(kernel.asm["cubin"])
    report = subprocess.run(
        [str(_bin("ptxas")), "-arch=sm_90a", "-v", str(ptx), "-o", str(tmp_path / "x.cubin")],
        capture_output=True, text=True, check=True,
    ).stderr  # fmt: skip
    sass = subprocess.run([str(_bin("cuobjdump")), "-sass", str(cubin)], capture_output=True, text=True, check=True)
    return report, sass.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "config", [gi.DEFAULT_GLUON_CONFIG, gi.GluonAttentionConfig(num_warps=8, stages=3, block_n=128)], ids=str
)
def test_kernel_compiles_for_hopper_with_async_int8_and_bf16_wgmma(config, tmp_path):
    if not _bin("ptxas").exists():
        pytest.skip(f"this triton has no bundled ptxas at {_bin('ptxas')}")
    report, sass = _compile_sm90(config, tmp_path)
    assert "C7515" not in report, f"ptxas serialized the wgmma pipeline: {report}"
    assert re.search(r"\b0 bytes spill stores", report), report
    assert int(re.search(r"Used (\d+) registers", report).group(1)) <= 232, report
    # QK^T as int8 wgmma from shared memory, PV as bf16 wgmma with P from registers and V transposed.
    assert re.search(rf"IGMMA\.64x{config.block_n}x32\.S8\.S8", sass)
    assert re.search(r"HGMMA\.64x128x16\.F32\.BF16 R\d+, R\d+, gdesc\[UR\d+\]\.tnspB", sass)
    # The overlap: the loop waits for "all but one" wgmma group (S_j done, P V still running).
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass
    assert "MUFU.EX2" in sass


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"num_warps": 2}, "num_warps"), ({"stages": 5}, "stages"), ({"block_n": 32}, "block_n")],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gi.GluonAttentionConfig(**kwargs)


def test_config_label_and_block_m():
    assert gi.GluonAttentionConfig(num_warps=8, stages=3, block_n=128).label == "gluon_int8_m128n128w8s3"
    assert gi.DEFAULT_GLUON_CONFIG.block_m == 64


def test_custom_op_has_a_fake_kernel():
    q = torch.empty(2, 3, 50, 128, dtype=torch.bfloat16, device="meta")
    out = gluon_int8_attention_op(q, q, q, 4, 4)
    assert out.shape == (2, 50, 3 * 128) and out.dtype == torch.bfloat16 and out.device.type == "meta"


def test_v_view_needs_no_copy_for_the_dit_layout():
    b, h, s, d = 2, 3, 5, 128
    v_bshd = torch.randn(b, s, h, d).transpose(1, 2)  # the DiT's (B, S, H, D) memory as (B, H, S, D)
    v2d, row_b, row_h, col_h = gi._v_view(v_bshd)
    assert v2d.data_ptr() == v_bshd.data_ptr() and (row_b, row_h, col_h) == (s, 0, d)
    for bi in range(b):
        for hi in range(h):
            rows = slice(bi * row_b + hi * row_h, bi * row_b + hi * row_h + s)
            torch.testing.assert_close(v2d[rows, hi * col_h : hi * col_h + d], v_bshd[bi, hi], rtol=0, atol=0)
    v_bhsd = torch.randn(b, h, s, d)
    v2d, row_b, row_h, col_h = gi._v_view(v_bhsd)
    assert (row_b, row_h, col_h) == (h * s, s, 0)
    torch.testing.assert_close(v2d[row_b + 2 * row_h : row_b + 2 * row_h + s], v_bhsd[1, 2], rtol=0, atol=0)
