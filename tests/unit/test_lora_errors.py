"""Bad LoRA input fails loudly, naming the file, the key and the shapes."""

from __future__ import annotations

import json
import re
import struct

import pytest
import torch
from qwen_edit_hopper.qwen_edit.lora import (
    LoraFileError,
    LoraFormatError,
    LoraMatchError,
    load_lora,
    parse_lora,
    read_lora_header,
)
from qwen_edit_hopper.qwen_edit.lora.testing import tiny_target_shapes, write_tiny_lora
from safetensors.torch import save_file

SHAPES = tiny_target_shapes(num_layers=2)


def _save(path, sd):
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


def test_sdxl_lora_matches_nothing(tmp_path):
    k = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    path = _save(
        tmp_path / "sdxl_style.safetensors",
        {f"{k}.lora_down.weight": torch.zeros(4, 320), f"{k}.lora_up.weight": torch.zeros(320, 4),
         f"{k}.alpha": torch.tensor(4.0)},
    )  # fmt: skip
    with pytest.raises(LoraMatchError, match=r"sdxl_style\.safetensors.*none of its 3 keys.*SDXL"):
        load_lora(path, SHAPES)


def test_flux_lora_matches_nothing(tmp_path):
    sd = {
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": torch.zeros(4, 16),
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight": torch.zeros(48, 4),
        "diffusion_model.single_blocks.0.linear1.lora_A.weight": torch.zeros(4, 16),
        "diffusion_model.single_blocks.0.linear1.lora_B.weight": torch.zeros(64, 4),
    }
    with pytest.raises(LoraMatchError, match=r"flux\.safetensors.*FLUX"):
        load_lora(_save(tmp_path / "flux.safetensors", sd), SHAPES)


def test_flux_diffusers_lora_that_partly_shares_qwen_names_is_refused():
    """FLUX's diffusers double blocks are named transformer_blocks.N.attn.to_q too (same width)."""
    m = "transformer.transformer_blocks.0"
    sd = {
        f"{m}.attn.to_q.lora_A.weight": torch.zeros(4, 16),
        f"{m}.attn.to_q.lora_B.weight": torch.zeros(16, 4),
        f"{m}.ff_context.net.0.proj.lora_A.weight": torch.zeros(4, 16),
        f"{m}.ff_context.net.0.proj.lora_B.weight": torch.zeros(64, 4),
    }
    with pytest.raises(LoraMatchError, match=r"fluxd\.safetensors: it has FLUX \(diffusers names\) layers.*Refused"):
        parse_lora(sd, SHAPES, source="fluxd.safetensors")


@pytest.mark.parametrize("suffix", [".ckpt", ".pt", ".pth", ".bin"])
def test_pickles_are_refused(tmp_path, suffix):
    path = tmp_path / f"lora{suffix}"
    torch.save({"a.lora_A.weight": torch.zeros(1)}, path)
    with pytest.raises(LoraFileError, match=rf"lora\{suffix}.*pickle.*arbitrary code"):
        load_lora(path, SHAPES)


def test_pickle_renamed_to_safetensors_is_refused(tmp_path):
    path = tmp_path / "renamed.safetensors"
    torch.save({"a.lora_A.weight": torch.zeros(1)}, path)
    with pytest.raises(LoraFileError, match=r"renamed\.safetensors.*pickle"):
        load_lora(path, SHAPES)


def test_other_suffix_and_missing_file(tmp_path):
    with pytest.raises(LoraFileError, match=r"only \.safetensors"):
        load_lora(tmp_path / "lora.gguf", SHAPES)
    with pytest.raises(LoraFileError, match=r"absent\.safetensors: not found"):
        load_lora(tmp_path / "absent.safetensors", SHAPES)


def _corrupt_variants(good: bytes) -> dict[str, bytes]:
    (n,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 4
    bad_offsets = json.dumps(header).encode()
    return {
        "empty": b"",
        "short": good[:5],
        "huge_header_length": struct.pack("<Q", 1 << 40) + good[8:],
        "not_json": struct.pack("<Q", 16) + b"\xff" * 16 + good[24:],
        "truncated": good[: len(good) - 10],
        "bad_offsets": struct.pack("<Q", len(bad_offsets)) + bad_offsets + good[8 + n :],
    }


@pytest.mark.parametrize("variant", ["empty", "short", "huge_header_length", "not_json", "truncated", "bad_offsets"])
def test_corrupted_files_name_the_file(tmp_path, variant):
    good = tmp_path / "good.safetensors"
    write_tiny_lora(good, "peft", SHAPES, layers=[0])
    path = tmp_path / f"broken_{variant}.safetensors"
    path.write_bytes(_corrupt_variants(good.read_bytes())[variant])
    with pytest.raises(LoraFileError, match=rf"broken_{variant}\.safetensors.*(corrupted|truncated)"):
        load_lora(path, SHAPES)


def test_header_is_read_without_tensors(tmp_path):
    path = tmp_path / "meta.safetensors"
    save_file({"x.lora_A.weight": torch.zeros(2, 3)}, str(path), metadata={"modelspec.title": "t"})
    header = read_lora_header(path)
    assert header.tensors["x.lora_A.weight"].shape == (2, 3) and dict(header.metadata) == {"modelspec.title": "t"}


M = "transformer_blocks.0.attn.to_q"


def test_rank_mismatch_names_file_key_and_shapes():
    sd = {f"{M}.lora_down.weight": torch.zeros(3, 16), f"{M}.lora_up.weight": torch.zeros(16, 4)}
    msg = re.escape(f"LoRA file r.safetensors: key '{M}.lora_up.weight' has shape (16, 4)")
    with pytest.raises(LoraFormatError, match=msg + r".*\(3, 16\).*rank"):
        parse_lora(sd, SHAPES, source="r.safetensors")


def test_alpha_that_is_not_a_scalar():
    sd = {
        f"{M}.lora_down.weight": torch.zeros(4, 16),
        f"{M}.lora_up.weight": torch.zeros(16, 4),
        f"{M}.alpha": torch.ones(4),
    }
    with pytest.raises(
        LoraFormatError, match=rf"a\.safetensors: key '{M}\.alpha' has shape \(4,\); alpha must be a scalar"
    ):
        parse_lora(sd, SHAPES, source="a.safetensors")


def test_factors_that_do_not_fit_the_target():
    sd = {f"{M}.lora_A.weight": torch.zeros(4, 17), f"{M}.lora_B.weight": torch.zeros(16, 4)}
    with pytest.raises(
        LoraFormatError, match=r"s\.safetensors.*gives \(16, 17\), but target .*to_q\.weight is \(16, 16\)"
    ):
        parse_lora(sd, SHAPES, source="s.safetensors")
    sd = {f"{M}.diff": torch.zeros(16, 15)}
    with pytest.raises(LoraFormatError, match=r"has shape \(16, 15\) but target"):
        parse_lora(sd, SHAPES, source="s.safetensors")
    sd = {
        f"lora_unet_{M.replace('.', '_')}.lokr_w1": torch.zeros(4, 4),
        f"lora_unet_{M.replace('.', '_')}.lokr_w2": torch.zeros(4, 5),
    }
    with pytest.raises(LoraFormatError, match=r"kron of w1 \(4, 4\) and w2 \(4, 5\)"):
        parse_lora(sd, SHAPES, source="s.safetensors")
    sd = {f"{M}.lora_A.weight": torch.zeros(4, 16, 3), f"{M}.lora_B.weight": torch.zeros(16, 4)}
    with pytest.raises(LoraFormatError, match=r"must be 2-D"):
        parse_lora(sd, SHAPES, source="s.safetensors")


def test_incomplete_factor_sets():
    with pytest.raises(LoraFormatError, match=r"has no matching lora down factor"):
        parse_lora({f"{M}.lora_up.weight": torch.zeros(16, 4)}, SHAPES, source="u.safetensors")
    k = f"lycoris_{M.replace('.', '_')}"
    sd = {
        f"{k}.hada_w1_a": torch.zeros(16, 4),
        f"{k}.hada_w1_b": torch.zeros(4, 16),
        f"{k}.hada_w2_a": torch.zeros(16, 4),
    }
    with pytest.raises(LoraFormatError, match=r"hada_w2_b are missing"):
        parse_lora(sd, SHAPES, source="h.safetensors")


def test_two_adapters_or_two_spellings_of_one_layer():
    sd = {
        f"{M}.lora_A.default.weight": torch.zeros(4, 16),
        f"{M}.lora_A.other.weight": torch.zeros(4, 16),
        f"{M}.lora_B.default.weight": torch.zeros(16, 4),
    }
    with pytest.raises(LoraFormatError, match=r"both the down factor"):
        parse_lora(sd, SHAPES, source="two.safetensors")
    sd = {
        f"transformer.{M}.lora_A.weight": torch.zeros(4, 16),
        f"transformer.{M}.lora_B.weight": torch.zeros(16, 4),
        f"diffusion_model.{M}.lora_A.weight": torch.zeros(4, 16),
        f"diffusion_model.{M}.lora_B.weight": torch.zeros(16, 4),
    }
    with pytest.raises(LoraFormatError, match=r"both map to transformer_blocks\.0\.attn\.to_q\.weight"):
        parse_lora(sd, SHAPES, source="two.safetensors")


def test_non_float_factor_and_non_finite_alpha():
    sd = {f"{M}.lora_A.weight": torch.zeros(4, 16, dtype=torch.int32), f"{M}.lora_B.weight": torch.zeros(16, 4)}
    with pytest.raises(LoraFormatError, match="floating point"):
        parse_lora(sd, SHAPES, source="i.safetensors")
    sd = {
        f"{M}.lora_A.weight": torch.zeros(4, 16),
        f"{M}.lora_B.weight": torch.zeros(16, 4),
        f"{M}.alpha": torch.tensor(float("inf")),
    }
    with pytest.raises(LoraFormatError, match="finite"):
        parse_lora(sd, SHAPES, source="i.safetensors")
