"""Weights are floating-point and finite: the checks themselves, and load_tensors / the loaders / LoRA files."""

from __future__ import annotations

import gc
from pathlib import Path

import bad_files as bad
import pytest
import torch
from qwen_edit_hopper.qwen_edit.checkpoints import (
    CheckpointError,
    load_dit,
    load_tensors,
    load_text_encoder,
    load_vae,
    resolve_single_files,
)
from qwen_edit_hopper.qwen_edit.checkpoints.integrity import (
    FiniteCheck,
    check_finite,
    check_float_dtypes,
    non_float_tensors,
)
from qwen_edit_hopper.qwen_edit.checkpoints.materialize import read_tensors
from qwen_edit_hopper.qwen_edit.lora import LoraFileError, load_lora
from qwen_edit_hopper.qwen_edit.lora.files import load_safetensors
from safetensors.torch import save_file
from test_checkpoints_support import tiny

SOURCE = Path("model.safetensors")
FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _nonfinite(tensors: dict[str, torch.Tensor]) -> list[str]:
    check = FiniteCheck()
    for name, tensor in tensors.items():
        check.add(name, tensor)
    return check.nonfinite()


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 17, -1])
def test_one_bad_value_anywhere_is_found(dtype, value, where):
    tensor = torch.randn(3, 4, 5, 6).to(dtype)
    tensor.view(-1)[where] = value
    assert _nonfinite({"good": torch.randn(8).to(dtype), "bad": tensor, "also_good": torch.ones(2, 2, dtype=dtype)}) \
        == ["bad"]


@pytest.mark.parametrize("dtype", FLOAT8)
def test_float8_nan_and_inf_bytes_are_found(dtype):
    good = (torch.randn(16, 16) * 10).to(dtype)
    assert _nonfinite({"w": good}) == []
    bad_bytes = [0x7F, 0xFF] if dtype == torch.float8_e4m3fn else [0x7C, 0xFC, 0x7E, 0xFF]
    for byte in bad_bytes:
        tensor = good.clone()
        tensor.view(torch.uint8)[5, 7] = byte
        assert _nonfinite({"w": good, "x": tensor}) == ["x"], hex(byte)
    assert _nonfinite({"max": torch.tensor([torch.finfo(dtype).max, torch.finfo(dtype).min]).to(dtype)}) == []


def test_largest_finite_values_pass_and_mixed_dtypes_keep_their_order():
    tensors = {
        "bf16_max": torch.tensor([torch.finfo(torch.bfloat16).max], dtype=torch.bfloat16),
        "f16_max": torch.tensor([-65504.0], dtype=torch.float16),
        "f64_big": torch.tensor([1e300], dtype=torch.float64),
        "ints": torch.arange(5),
        "bools": torch.ones(3, dtype=torch.bool),
        "empty": torch.empty(0, 7),
        "scalar": torch.tensor(2.0),
    }
    assert _nonfinite(tensors) == []
    tensors["z_last"] = torch.tensor([float("nan")])
    tensors["a_first"] = torch.tensor([float("inf")], dtype=torch.float64)
    tensors["e4m3"] = torch.full((4,), float("nan")).to(torch.float8_e4m3fn)
    assert _nonfinite(tensors) == ["z_last", "a_first", "e4m3"]


def test_check_finite_names_the_file_and_the_tensors():
    tensors = {f"block.{i}.weight": torch.full((2,), float("nan") if i % 2 else 1.0) for i in range(14)}
    with pytest.raises(CheckpointError) as info:
        check_finite(tensors, source=SOURCE)
    message = str(info.value)
    assert message.startswith("model.safetensors holds NaN or Inf values in 7 of the 14 tensors read ('block.1.weight'")
    assert "and 2 more" in message and "black or constant images" in message and "download it again" in message


def test_float_dtypes_from_headers():
    dtypes = {"a": "BF16", "b": "I64", "c": "F8_E4M3", "d": "BOOL", "e": "F32", "f": "U8"}
    assert non_float_tensors(dtypes) == {"b": "I64", "d": "BOOL", "f": "U8"}
    check_float_dtypes({"a": "BF16", "c": "F8_E4M3", "e": "F64"}, source=SOURCE)
    with pytest.raises(CheckpointError) as info:
        check_float_dtypes(dtypes, source=SOURCE)
    assert "holds 3 integer or boolean tensors where floating-point weights belong ('b' is I64, 'd' is BOOL, " \
           "'f' is U8)" in str(info.value)


# ----------------------------------------------------------------------------- load_tensors, the one reading path


@pytest.fixture
def poisoned(tmp_path) -> Path:
    path = tmp_path / "poisoned.safetensors"
    save_file({"a": torch.ones(4), "b": torch.tensor([1.0, float("inf")]), "c": torch.zeros(3)}, str(path))
    return path


def test_load_tensors_refuses_a_nonfinite_tensor(poisoned):
    with pytest.raises(CheckpointError, match=r"^poisoned\.safetensors holds NaN or Inf values in 1 of the 3 "
                                              r"tensors read \('b'\)"):
        load_tensors(poisoned)


def test_a_subset_of_keys_is_checked_as_read(poisoned):
    """A loader reading block by block (``keys=``) gets the check for exactly what it reads."""
    assert set(load_tensors(poisoned, keys=["a", "c"])) == {"a", "c"}
    with pytest.raises(CheckpointError, match=r"in 1 of the 2 tensors read \('b'\)"):
        load_tensors(poisoned, keys=["c", "b"])


def test_load_tensors_refuses_integer_tensors_before_reading(tmp_path):
    path = tmp_path / "ints.safetensors"
    save_file({"w": torch.ones(2, 2), "steps": torch.arange(3, dtype=torch.int32)}, str(path))
    with pytest.raises(CheckpointError, match=r"'steps' is I32"):
        load_tensors(path)
    assert set(load_tensors(path, keys=["w"])) == {"w"}


def test_read_tensors_checks_every_shard(tmp_path_factory, tmp_path):
    files = tiny("diffusers", "edit_2509", tmp_path_factory)
    shards = [tmp_path / p.name for p in files["dit"]]
    bad.edited(files["dit"][0], shards[0], lambda t: None)
    bad.edited(files["dit"][1], shards[1], lambda t: bad.poison(t, sorted(t)[-1]))
    from qwen_edit_hopper.qwen_edit.checkpoints import read_header

    with pytest.raises(CheckpointError) as info:
        read_tensors([read_header(p) for p in shards], device="cpu")
    assert str(info.value).startswith(shards[1].name)


# ----------------------------------------------------------------------------- the loaders: refused, nothing kept


def _live_tensor_bytes() -> int:
    gc.collect()
    return sum(o.numel() * o.element_size() for o in gc.get_objects()
               if issubclass(type(o), torch.Tensor) and not o.is_meta and o.device.type == "cpu")


def _live_modules() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.nn.Module))


PARTS = {
    "dit": (load_dit, "transformer_blocks.1.img_mod.1.weight"),
    "text_encoder": (load_text_encoder, "model.layers.0.mlp.down_proj.weight"),
    "text_encoder_fp8": (load_text_encoder, "model.layers.1.mlp.up_proj.scale_weight"),
    "vae": (load_vae, "decoder.upsamples.0.residual.2.weight"),
}


@pytest.mark.parametrize("part", list(PARTS))
def test_nonfinite_part_is_refused_and_nothing_stays_loaded(part, tmp_path, tmp_path_factory):
    files = tiny("comfy_single", "edit_2509", tmp_path_factory)
    paths = {"dit": files["dit"][0], "text_encoder": files["text_encoder"][0], "vae": files["vae"][0]}
    slot = "text_encoder" if part.startswith("text_encoder") else part
    source = files["text_encoder_fp8"] if part == "text_encoder_fp8" else paths[slot]
    load, key = PARTS[part]
    paths[slot] = bad.edited(source, tmp_path / f"nan_{part}.safetensors", lambda t: bad.poison(t, key))
    model_files = resolve_single_files(paths["dit"], paths["text_encoder"], paths["vae"])

    with pytest.raises(CheckpointError):  # a first failure: lazily created module-level state is not a leak
        load(model_files, device="cpu")
    before = (_live_tensor_bytes(), _live_modules())
    with pytest.raises(CheckpointError) as info:
        load(model_files, device="cpu")
    assert str(info.value).startswith(f"nan_{part}.safetensors holds NaN or Inf values in 1 of the")
    assert repr(key) in str(info.value)
    # even while the error is held (as the host holds it to report it), nothing it read stays referenced
    assert (_live_tensor_bytes(), _live_modules()) == before


# ----------------------------------------------------------------------------- LoRA files


def test_lora_with_nonfinite_factor_is_refused(tmp_path):
    path = tmp_path / "nan_lora.safetensors"
    save_file({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 64),
               "transformer_blocks.0.attn.to_q.lora_B.weight": torch.full((64, 4), float("nan"))}, str(path))
    with pytest.raises(LoraFileError) as info:
        load_safetensors(path)
    message = str(info.value)
    assert str(path) in message and "'transformer_blocks.0.attn.to_q.lora_B.weight'" in message
    assert "NaN or Inf" in message and "download it again" in message
    with pytest.raises(LoraFileError):
        load_lora(path, {"transformer_blocks.0.attn.to_q.weight": (64, 64)})
